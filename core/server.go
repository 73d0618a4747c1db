package core

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Server serves the chunks of its registrations to receivers, exporting each
// chunk only when asked and closing its descriptor right after sending it.
// This file holds its life and its registering side; accept.go the accept
// loop, admission.go its limits; session.go one receiver's session.
type Server struct {
	reg   *Registry
	ln    *net.UnixListener
	addr  string       // "@name" or a filesystem path
	files *serverFiles // the socket and lock in a socket directory; nil for abstract sockets
	pid   uint32
	uid   int
	adm   *admission
}

var (
	defaultMu     sync.Mutex
	defaultServer *Server
)

// DefaultServer returns this process's server, starting it on first use.
func DefaultServer() (*Server, error) {
	defaultMu.Lock()
	defer defaultMu.Unlock()
	if defaultServer != nil {
		return defaultServer, nil
	}
	s, err := NewServer(os.Getenv(SocketDirEnv))
	if err != nil {
		return nil, err
	}
	defaultServer = s
	return s, nil
}

// StartedServer returns this process's server, or nil if none was started.
func StartedServer() *Server {
	defaultMu.Lock()
	defer defaultMu.Unlock()
	return defaultServer
}

// NewServer starts a server: on a filesystem socket in dir when dir is not
// empty (after checking the directory and removing what crashed exporters
// left there), else in the abstract namespace. The name holds the PID
// namespace, the pid and 64 random bits: pids repeat across namespaces.
func NewServer(dir string) (*Server, error) {
	var tag [8]byte
	if _, err := rand.Read(tag[:]); err != nil {
		return nil, Errorf(EINTERNAL, "server: random name: %w", err)
	}
	ns := selfNamespaces()
	name := fmt.Sprintf("%s%d-%d-%s", fileNamePrefix, ns.PID, os.Getpid(), hex.EncodeToString(tag[:]))
	addr := "@" + name
	var files *serverFiles
	if dir != "" {
		d, err := openSocketDir(dir)
		if err != nil {
			return nil, err
		}
		if addr = filepath.Join(d.path, name) + socketSuffix; len(addr) > maxAddrLen {
			d.close()
			return nil, Errorf(ECONFIG, "server: socket path %q is longer than %d bytes; use a shorter %s", addr, maxAddrLen, SocketDirEnv)
		}
		d.removeStale()
		if files, err = createLock(d, name); err != nil {
			d.close()
			return nil, err
		}
	}
	ln, err := listenPrivate(addr, files)
	if err != nil {
		if files != nil {
			files.release()
		}
		return nil, err
	}
	pid := uint32(os.Getpid())
	s := &Server{
		reg: newRegistry(addr, pid, selfStartTime(), ns), ln: ln, addr: addr, files: files,
		pid: pid, uid: os.Getuid(), adm: newAdmission(),
	}
	s.reg.table.ready() // its one descriptor now, not with some later registration; none is fine too
	go acceptLoop(s.ln, s.uid, s.adm, s.reg)
	return s, nil
}

// listenPrivate binds addr, makes a filesystem socket (in files' directory)
// mode 0600, and only then listens, with the system's largest backlog, so
// that nobody can connect before the mode is set and a burst of receivers
// waits in the queue instead of being refused. On error the caller removes
// a socket file it may have left (files.release).
func listenPrivate(addr string, files *serverFiles) (*net.UnixListener, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return nil, &Error{Code: ioCode(err), Msg: "server: socket", Err: err}
	}
	sa := &unix.SockaddrUnix{Name: addr}
	if addr[0] == '@' {
		sa.Name = "\x00" + addr[1:]
	}
	fail := func(op string, err error) (*net.UnixListener, error) {
		_ = unix.Close(fd)
		return nil, &Error{Code: ioCode(err), Msg: fmt.Sprintf("server: %s %s", op, addr), Err: err}
	}
	if err := unix.Bind(fd, sa); err != nil {
		return fail("bind", err)
	}
	if files != nil {
		// Through the directory checked: the path leads there unless we
		// or root changed it since, and then this fails.
		if err := unix.Fchmodat(files.dir.fd, files.name+socketSuffix, 0o600, 0); err != nil {
			return fail("chmod", err)
		}
	}
	if err := unix.Listen(fd, listenBacklog()); err != nil {
		return fail("listen", err)
	}
	f := os.NewFile(uintptr(fd), addr)
	l, err := net.FileListener(f) // dups fd (close-on-exec); we close ours
	_ = f.Close()
	if err != nil {
		return nil, &Error{Code: ioCode(err), Msg: "server: listener " + addr, Err: err}
	}
	ul := l.(*net.UnixListener)
	ul.SetUnlinkOnClose(false) // Close removes the file through the directory's descriptor
	return ul, nil
}

// listenBacklog is the system's maximum listen backlog (the kernel caps any
// larger request at net.core.somaxconn anyway).
func listenBacklog() int {
	b, err := os.ReadFile("/proc/sys/net/core/somaxconn")
	if err != nil {
		return 4096
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n <= 0 {
		return 4096
	}
	return n
}

// Addr returns the address receivers connect to.
func (s *Server) Addr() string { return s.addr }

// Files lists the files the server made in its socket directory (socket
// first, then lock), as named by the directory's path; none for an
// abstract socket.
func (s *Server) Files() []string {
	if s.files == nil {
		return nil
	}
	return []string{s.files.socketPath(), s.files.lockPath()}
}

// DirFiles gives what the process should remove when it exits: a
// descriptor of the socket directory the server checked (the server's, and
// closed by Close: duplicate it to keep it), and the names of its socket
// and lock there; dirfd is -1 for an abstract socket. Removing them
// through the descriptor never touches another directory, wherever the
// path leads by then.
func (s *Server) DirFiles() (dirfd int, names []string) {
	if s.files == nil {
		return -1, nil
	}
	return s.files.dir.fd, []string{s.files.name + socketSuffix, s.files.name + lockSuffix}
}

// Close stops accepting receivers and removes a filesystem socket and its
// lock. Tests use it; the default server lives as long as the process.
func (s *Server) Close() error {
	s.adm.close()
	err := s.ln.Close()
	s.reg.leases.close()
	s.reg.table.close()
	s.reg.spends.close()
	if s.files != nil {
		s.files.release()
	}
	return err
}

// Register records a buffer and returns its ticket. It opens no descriptor.
// On success it takes spec.Exporter (released when the buffer ends, or at
// once when the registration joins a live buffer of the same key); on error
// the exporter stays the caller's.
func (s *Server) Register(spec BufferSpec, opts RegisterOptions) (*Ticket, error) {
	g, joined, err := s.reg.add(spec, opts)
	if err != nil {
		return nil, err
	}
	if joined {
		safely(spec.Exporter.Release) // the buffer already holds the memory
	}
	s.afterGrant(g)
	return g.ticket, nil
}

// afterGrant harvests the receivers' spend logs after a grant that
// receivers' hits can use (spendlogs.go): a grant is often the next of a
// stream whose last ones were table hits. Here, on the granting thread,
// rather than on a goroutine of its own, whose wake-up per grant costs
// more than the few records it spends.
func (s *Server) afterGrant(g *registration) {
	if g.published {
		s.reg.spends.harvestNow()
	}
}

// RegisterAgain makes a new registration of the memory of the live
// registration t names: same buffer identity, its own uses, ttl and secret.
func (s *Server) RegisterAgain(t *Ticket, opts RegisterOptions) (*Ticket, error) {
	g, err := s.own(t, false, "register again")
	if err != nil {
		return nil, err
	}
	ng, err := s.reg.again(g, opts)
	if err != nil {
		return nil, err
	}
	s.afterGrant(ng)
	return ng.ticket, nil
}

// Unregister ends the registration a ticket names, if it is one of ours.
func (s *Server) Unregister(t *Ticket) error {
	g, err := s.own(t, false, "unregister")
	if err != nil {
		return err
	}
	if !g.end(unregisteredWhy()) {
		return Errorf(ENOENT, "unregister: registration %d has already ended", t.RegID)
	}
	return nil
}

// Wait blocks until the registration t names has ended and been released,
// or timeout passes (ETIMEDOUT).
func (s *Server) Wait(t *Ticket, timeout time.Duration) error {
	g, err := s.own(t, true, "wait")
	if CodeOf(err) == ENOENT && s.issuedBy(t) && s.reg.issued(t.RegID) {
		return nil // ended and released long ago
	}
	if err != nil {
		return err
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-g.releasedCh:
		return nil
	case <-timer.C:
		state := "is still live"
		if !g.live() {
			state = "has ended, but what it lent is still in use (an export in flight, or registrations made from it still live)"
		}
		return Errorf(ETIMEDOUT, "wait: registration %d %s after %v", t.RegID, state, timeout)
	}
}

// issuedBy reports whether t names this server (this process, not an
// earlier one with the same pid).
func (s *Server) issuedBy(t *Ticket) bool {
	return t.Address == s.addr && t.Pid == s.pid && t.StartTime == s.reg.start
}

// own finds the registration of this server that t names.
func (s *Server) own(t *Ticket, releasing bool, op string) (*registration, error) {
	if !s.issuedBy(t) {
		return nil, Errorf(ENOENT, "%s: the ticket belongs to another exporter (%s, pid %d), not this process", op, t.Address, t.Pid)
	}
	g, err := s.reg.lookupOwn(t.RegID, t.Secret, releasing)
	if err != nil {
		return nil, WrapErr(CodeOf(err), err, "%s", op)
	}
	// Id and secret found it; the rest of the ticket must be the very one
	// issued too, as the handshake's digest demands of receivers.
	d, err := t.Digest()
	if err != nil {
		return nil, WrapErr(CodeOf(err), err, "%s", op)
	}
	if subtle.ConstantTimeCompare(d[:], g.digest[:]) != 1 {
		return nil, Errorf(EINVAL, "%s: the ticket names registration %d with its secret, but other bytes of it differ from the ticket issued (a corrupted copy?)", op, t.RegID)
	}
	return g, nil
}

// Live reports the registrations of s that have not ended.
func (s *Server) Live() int { return s.reg.Live() }

// DefaultLive reports the live registrations of the default server without
// starting it.
func DefaultLive() int {
	if s := StartedServer(); s != nil {
		return s.Live()
	}
	return 0
}

// LiveMany reports, for each ticket, whether it is byte for byte one that
// s issued and its registration has not ended (used up, expired or
// unregistered; an ended one whose release is still to run counts as
// ended). nil tickets and everything else are false: a host that keeps the
// grants it made checks them in one call and forgets the rest
// (vmmipc_live_many).
func (s *Server) LiveMany(ts []*Ticket) []bool {
	live := make([]bool, len(ts))
	for i, t := range ts {
		if t == nil {
			continue
		}
		if g, err := s.own(t, false, "live"); err == nil {
			live[i] = g.live()
		}
	}
	return live
}

// Holds counts the uses receivers hold now on s's registrations.
func (s *Server) Holds() int64 { return s.reg.Holds() }

// DefaultHolds reports the holds on the default server's registrations
// without starting it.
func DefaultHolds() int64 {
	if s := StartedServer(); s != nil {
		return s.Holds()
	}
	return 0
}
