package loadgen

import (
	"errors"
	"io"
	"strings"
	"testing"
	"testing/iotest"
)

// parseAll reads every event from r and the error that ended the stream.
func parseAll(r io.Reader, maxLine int) ([]sseEvent, error) {
	s := newSSEReader(r, maxLine)
	var evs []sseEvent
	for {
		ev, err := s.Next()
		if err != nil {
			return evs, err
		}
		evs = append(evs, ev)
	}
}

func TestSSEReader(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    []sseEvent
		wantErr error
	}{
		{
			name: "vllm stream",
			in:   "data: {\"a\":1}\n\ndata: {\"a\":2}\n\ndata: [DONE]\n\n",
			want: []sseEvent{{Data: `{"a":1}`}, {Data: `{"a":2}`}, {Data: "[DONE]"}},
		},
		{
			name: "crlf and lone cr",
			in:   "data: x\r\n\r\ndata: y\r\rdata:z\n\n",
			want: []sseEvent{{Data: "x"}, {Data: "y"}, {Data: "z"}},
		},
		{
			name: "comments, ids, retry and unknown fields ignored",
			in:   ": ping\nid: 7\nretry: 100\nfoo: bar\ndata: x\n\n:\n\n",
			want: []sseEvent{{Data: "x"}},
		},
		{
			name: "multi-line data joined with newline",
			in:   "data: a\ndata:b\ndata\n\n",
			want: []sseEvent{{Data: "a\nb\n"}},
		},
		{
			name: "only one leading space stripped",
			in:   "data:  two\n\n",
			want: []sseEvent{{Data: " two"}},
		},
		{
			name: "named event",
			in:   "event: error\ndata: {\"message\":\"boom\"}\n\n",
			want: []sseEvent{{Name: "error", Data: `{"message":"boom"}`}},
		},
		{
			name: "event without data not dispatched",
			in:   "event: x\n\nid: 1\n\ndata: y\n\n",
			want: []sseEvent{{Data: "y"}},
		},
		{
			name: "extra blank lines",
			in:   "\n\n\ndata: x\n\n\n\n",
			want: []sseEvent{{Data: "x"}},
		},
		{
			name:    "cut before blank line",
			in:      "data: x\n\ndata: {\"a\":",
			want:    []sseEvent{{Data: "x"}},
			wantErr: io.ErrUnexpectedEOF,
		},
		{
			name:    "cut after data line",
			in:      "data: x\n",
			wantErr: io.ErrUnexpectedEOF,
		},
		{
			name:    "empty",
			in:      "",
			wantErr: io.EOF,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wantErr := tt.wantErr
			if wantErr == nil {
				wantErr = io.EOF
			}
			for _, r := range []struct {
				name string
				r    io.Reader
			}{
				{"whole", strings.NewReader(tt.in)},
				{"one byte at a time", iotest.OneByteReader(strings.NewReader(tt.in))},
				{"half", iotest.HalfReader(strings.NewReader(tt.in))},
			} {
				got, err := parseAll(r.r, 0)
				if !errors.Is(err, wantErr) {
					t.Errorf("%s: err = %v, want %v", r.name, err, wantErr)
				}
				if !equalEvents(got, tt.want) {
					t.Errorf("%s: events = %q, want %q", r.name, got, tt.want)
				}
			}
		})
	}
}

func TestSSEReaderLongLines(t *testing.T) {
	// A line longer than bufio's buffer is reassembled.
	long := strings.Repeat("x", 200<<10)
	got, err := parseAll(strings.NewReader("data: "+long+"\n\n"), 0)
	if err != io.EOF || len(got) != 1 || got[0].Data != long {
		t.Fatalf("long line: %d events, err %v", len(got), err)
	}
	// Over the limit: ErrLineTooLong, for one long line and for many
	// data lines that add up.
	for _, in := range []string{
		"data: " + strings.Repeat("x", 1000) + "\n\n",
		strings.Repeat("data: "+strings.Repeat("x", 100)+"\n", 20) + "\n",
	} {
		_, err = parseAll(strings.NewReader(in), 512)
		if !errors.Is(err, ErrLineTooLong) {
			t.Errorf("err = %v, want ErrLineTooLong", err)
		}
	}
}

func equalEvents(a, b []sseEvent) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// FuzzSSE checks that the parser never panics, that where the input is split
// across reads changes neither the events nor the final error, and that the
// size limit holds.
func FuzzSSE(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data: x\r\n\r\n: comment\r\ndata: y\r\rdata: z\n\n"))
	f.Add([]byte("event: error\ndata: a\ndata: b\n\ndata: cut"))
	f.Fuzz(func(t *testing.T, in []byte) {
		const maxLine = 256
		whole, errWhole := parseAll(strings.NewReader(string(in)), maxLine)
		bytewise, errBytewise := parseAll(iotest.OneByteReader(strings.NewReader(string(in))), maxLine)
		if !equalEvents(whole, bytewise) {
			t.Fatalf("split changes events: %q vs %q", whole, bytewise)
		}
		if !errors.Is(errBytewise, errWhole) && !(errors.Is(errWhole, ErrLineTooLong) && errors.Is(errBytewise, ErrLineTooLong)) {
			t.Fatalf("split changes error: %v vs %v", errWhole, errBytewise)
		}
		for _, ev := range whole {
			if len(ev.Data) > maxLine {
				t.Fatalf("event data of %d bytes exceeds limit %d", len(ev.Data), maxLine)
			}
		}
	})
}
