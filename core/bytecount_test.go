package core

import (
	"math"
	"testing"
)

func TestParseBytes(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want uint64
	}{
		{"0", 0}, {"1", 1}, {"4096", 4096}, {" 8G ", 8 << 30}, {"8g", 8 << 30},
		{"1K", 1 << 10}, {"1KB", 1 << 10}, {"1KiB", 1 << 10}, {"2M", 2 << 20}, {"3GiB", 3 << 30},
		{"1T", 1 << 40}, {"16777215T", 16777215 << 40}, {"18446744073709551615", 1<<64 - 1}, {"12B", 12},
	} {
		got, err := ParseBytes(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParseBytes(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
	for _, in := range []string{"", "G", "KiB", "-1", "1.5G", "1P", "1 G", "0x10", "16777216T", "18446744073709551616", "bogus", "1GG"} {
		if got, err := ParseBytes(in); err == nil {
			t.Errorf("ParseBytes(%q) = %d, want an error", in, got)
		}
	}
}

func TestRoundUp(t *testing.T) {
	const g = 2 << 20
	cases := []struct {
		n, to, want uint64
		ok          bool
	}{
		{0, g, 0, true}, {1, g, g, true}, {g, g, g, true}, {g + 1, g, 2 * g, true},
		{3*g - 5, g, 3 * g, true}, {math.MaxUint64, g, 0, false},
		{math.MaxUint64 - g + 2, g, 0, false}, {5, 0, 0, false},
	}
	for _, c := range cases {
		got, ok := RoundUp(c.n, c.to)
		if got != c.want || ok != c.ok {
			t.Errorf("RoundUp(%d, %d) = %d, %v; want %d, %v", c.n, c.to, got, ok, c.want, c.ok)
		}
	}
}
