package core

import (
	"errors"
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
	w := wrapErr(EIO, err, "chunk %d of %d", 3, 9)
	if got, want := w.Error(), "chunk 3 of 9: mmap reserve of 4096 bytes: cannot allocate memory"; got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
	if !errors.Is(w, syscall.ENOMEM) {
		t.Fatal("wrapErr lost the cause")
	}
}
