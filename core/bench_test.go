package core

import (
	"fmt"
	"testing"

	"golang.org/x/sys/unix"
)

// BenchmarkHostImport moves 4096 chunks of 64 KiB of host memory through a
// real server and stream (one process, a real Unix socket, one descriptor
// per chunk) into a reserved range, with the receiver in lockstep and with
// the default window. It guards the transport's own cost: host chunks map
// in a few microseconds, so what it measures is mostly socket round trips,
// wake-ups, copies and allocation per chunk. Reports MB/s and us/chunk.
//
//	go test -run '^$' -bench HostImport -benchmem ./core
func BenchmarkHostImport(b *testing.B) {
	const chunks = 4096
	const chunkSize = 64 << 10
	size := chunks * chunkSize
	fd, err := unix.MemfdCreate("vmmipc-bench", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		b.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		b.Fatal(err)
	}
	sizes, err := FileChunks(fd, uint64(size), chunkSize)
	if err != nil {
		b.Fatal(err)
	}
	s := newTestServer(b)
	for _, window := range []uint32{1, DefaultWindow} {
		b.Run(fmt.Sprintf("window=%d", window), func(b *testing.B) {
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				b.StopTimer() // registering is the sender's, before the wait
				tk, err := s.Register(sizes, &FileExporter{FD: fd, ChunkSize: chunkSize}, RegisterOptions{Uses: 1})
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				m, err := ImportStream(tk, &HostImporter{}, -1, OpenOptions{Window: window})
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				if err := Unmap(m.ID, m.Base); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/chunks, "us/chunk")
		})
	}
}
