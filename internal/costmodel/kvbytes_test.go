package costmodel

import "testing"

func TestKVBytesOf(t *testing.T) {
	qwen, err := Lookup(Qwen3_32BH100x2)
	if err != nil {
		t.Fatal(err)
	}
	scaled, err := Resolve(Qwen3_32BH100x2 + ":time_scale=0.5")
	if err != nil {
		t.Fatal(err)
	}
	mistral, err := Lookup(Mistral7BA6000)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		p    Profile
		want float64
	}{
		// Qwen3-32B's config.json: 2·64 layers·8 KV heads·128·2 bytes.
		{"qwen3 roofline", qwen, 2 * 64 * 8 * 128 * 2},
		{"scaled keeps the base's", scaled, 2 * 64 * 8 * 128 * 2},
		{"fitted profile: unknown", mistral, 0},
	} {
		if got := KVBytesOf(tc.p); got != tc.want {
			t.Errorf("%s: KVBytesOf = %v, want %v", tc.name, got, tc.want)
		}
	}
}
