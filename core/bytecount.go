package core

import (
	"errors"
	"math"
	"strconv"
	"strings"
)

// RoundUp rounds n up to a multiple of to; ok is false on overflow or when
// to is 0.
func RoundUp(n, to uint64) (r uint64, ok bool) {
	if to == 0 || n > math.MaxUint64-(to-1) {
		return 0, false
	}
	return (n + to - 1) / to * to, true
}

// ParseBytes reads a byte count: digits with an optional K, M, G or T
// (powers of 1024, optionally followed by "iB" or "B").
func ParseBytes(s string) (uint64, error) {
	s = strings.TrimSpace(s)
	mult := uint64(1)
	up := strings.ToUpper(s)
	for _, suf := range []string{"IB", "B"} {
		if strings.HasSuffix(up, suf) && len(up) > len(suf) {
			up = up[:len(up)-len(suf)]
			break
		}
	}
	if n := len(up); n > 0 {
		if i := strings.IndexByte("KMGT", up[n-1]); i >= 0 {
			mult = 1 << (10 * (i + 1))
			up = up[:n-1]
		}
	}
	n, err := strconv.ParseUint(up, 10, 64)
	if err != nil {
		return 0, errors.New("not a byte count")
	}
	if n > ^uint64(0)/mult {
		return 0, errors.New("too large")
	}
	return n * mult, nil
}
