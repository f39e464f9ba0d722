package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"maps"
	"testing"
)

// TestCacheSalt: the salt is read as vLLM reads it (exact key once
// unescaped, the last of duplicates, null as none, nested members
// ignored), and a salt that is not a non-empty string is refused as vLLM
// refuses it — for completions and chats; other kinds are lenient.
func TestCacheSalt(t *testing.T) {
	tests := []struct {
		name, body string
		want       string
		bad        bool
	}{
		{"absent", `{"model":"m","prompt":"hi"}`, "", false},
		{"string", `{"model":"m","prompt":"hi","cache_salt":"s1"}`, "s1", false},
		{"first member", `{"cache_salt":"s1","model":"m","prompt":"hi"}`, "s1", false},
		{"null", `{"model":"m","prompt":"hi","cache_salt":null}`, "", false},
		{"escaped key", `{"model":"m","prompt":"hi","cache\u005fsalt":"s2"}`, "s2", false},
		{"escaped letter", `{"model":"m","prompt":"hi","\u0063ache_salt":"s3"}`, "s3", false},
		{"escaped value", `{"model":"m","prompt":"hi","cache_salt":"a\"b\u00e9"}`, "a\"bé", false},
		{"last wins", `{"model":"m","cache_salt":"a","prompt":"hi","cache_salt":"b"}`, "b", false},
		{"null after string", `{"model":"m","cache_salt":"a","prompt":"hi","cache_salt":null}`, "", false},
		{"good after bad", `{"model":"m","cache_salt":"","prompt":"hi","cache_salt":"b"}`, "b", false},
		{"other case is another field", `{"model":"m","prompt":"hi","Cache_Salt":"x","CACHE_SALT":"y"}`, "", false},
		{"nested is not the salt", `{"model":"m","prompt":"hi","extra":{"cache_salt":"x"},"stop":["cache_salt"]}`, "", false},
		{"in the prompt text", `{"model":"m","prompt":"\"cache_salt\":\"x\""}`, "", false},
		{"empty", `{"model":"m","prompt":"hi","cache_salt":""}`, "", true},
		{"number", `{"model":"m","prompt":"hi","cache_salt":5}`, "", true},
		{"list", `{"model":"m","prompt":"hi","cache_salt":["a"]}`, "", true},
		{"bool", `{"model":"m","prompt":"hi","cache_salt":true}`, "", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := ParseRequest(KindCompletion, []byte(tt.body))
			if tt.bad {
				if !errors.Is(err, ErrBadRequest) || err.Error() != errCacheSalt.Error() {
					t.Fatalf("err = %v, want vLLM's cache_salt error", err)
				}
				// Other kinds are forwarded as they are, unsalted.
				if r, err := ParseRequest(KindOther, []byte(tt.body)); err != nil || r.CacheSalt != "" {
					t.Errorf("KindOther: salt %q, err %v; want none, no error", r.CacheSalt, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if r.CacheSalt != tt.want {
				t.Errorf("CacheSalt = %q, want %q", r.CacheSalt, tt.want)
			}
		})
	}
	chat := `{"model":"m","messages":[{"role":"user","content":"hi"}],"cache_salt":"c"}`
	if r, err := ParseRequest(KindChat, []byte(chat)); err != nil || r.CacheSalt != "c" {
		t.Errorf("chat: salt %q, err %v; want c", r.CacheSalt, err)
	}
}

// TestWithCacheSalt: the body keeps every other member byte for byte, and
// the replica reads exactly the salt set, whatever salts the client sent.
func TestWithCacheSalt(t *testing.T) {
	tests := []struct{ body, want string }{
		{`{"model":"m","prompt":"hi"}`, `{"model":"m","prompt":"hi","cache_salt":"T"}`},
		{`{}`, `{"cache_salt":"T"}`},
		{` { } `, `{"cache_salt":"T"}`},
		{`{"cache_salt":"mine"}`, `{"cache_salt":"T"}`},
		{`{"cache_salt":"a","model":"m", "prompt" : [1, 2],"cache\u005fsalt":"b","Cache_Salt":"c"}`,
			`{"model":"m","prompt" : [1, 2],"Cache_Salt":"c","cache_salt":"T"}`},
		{`{"model":"m","extra":{"cache_salt":"x"}}`, `{"model":"m","extra":{"cache_salt":"x"},"cache_salt":"T"}`},
	}
	for _, tt := range tests {
		got, err := WithCacheSalt([]byte(tt.body), "T")
		if err != nil {
			t.Fatalf("%s: %v", tt.body, err)
		}
		if string(got) != tt.want {
			t.Errorf("WithCacheSalt(%s) = %s, want %s", tt.body, got, tt.want)
		}
	}
	for _, bad := range []string{``, `[]`, `"x"`, `{"a":1`, `{"a":1}x`} {
		if _, err := WithCacheSalt([]byte(bad), "T"); !errors.Is(err, ErrBadRequest) {
			t.Errorf("WithCacheSalt(%q): err %v, want ErrBadRequest", bad, err)
		}
	}
	// A salt with characters JSON escapes survives the round trip.
	got, _ := WithCacheSalt([]byte(`{"a":1}`), "q\"\\\n<é")
	if s, err := CacheSalt(got); err != nil || s != "q\"\\\n<é" {
		t.Errorf("round trip: %q, %v", s, err)
	}
}

// FuzzCacheSalt holds CacheSalt and WithCacheSalt to a reference, Go's
// decoding into a map (exact keys, the last duplicate wins): the salt read
// is the map's, and the rewritten body has the same other members and
// exactly the salt set.
func FuzzCacheSalt(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","prompt":"hi","cache_salt":"s1"}`,
		`{"cache_salt":"a","x":{"cache_salt":"b"},"cache\u005fsalt":null}`,
		`{"cache_salt":5}`, `{"\u0063ache_salt":"z"}`, `[1]`, `{}`, `{"a":"\ud800"}`,
	} {
		f.Add([]byte(s), "salt")
	}
	f.Fuzz(func(t *testing.T, body []byte, salt string) {
		var m map[string]json.RawMessage
		if !json.Valid(body) || json.Unmarshal(body, &m) != nil || m == nil {
			if s, err := CacheSalt(body); s != "" || err != nil {
				t.Fatalf("not an object: salt %q, err %v", s, err)
			}
			return
		}
		got, err := CacheSalt(body)
		raw, has := m[cacheSaltKey]
		var want string
		wantBad := false
		if has && !bytes.Equal(raw, []byte("null")) {
			if json.Unmarshal(raw, &want) != nil || want == "" {
				want, wantBad = "", true
			}
		}
		if got != want || (err != nil) != wantBad {
			t.Fatalf("CacheSalt = %q, %v; want %q (bad %v)", got, err, want, wantBad)
		}
		out, err := WithCacheSalt(body, salt)
		if err != nil {
			t.Fatal(err)
		}
		var m2 map[string]json.RawMessage
		if err := json.Unmarshal(out, &m2); err != nil {
			t.Fatalf("rewritten body %s: %v", out, err)
		}
		qs, _ := json.Marshal(salt)
		var ref string // the salt as JSON carries it (bad UTF-8 replaced)
		_ = json.Unmarshal(qs, &ref)
		if s, err := CacheSalt(out); s != ref || (err != nil) != (ref == "") {
			t.Fatalf("rewritten body %s: salt %q, %v; want %q", out, s, err, ref)
		}
		delete(m, cacheSaltKey)
		delete(m2, cacheSaltKey)
		if !maps.EqualFunc(m, m2, func(a, b json.RawMessage) bool { return bytes.Equal(a, b) }) {
			t.Fatalf("members changed: %s → %s", body, out)
		}
	})
}
