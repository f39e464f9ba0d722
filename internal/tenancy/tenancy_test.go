package tenancy

import (
	"net/http"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/openai"
)

func TestSalt(t *testing.T) {
	a := Salt("", "tenant-a", "")
	if !strings.HasPrefix(a, SaltPrefix) || len(a) != len(SaltPrefix)+43 {
		t.Fatalf("Salt = %q: want %s and 43 base64url characters", a, SaltPrefix)
	}
	if Salt("", "tenant-a", "") != a {
		t.Error("Salt is not deterministic")
	}
	distinct := map[string]string{}
	for _, c := range []struct{ secret, tenant, client string }{
		{"", "tenant-a", ""}, {"", "tenant-b", ""}, {"", "", ""}, {"", "tenant-a", "x"},
		{"", "ab", "c"}, {"", "a", "bc"}, {"k", "tenant-a", ""}, {"", "", "tenant-a"},
	} {
		s := Salt(c.secret, c.tenant, c.client)
		if prev, ok := distinct[s]; ok {
			t.Errorf("%+v and %s share the salt %s", c, prev, s)
		}
		distinct[s] = c.secret + "|" + c.tenant + "|" + c.client
	}
}

func TestParseExplain(t *testing.T) {
	for in, want := range map[string]Explain{"": ExplainTrusted, "never": ExplainNever, "Trusted": ExplainTrusted,
		"always": ExplainAlways, "true": ExplainAlways, "false": ExplainNever} {
		got, err := ParseExplain(in, ExplainTrusted)
		if err != nil || got != want {
			t.Errorf("ParseExplain(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := ParseExplain("sometimes", ExplainNever); err == nil {
		t.Error("ParseExplain(sometimes): no error")
	}
	if err := Explain("").Validate(); err == nil {
		t.Error(`Explain("").Validate(): no error`)
	}
	for _, c := range []struct {
		e                 Explain
		trusted, untrusts bool
	}{{ExplainNever, false, false}, {ExplainTrusted, true, false}, {ExplainAlways, true, true}} {
		if c.e.For(true) != c.trusted || c.e.For(false) != c.untrusts {
			t.Errorf("%s: For(true) %v, For(false) %v", c.e, c.e.For(true), c.e.For(false))
		}
	}
	var e Explain
	f := ExplainFlag{&e}
	if err := f.Set("never"); err != nil || e != ExplainNever || f.String() != "never" {
		t.Errorf("flag: %q, %v", e, err)
	}
}

func TestToken(t *testing.T) {
	tok := NewToken("s3cret")
	h := func(kv ...string) func(string) string {
		hd := http.Header{}
		for i := 0; i < len(kv); i += 2 {
			hd.Set(kv[i], kv[i+1])
		}
		return hd.Get
	}
	for _, c := range []struct {
		get  func(string) string
		want bool
	}{
		{h(), false},
		{h(TokenHeader, "s3cret"), true},
		{h(TokenHeader, " s3cret "), true},
		{h("Authorization", "Bearer s3cret"), true},
		{h("Authorization", "Bearer other", TokenHeader, "s3cret"), true},
		{h("Authorization", "s3cret"), false},
		{h(TokenHeader, "s3cre"), false},
		{h(TokenHeader, "s3crett"), false},
	} {
		if got := tok.Presented(c.get); got != c.want {
			t.Errorf("Presented = %v, want %v", got, c.want)
		}
	}
	if (Token{}).Presented(h(TokenHeader, "")) || NewToken("").Set() {
		t.Error("an unset token is presented")
	}
}

func TestIsolationApply(t *testing.T) {
	body := []byte(`{"model":"m","prompt":"hi","cache_salt":"mine"}`)
	req, err := openai.ParseRequest(openai.KindCompletion, body)
	if err != nil {
		t.Fatal(err)
	}
	out, err := Isolation{}.Apply(req, body, "a")
	if err != nil || string(out) != string(body) || req.CacheSalt != "mine" {
		t.Fatalf("off: body %s, salt %q, %v; want unchanged", out, req.CacheSalt, err)
	}
	iso := Isolation{On: true, Secret: "k"}
	out, err = iso.Apply(req, body, "a")
	if err != nil {
		t.Fatal(err)
	}
	want := Salt("k", "a", "mine")
	if req.CacheSalt != want {
		t.Errorf("salt %q, want %q", req.CacheSalt, want)
	}
	if got, _ := openai.CacheSalt(out); got != want {
		t.Errorf("the body carries %q, want %q", got, want)
	}
	// Another kind's body that is not JSON goes on as it is.
	other := &openai.Request{Kind: openai.KindOther}
	if out, err := iso.Apply(other, []byte("not json"), "a"); err != nil || string(out) != "not json" || other.CacheSalt != Salt("k", "a", "") {
		t.Errorf("other kind: %s, %q, %v", out, other.CacheSalt, err)
	}
}
