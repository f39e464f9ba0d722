package proxy

import (
	"net/http"
	"runtime"
	"strings"
	"testing"
)

// TestPprofBehindAdminToken checks that /debug/pprof/ answers only with
// the admin token when one is set, and is open (as the other /debug
// endpoints are) when none is; and that a delta mutex or block profile
// turns their sampling on for its duration only.
func TestPprofBehindAdminToken(t *testing.T) {
	rep := newFakeReplica(t, "a")
	get := func(url, token string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest("GET", url, nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, string(readAll(t, resp))
	}
	cfg := testConfig(rep)
	cfg.AdminToken = "s3cret"
	_, srv := startProxy(t, cfg)
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/goroutine?debug=1", "/debug/pprof/cmdline",
		"/debug/pprof/symbol", "/debug/pprof/profile?seconds=1", "/debug/pprof/trace?seconds=1", "/debug/pprof/mutex?seconds=1"} {
		for _, tok := range []string{"", "wrong"} {
			if code, body := get(srv.URL+path, tok); code != http.StatusUnauthorized || !strings.Contains(body, "authentication_error") {
				t.Errorf("%s with token %q: %d %.80s", path, tok, code, body)
			}
		}
	}
	if code, body := get(srv.URL+"/debug/pprof/", "s3cret"); code != 200 || !strings.Contains(body, "goroutine") {
		t.Errorf("index with the token: %d %.80s", code, body)
	}
	if code, body := get(srv.URL+"/debug/pprof/goroutine?debug=1", "s3cret"); code != 200 || !strings.Contains(body, "goroutine profile") {
		t.Errorf("goroutines with the token: %d %.80s", code, body)
	}
	for _, name := range []string{"mutex", "block"} {
		if code, _ := get(srv.URL+"/debug/pprof/"+name+"?seconds=1", "s3cret"); code != 200 {
			t.Errorf("%s delta profile: %d", name, code)
		}
	}
	if f := runtime.SetMutexProfileFraction(-1); f != 0 {
		t.Errorf("mutex profile fraction %d after the delta profile, want 0", f)
	}

	open := testConfig(rep)
	_, srv2 := startProxy(t, open)
	if code, body := get(srv2.URL+"/debug/pprof/", ""); code != 200 || !strings.Contains(body, "goroutine") {
		t.Errorf("index without an admin token configured: %d %.80s", code, body)
	}
}
