package core

import (
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// FileExporter exports ranges of one memfd as chunks. It holds its own
// duplicate of the file, taken at registration: so it can never send
// another file that was given the registered descriptor's number after its
// owner closed it, and the owner may close its descriptor at once. Each
// export is a fresh close-on-exec duplicate plus the chunk's file offset;
// the chunks lie back to back in the file, so one duplicate serves any run
// of them (a RunExporter).
type FileExporter struct {
	fd        int // ours; closed by Release
	chunkSize uint64
	dev, ino  uint64 // the file's identity (fileBacked)
}

// HostFile validates a memfd registration of bytes [0, size) in chunks of
// chunkSize and returns what to register. The spec's Key names the file (its
// inode) and the chunking, so registering the same memfd again while a
// registration of it lives shares the buffer. On success the spec's
// exporter holds one duplicate of fd until the buffer ends. It adds no
// seal: Server.RegisterHostFile seals the file, last.
func HostFile(fd int, size, chunkSize uint64) (BufferSpec, error) {
	if chunkSize == 0 || chunkSize%pageSize != 0 {
		return BufferSpec{}, Errorf(EINVAL, "register: chunk size %d is not a positive multiple of the page size %d", chunkSize, pageSize)
	}
	if size == 0 {
		return BufferSpec{}, Errorf(EINVAL, "register: size is 0")
	}
	n := (size + chunkSize - 1) / chunkSize
	if n > MaxChunks {
		return BufferSpec{}, Errorf(EINVAL, "register: %d chunks exceed the limit of %d; use larger chunks", n, MaxChunks)
	}
	if fd < 0 {
		return BufferSpec{}, Errorf(EINVAL, "register: fd %d is not a descriptor", fd)
	}
	st, err := checkHostFile(fd, size)
	if err != nil {
		return BufferSpec{}, WrapErr(EINVAL, err, "register")
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return BufferSpec{}, &Error{Code: ioCode(err), Msg: fmt.Sprintf("register: duplicating fd %d", fd), Err: err}
	}
	sizes := make([]uint64, n)
	for i := range sizes {
		sizes[i] = min(chunkSize, size-uint64(i)*chunkSize)
	}
	return BufferSpec{
		Sizes: sizes, Kind: MemoryHost,
		Exporter: &FileExporter{fd: dup, chunkSize: chunkSize, dev: st.Dev, ino: st.Ino},
		// While our duplicate keeps the inode alive, no other file can
		// have its number on that device: equal keys are the same file.
		Key: fmt.Sprintf("memfd:%d:%d:%d:%d", st.Dev, st.Ino, size, chunkSize),
	}, nil
}

// RegisterHostFile registers bytes [0, size) of the memfd fd (HostFile)
// and seals it with F_SEAL_SEAL (memfd.go: no receiver of it can then add a
// seal that would refuse later receivers). A seal cannot be taken back, so
// it is the last step, after everything else that can fail: a call that
// fails leaves the file's seals as it found them. (The one exception is
// another holder of the file sealing it against writing during the call,
// which makes it unusable for sharing anyway.) opts.OnRelease runs once if
// this returns a ticket, never if it fails.
func (s *Server) RegisterHostFile(fd int, size, chunkSize uint64, opts RegisterOptions) (*Ticket, error) {
	spec, err := HostFile(fd, size, chunkSize)
	if err != nil {
		return nil, err
	}
	gate := &releaseGate{onRelease: opts.OnRelease}
	if opts.OnRelease != nil {
		opts.OnRelease = gate.released
	}
	t, err := s.Register(spec, opts)
	if err != nil {
		spec.Exporter.Release() // close our duplicate
		return nil, err
	}
	// No receiver can be served before this returns: nobody else has the
	// ticket, whose secret is new.
	if err := sealForSharing(fd); err != nil {
		gate.withdraw()
		_ = s.Unregister(t) // ends it, and closes the duplicate with its buffer
		return nil, WrapErr(EINVAL, err, "register")
	}
	gate.grant()
	return t, nil
}

// releaseGate holds back a registration's release callback until the
// registration has been handed out (grant): one that fails after it was
// recorded, and is ended at once, must not run it (withdraw); one that
// ends before grant (a very short ttl) runs it at grant.
type releaseGate struct {
	mu        sync.Mutex
	onRelease func()
	state     int // gatePending, gateGranted, gateWithdrawn or gateReleasedEarly
}

const (
	gatePending = iota
	gateGranted
	gateWithdrawn
	gateReleasedEarly
)

// released is the registration's release callback.
func (g *releaseGate) released() {
	g.mu.Lock()
	run := g.state == gateGranted
	if g.state == gatePending {
		g.state = gateReleasedEarly
	}
	g.mu.Unlock()
	if run {
		g.onRelease()
	}
}

func (g *releaseGate) grant() {
	g.mu.Lock()
	early := g.state == gateReleasedEarly
	g.state = gateGranted
	g.mu.Unlock()
	if early && g.onRelease != nil {
		go safely(g.onRelease) // on a library thread, as always
	}
}

func (g *releaseGate) withdraw() {
	g.mu.Lock()
	g.state = gateWithdrawn
	g.mu.Unlock()
}

// ExportChunk duplicates our descriptor of the file for chunk index.
func (e *FileExporter) ExportChunk(index uint64) (int, uint64, error) {
	fd, err := unix.FcntlInt(uintptr(e.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, 0, &Error{Code: ioCode(err), Msg: "duplicating the registered file", Err: err}
	}
	return fd, index * e.chunkSize, nil
}

// ExportRun duplicates our descriptor once for chunks [first, first+max):
// they lie back to back in the file.
func (e *FileExporter) ExportRun(first, max uint64) (int, uint64, uint64, error) {
	fd, off, err := e.ExportChunk(first)
	return fd, off, max, err
}

// heldFile is our duplicate's number and the file's identity: the
// chunks lie back to back from offset 0.
func (e *FileExporter) heldFile() (fd int, dev, ino uint64) { return e.fd, e.dev, e.ino }

// Release closes our duplicate.
func (e *FileExporter) Release() {
	if e.fd >= 0 {
		_ = unix.Close(e.fd)
		e.fd = -1
	}
}
