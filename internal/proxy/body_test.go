package proxy

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"testing/iotest"
)

// BenchmarkReadBody reads an honest client's 25 KB body (a 4k-token prompt,
// Content-Length declared) under the default body budget: one buffer of
// its size, no copy.
func BenchmarkReadBody(b *testing.B) {
	body := bytes.Repeat([]byte("a"), 25000)
	w := httptest.NewRecorder()
	budget := newByteBudget(DefaultMaxInflightBodyBytes)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		r, _ := http.NewRequest("POST", "/v1/completions", bytes.NewReader(body))
		got, held, err := readBodyWithin(w, r, 16<<20, budget)
		if err != nil || len(got) != len(body) {
			b.Fatal(err)
		}
		budget.release(held)
	}
}

// FuzzReadBody reads bodies of any bytes, declared or not, truthfully or
// not, arriving in pieces of any size, against io.ReadAll: the same bytes,
// or an error; the budget holds what readBodyWithin says it holds, and
// nothing once released; the buffer is never over the body's size by more
// than it doubles.
func FuzzReadBody(f *testing.F) {
	f.Add([]byte(`{"model":"m","prompt":"hi"}`), int64(-1), uint16(1), int64(1<<20))
	f.Add(bytes.Repeat([]byte("x"), 70000), int64(70000), uint16(4096), int64(1<<20))
	f.Add(bytes.Repeat([]byte("x"), 70000), int64(-1), uint16(7), int64(1<<20))
	f.Add(bytes.Repeat([]byte("y"), 5000), int64(5000), uint16(100), int64(4999))
	f.Add([]byte{}, int64(0), uint16(1), int64(10))
	f.Fuzz(func(t *testing.T, data []byte, declared int64, piece uint16, limit int64) {
		if limit <= 0 || limit > 1<<22 || piece == 0 {
			return
		}
		if declared >= 0 {
			declared = int64(len(data)) // net/http reads exactly the declared length
		}
		budget := newByteBudget(4 << 20)
		r := httptest.NewRequest("POST", "/v1/completions", nil)
		r.Body = io.NopCloser(iotest.OneByteReader(io.LimitReader(bytes.NewReader(data), int64(len(data)))))
		if piece > 1 {
			r.Body = io.NopCloser(&pieces{data: data, n: int(piece)})
		}
		r.ContentLength = declared
		got, held, err := readBodyWithin(httptest.NewRecorder(), r, limit, budget)
		if err != nil {
			if budget.held() != 0 || held != 0 {
				t.Fatalf("error %v left %d bytes held", err, budget.held())
			}
			if int64(len(data)) <= limit {
				t.Fatalf("%d bytes under the limit %d: %v", len(data), limit, err)
			}
			return
		}
		if int64(len(data)) > limit {
			t.Fatalf("%d bytes over the limit %d read without error", len(data), limit)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("read %d bytes, want %d", len(got), len(data))
		}
		if held != int64(cap(got)) || budget.held() != held {
			t.Fatalf("held %d, budget %d, buffer %d", held, budget.held(), cap(got))
		}
		if c := int64(cap(got)); c > max(2*int64(len(got)), unknownBodyBytes)+2*bytes.MinRead {
			t.Fatalf("a %d-byte body in a %d-byte buffer", len(got), c)
		}
		budget.release(held)
		if budget.held() != 0 {
			t.Fatalf("%d bytes held after release", budget.held())
		}
	})
}

// pieces reads data n bytes at a time.
type pieces struct {
	data []byte
	n    int
}

func (p *pieces) Read(b []byte) (int, error) {
	if len(p.data) == 0 {
		return 0, io.EOF
	}
	k := copy(b[:min(len(b), p.n)], p.data)
	p.data = p.data[k:]
	return k, nil
}
