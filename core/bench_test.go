package core

import (
	"fmt"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The benchmarks' buffer: 4096 chunks of 64 KiB.
const (
	benchChunks    = 4096
	benchChunkSize = 64 << 10
	benchSize      = benchChunks * benchChunkSize
)

// benchBuffer is a server of the benchmark's own and a memfd of benchSize
// bytes for it to register, both closed at the end.
func benchBuffer(b *testing.B) (*Server, int) {
	b.Helper()
	fd := newMemfd(b, benchSize, nil)
	b.Cleanup(func() { unix.Close(fd) })
	return newTestServer(b), fd
}

// BenchmarkHostImport moves 4096 chunks of 64 KiB of host memory through a
// real server and stream (one process, a real Unix socket, one descriptor
// per chunk) into a reserved range, with the receiver in lockstep and with
// the default window, bypassing the import cache. It guards the transport's
// own cost: host chunks map in a few microseconds, so what it measures is
// mostly the handshake, socket round trips, wake-ups, copies and allocation
// per chunk. Reports MB/s and us/chunk. BenchmarkHostImportCached measures
// a cache hit of the same buffer: one authenticated round trip.
//
//	go test -run '^$' -bench HostImport -benchmem ./core
func BenchmarkHostImport(b *testing.B) {
	s, fd := benchBuffer(b)
	for _, window := range []uint32{1, DefaultWindow} {
		b.Run(fmt.Sprintf("window=%d", window), func(b *testing.B) {
			b.SetBytes(benchSize)
			b.ReportAllocs()
			for b.Loop() {
				b.StopTimer() // registering is the sender's, before the wait
				tk := registerFile(b, s, fd, benchSize, benchChunkSize, RegisterOptions{Uses: 1})
				b.StartTimer()
				m, err := Import(tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Window: window}, NoCache: true}, nil)
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				if err := Unmap(m.ID, m.Base); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/benchChunks, "us/chunk")
		})
	}
}

func BenchmarkHostImportCached(b *testing.B) {
	s, fd := benchBuffer(b)
	tk := registerFile(b, s, fd, benchSize, benchChunkSize, RegisterOptions{})
	first := importHost(b, tk, ImportOptions{}) // the miss; held so every import below hits
	defer Unmap(first.ID, first.Base)
	b.ReportAllocs()
	for b.Loop() {
		m, err := Import(tk, DeviceHost, ImportOptions{}, nil)
		if err != nil {
			b.Fatal(err)
		}
		if m.Base != first.Base {
			b.Fatalf("import at %#x, not the cached %#x", m.Base, first.Base)
		}
		if err := Unmap(m.ID, m.Base); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkConfirm is a plain confirmation (a cache hit's session) in the
// one-round form and, for comparison, in two rounds.
//
//	go test -run '^$' -bench Confirm -benchmem ./core
func BenchmarkConfirm(b *testing.B) {
	s, fd := benchBuffer(b)
	tk := registerFile(b, s, fd, benchSize, benchChunkSize, RegisterOptions{})
	for _, one := range []bool{true, false} {
		b.Run(fmt.Sprintf("oneRound=%v", one), func(b *testing.B) {
			oneRoundEnabled = one
			defer func() { oneRoundEnabled = true }()
			for b.Loop() {
				if _, err := confirm(tk, 5*time.Second); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkHeldUse is a held use answered and let go of, one after the
// other: the shape of a loop of one-tensor sends (torch's send_many).
//
//	go test -run '^$' -bench HeldUse -benchmem ./core
func BenchmarkHeldUse(b *testing.B) {
	s, fd := benchBuffer(b)
	tk := registerFile(b, s, fd, benchSize, benchChunkSize, RegisterOptions{Hold: true})
	for b.Loop() {
		if _, err := useHeld(tk, 5*time.Second); err != nil {
			b.Fatal(err)
		}
		if err := Release(tk); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRegisterAgain is a pickle's grant: a new registration of a live
// anchor, ended at once (as a receiver's use would), so the registry and
// the grant table stay the size a re-send loop keeps them.
//
//	go test -run '^$' -bench RegisterAgain -benchmem ./core
func BenchmarkRegisterAgain(b *testing.B) {
	s, fd := benchBuffer(b)
	anchor := registerFile(b, s, fd, benchSize, benchChunkSize, RegisterOptions{})
	b.ReportAllocs()
	for b.Loop() {
		t, err := s.RegisterAgain(anchor, RegisterOptions{Uses: 1})
		if err != nil {
			b.Fatal(err)
		}
		if err := s.Unregister(t); err != nil {
			b.Fatal(err)
		}
	}
}
