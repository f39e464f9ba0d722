package loadgen

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
)

// DefaultMaxLine is the longest SSE line the parser accepts by default: a
// chunk carrying a long completion or a big usage object fits many times.
const DefaultMaxLine = 8 << 20

// ErrLineTooLong is returned by the SSE parser for a line longer than its
// limit.
var ErrLineTooLong = errors.New("loadgen: sse line too long")

// sseEvent is one dispatched Server-Sent Event.
type sseEvent struct {
	// Name is the event's "event:" field ("" when absent: a "message").
	Name string
	// Data is the event's "data:" lines joined with "\n".
	Data string
}

// sseReader parses a Server-Sent Events stream (the WHATWG HTML "server-sent
// events" event-stream format) as OpenAI-compatible servers send it:
// "data: {json}" lines, a blank line after each event, "data: [DONE]" last.
//
// Lines end in "\n", "\r\n" or a lone "\r" (a lone "\r" is only recognised
// once the "\n" that ends its read arrives, which costs nothing with real
// servers). Lines starting with ":" are comments; fields other than "data"
// and "event" ("id", "retry", unknown ones) are ignored. An event is
// dispatched at a blank line if it has data. Where the input is split
// across reads does not change the events.
//
// sseReader is not safe for concurrent use.
type sseReader struct {
	r       *bufio.Reader
	maxLine int
	line    []byte // the current line, accumulated across ErrBufferFull
	pending [][]byte
	data    bytes.Buffer
	name    string
	hasData bool
}

// newSSEReader returns a parser reading from r that accepts lines up to
// maxLine bytes (DefaultMaxLine if maxLine ≤ 0).
func newSSEReader(r io.Reader, maxLine int) *sseReader {
	if maxLine <= 0 {
		maxLine = DefaultMaxLine
	}
	return &sseReader{r: bufio.NewReaderSize(r, 64<<10), maxLine: maxLine}
}

// Next returns the next event. At the end of the input it returns io.EOF
// if the input ended between events, or io.ErrUnexpectedEOF if it ended
// inside one (an event without its blank line is not dispatched); other
// errors are the reader's, or ErrLineTooLong.
func (s *sseReader) Next() (sseEvent, error) {
	for {
		line, err := s.nextLine()
		if err != nil {
			if err == io.EOF && (s.hasData || s.name != "") {
				return sseEvent{}, io.ErrUnexpectedEOF
			}
			return sseEvent{}, err
		}
		if len(line) == 0 {
			if !s.hasData {
				s.name = "" // an event without data is not dispatched
				continue
			}
			ev := sseEvent{Name: s.name, Data: s.data.String()}
			s.data.Reset()
			s.name, s.hasData = "", false
			return ev, nil
		}
		if line[0] == ':' {
			continue // comment, e.g. a keep-alive ": ping"
		}
		field, value := line, []byte(nil)
		if i := bytes.IndexByte(line, ':'); i >= 0 {
			field, value = line[:i], line[i+1:]
			value = bytes.TrimPrefix(value, []byte{' '})
		}
		switch string(field) {
		case "data":
			if s.hasData {
				s.data.WriteByte('\n')
			}
			if s.data.Len()+len(value) > s.maxLine {
				return sseEvent{}, fmt.Errorf("%w: event data over %d bytes", ErrLineTooLong, s.maxLine)
			}
			s.data.Write(value)
			s.hasData = true
		case "event":
			s.name = string(value)
		}
	}
}

// nextLine returns the next line without its terminator. The slice is valid
// until the next call.
func (s *sseReader) nextLine() ([]byte, error) {
	if len(s.pending) > 0 {
		l := s.pending[0]
		s.pending = s.pending[1:]
		return l, nil
	}
	s.line = s.line[:0]
	for {
		frag, err := s.r.ReadSlice('\n')
		if len(s.line)+len(frag) > s.maxLine+2 {
			return nil, fmt.Errorf("%w: over %d bytes", ErrLineTooLong, s.maxLine)
		}
		s.line = append(s.line, frag...)
		if err == bufio.ErrBufferFull {
			continue
		}
		if err != nil && (err != io.EOF || len(s.line) == 0) {
			return nil, err
		}
		if err == io.EOF {
			// A final line without a terminator ends inside an event: it
			// may be cut short, so it is not processed.
			return nil, io.ErrUnexpectedEOF
		}
		break
	}
	l := bytes.TrimSuffix(s.line, []byte{'\n'})
	l = bytes.TrimSuffix(l, []byte{'\r'})
	if bytes.IndexByte(l, '\r') < 0 {
		return l, nil
	}
	// Lone "\r" line breaks inside the segment.
	parts := bytes.Split(l, []byte{'\r'})
	s.pending = parts[1:]
	return parts[0], nil
}
