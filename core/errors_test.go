package core

import (
	"errors"
	"strings"
	"syscall"
	"testing"
)

func TestErrorfWrapsOnce(t *testing.T) {
	err := Errorf(EIO, "mmap reserve of %d bytes: %w", 4096, syscall.ENOMEM)
	if got, want := err.Error(), "mmap reserve of 4096 bytes: cannot allocate memory"; got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
	if !errors.Is(err, syscall.ENOMEM) || CodeOf(err) != EIO {
		t.Fatalf("cause or code lost: %v", err)
	}
	w := WrapErr(EIO, err, "chunk %d of %d", 3, 9)
	if got, want := w.Error(), "chunk 3 of 9: mmap reserve of 4096 bytes: cannot allocate memory"; got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
	if !errors.Is(w, syscall.ENOMEM) {
		t.Fatal("wrapErr lost the cause")
	}
}

// TestCodes: every status of vmmipc.h, most negative first, each with its
// name; IsError holds for exactly the negative ones.
func TestCodes(t *testing.T) {
	cs := Codes()
	if len(cs) != 15 || cs[0] != ECONFIG || cs[len(cs)-1] != End {
		t.Fatalf("Codes() = %v, want VMMIPC_ECONFIG (-13) .. VMMIPC_END (1)", cs)
	}
	for i, c := range cs {
		if int(c) != -13+i {
			t.Fatalf("Codes()[%d] = %d", i, c)
		}
		if c.IsError() != (c < 0) {
			t.Errorf("%v.IsError() = %v", c, c.IsError())
		}
		if s := c.String(); !strings.HasPrefix(s, "VMMIPC_") || strings.Contains(s, "UNKNOWN") {
			t.Errorf("code %d is named %q", c, s)
		}
	}
	for _, c := range []Code{ECONFIG - 1, End + 1} {
		if c.IsError() || !strings.Contains(c.String(), "UNKNOWN") {
			t.Errorf("code %d: IsError %v, named %q", c, c.IsError(), c.String())
		}
	}
	if ENOMEM != -11 || ETIMEDOUT != -12 || ECONFIG != -13 {
		t.Fatal("ENOMEM, ETIMEDOUT or ECONFIG differ from vmmipc.h")
	}
}
