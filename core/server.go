package core

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Server limits. A receiver that connects and never speaks is dropped after
// helloTimeout; one that stops pulling after idleTimeout. Admitted
// connections are capped at a quarter of the host's soft RLIMIT_NOFILE
// (between 16 and maxConns), and refusals of foreign uids at maxRefusing,
// so that a flood of connections cannot take the host's descriptors.
var (
	helloTimeout = 10 * time.Second
	idleTimeout  = 2 * time.Minute
	maxConns     = 1024
	maxRefusing  = 64
)

// connLimit is how many admitted connections the server keeps open at once.
func connLimit() int {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return 16
	}
	return int(max(16, min(uint64(maxConns), lim.Cur/4)))
}

// SocketDirEnv names the environment variable that, when set, makes the
// server listen on a filesystem socket in that directory (mode 0600) instead
// of the abstract namespace: for processes that share a filesystem but not a
// network namespace.
const SocketDirEnv = "VMMIPC_SOCKET_DIR"

// Server serves the chunks of its registrations to receivers, exporting each
// chunk only when asked and closing its descriptor right after sending it.
type Server struct {
	reg  *Registry
	ln   *net.UnixListener
	addr string // "@name" or a filesystem path
	pid  uint32
	uid  int

	mu       sync.Mutex
	conns    int // admitted connections being served
	refusing int // foreign-uid connections being told no
	closed   bool
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

// DefaultRegistryLive reports the live registrations of the default server
// without starting it.
func DefaultRegistryLive() int {
	defaultMu.Lock()
	s := defaultServer
	defaultMu.Unlock()
	if s == nil {
		return 0
	}
	return s.reg.Live()
}

// NewServer starts a server: on a filesystem socket in dir when dir is not
// empty, else in the abstract namespace.
func NewServer(dir string) (*Server, error) {
	var tag [8]byte
	if _, err := rand.Read(tag[:]); err != nil {
		return nil, Errorf(EINTERNAL, "server: random name: %w", err)
	}
	name := fmt.Sprintf("vmmipc-%d-%s", os.Getpid(), hex.EncodeToString(tag[:]))
	var addr string
	if dir != "" {
		abs, err := filepath.Abs(dir)
		if err != nil {
			return nil, Errorf(EINVAL, "server: %s=%q: %w", SocketDirEnv, dir, err)
		}
		addr = filepath.Join(abs, name+".sock")
		if len(addr) > maxAddrLen {
			return nil, Errorf(EINVAL, "server: socket path %q is longer than %d bytes; use a shorter %s", addr, maxAddrLen, SocketDirEnv)
		}
	} else {
		addr = "@" + name
	}
	ln, err := listenPrivate(addr)
	if err != nil {
		return nil, err
	}
	s := &Server{reg: newRegistry(), ln: ln, addr: addr, pid: uint32(os.Getpid()), uid: os.Getuid()}
	go s.acceptLoop()
	return s, nil
}

// listenPrivate binds addr, makes a filesystem socket mode 0600, and only
// then listens, so nobody can connect before the mode is set.
func listenPrivate(addr string) (*net.UnixListener, error) {
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
	if addr[0] != '@' {
		if err := os.Chmod(addr, 0o600); err != nil {
			_ = os.Remove(addr)
			return fail("chmod", err)
		}
	}
	if err := unix.Listen(fd, 128); err != nil {
		return fail("listen", err)
	}
	f := os.NewFile(uintptr(fd), addr)
	l, err := net.FileListener(f) // dups fd (close-on-exec); we close ours
	_ = f.Close()
	if err != nil {
		return nil, &Error{Code: ioCode(err), Msg: "server: listener " + addr, Err: err}
	}
	ul := l.(*net.UnixListener)
	ul.SetUnlinkOnClose(addr[0] != '@')
	return ul, nil
}

// Addr returns the address receivers connect to.
func (s *Server) Addr() string { return s.addr }

// Registry returns the server's registry.
func (s *Server) Registry() *Registry { return s.reg }

// Close stops accepting receivers and removes a filesystem socket. Tests use
// it; the default server lives as long as the process.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	return s.ln.Close()
}

// Register records a buffer and returns its ticket. It opens no descriptor.
func (s *Server) Register(sizes []uint64, exp Exporter, opts RegisterOptions) (*Ticket, error) {
	if opts.Kind == 0 {
		opts.Kind = MemoryHost
	}
	if opts.Kind != MemoryHost && opts.Kind != MemoryCUDA {
		return nil, Errorf(EINVAL, "register: unknown memory kind %d (want 1 = host or 2 = cuda)", opts.Kind)
	}
	g, err := s.reg.add(sizes, exp, opts)
	if err != nil {
		return nil, err
	}
	return &Ticket{
		Kind: opts.Kind, Address: s.addr, Pid: s.pid, RegID: g.id, Secret: g.secret,
		Count: uint64(len(g.sizes)), Total: g.total, DeviceUUID: opts.DeviceUUID,
	}, nil
}

// Unregister ends the registration a ticket names, if it is one of ours.
func (s *Server) Unregister(t *Ticket) error {
	if t.Address != s.addr || t.Pid != s.pid {
		return Errorf(ENOENT, "unregister: the ticket belongs to another exporter (%s, pid %d), not this process", t.Address, t.Pid)
	}
	return s.reg.Unregister(t.RegID, t.Secret)
}

func (s *Server) acceptLoop() {
	for {
		uc, err := s.ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// EMFILE and friends: back off instead of spinning.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		// Check the uid before counting the connection: abstract sockets
		// have no permissions, so a process of any uid can connect, and its
		// connections must not use up the slots of admitted receivers.
		handle, count, limit := s.serve, &s.conns, connLimit()
		if err := s.checkPeer(uc); err != nil {
			handle = func(uc *net.UnixConn) { s.refuseConn(uc, err) }
			count, limit = &s.refusing, maxRefusing
		}
		if !s.take(count, limit) {
			_ = uc.Close() // over the limit: hang up at once
			continue
		}
		go func() {
			defer s.give(count)
			handle(uc)
		}()
	}
}

// take counts one more connection in *n unless it has reached limit.
func (s *Server) take(n *int, limit int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if *n >= limit {
		return false
	}
	*n++
	return true
}

// give uncounts a connection that take counted.
func (s *Server) give(n *int) {
	s.mu.Lock()
	*n--
	s.mu.Unlock()
}

// serve runs one receiver's session: authenticate, claim a use, stream the
// requested chunks in order, and consume the use on done.
func (s *Server) serve(uc *net.UnixConn) {
	c, err := newConn(uc, helloTimeout, "server")
	if err != nil {
		_ = uc.Close()
		return
	}
	defer c.Close()
	defer func() { _ = recover() }() // a bug here must not take the host down

	f, err := c.recv()
	if err != nil {
		if CodeOf(err) == EINVAL { // a malformed message: say why we hang up
			s.refuse(c, err, noIndex)
		}
		return
	}
	if f.FD >= 0 { // receivers never send descriptors
		closeFD(&f.FD)
		s.refuse(c, Errorf(EINVAL, "protocol: receivers must not send descriptors"), noIndex)
		return
	}
	if f.Type != msgHello {
		s.refuse(c, Errorf(EINVAL, "protocol: expected hello, got %s", msgName(f.Type)), noIndex)
		return
	}
	hello, err := parseHello(f.Body)
	if err != nil {
		s.refuse(c, err, noIndex)
		return
	}
	g, err := s.reg.lookup(hello.RegID, hello.Secret)
	if err != nil {
		s.refuse(c, err, noIndex)
		return
	}
	if err := g.claim(c); err != nil {
		s.refuse(c, err, noIndex)
		return
	}
	// The use is consumed in stream() once the last chunk has been sent;
	// a stream cut before that gives it back. Release (possibly slow) runs
	// only after the receiver has its acknowledgement, or has gone.
	defer g.maybeRelease()
	defer g.finish(c, false)
	c.timeout = idleTimeout
	if err := c.send(welcomeMsg{Count: uint64(len(g.sizes)), Total: g.total, Kind: g.kind}.encode(), -1); err != nil {
		return
	}
	if s.stream(c, g) {
		_ = c.send(encodeMsg(msgDoneAck, nil), -1)
	}
}

// stream answers pull requests until done (true) or failure (false).
func (s *Server) stream(c *conn, g *registration) bool {
	count := uint64(len(g.sizes))
	next := uint64(0) // the next index we expect to be asked for
	for {
		f, err := c.recv()
		if err != nil {
			closeFD(&f.FD)
			if CodeOf(err) == EINVAL {
				s.refuse(c, err, noIndex)
			}
			return false
		}
		if f.FD >= 0 { // receivers never send descriptors
			closeFD(&f.FD)
			s.refuse(c, Errorf(EINVAL, "protocol: receivers must not send descriptors"), noIndex)
			return false
		}
		switch f.Type {
		case msgPull:
			p, err := parsePull(f.Body)
			if err == nil && (p.First != next || p.Count == 0 || p.Count > count-next) {
				err = Errorf(EINVAL, "protocol: pull of chunks [%d, %d+%d) out of order or out of range (next is %d of %d)", p.First, p.First, p.Count, next, count)
			}
			if err != nil {
				s.refuse(c, err, noIndex)
				return false
			}
			for i := p.First; i < p.First+p.Count; i++ {
				if err := s.sendChunk(c, g, i); err != nil {
					s.refuse(c, err, i)
					return false
				}
			}
			next += p.Count
			if next == count {
				// Every chunk is on its way: the use is spent, whether or
				// not the receiver says done. (Counting only done would
				// let a receiver pull everything, hang up, and pull again.)
				g.finish(c, true)
			}
		case msgDone:
			if next != count {
				s.refuse(c, Errorf(EINVAL, "protocol: done after %d of %d chunks", next, count), noIndex)
				return false
			}
			return true
		default:
			s.refuse(c, Errorf(EINVAL, "protocol: unexpected %s message while streaming", msgName(f.Type)), noIndex)
			return false
		}
	}
}

// sendChunk exports chunk i, sends its descriptor with the chunk header in
// one message, and closes the descriptor whatever happens.
func (s *Server) sendChunk(c *conn, g *registration, i uint64) error {
	fd, fileOff, err := g.export(i)
	if err != nil {
		if CodeOf(err) == ENOENT {
			return err
		}
		return wrapErr(EEXPORT, err, "chunk %d of %d: export failed", i, len(g.sizes))
	}
	if fd < 0 {
		return Errorf(EEXPORT, "chunk %d of %d: exporter returned no descriptor", i, len(g.sizes))
	}
	defer unix.Close(fd)
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil {
		return Errorf(EEXPORT, "chunk %d of %d: exporter returned %d, which is not an open descriptor", i, len(g.sizes), fd)
	}
	msg := chunkMsg{Index: i, Offset: g.offsets[i], Size: g.sizes[i], FileOffset: fileOff}
	return c.send(msg.encode(), fd)
}

// refuseConn tells a peer that may not connect why, and hangs up. It does
// not wait for the peer: the message fits in the socket buffer.
func (s *Server) refuseConn(uc *net.UnixConn, err error) {
	defer func() { _ = recover() }()
	c, cerr := newConn(uc, 0, "server")
	if cerr != nil {
		_ = uc.Close()
		return
	}
	defer c.Close()
	_ = uc.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	_ = c.send(errorMsg{Code: CodeOf(err), Index: noIndex, Text: err.Error()}.encode(), -1)
}

// refuse tells the receiver why it gets nothing (best effort) and lets the
// caller close the connection. No descriptor is ever sent with it.
func (s *Server) refuse(c *conn, err error, index uint64) {
	code := CodeOf(err)
	if code >= 0 {
		code = EINTERNAL
	}
	c.timeout = time.Second // never block long on a receiver that does not read
	_ = c.send(errorMsg{Code: code, Index: index, Text: err.Error()}.encode(), -1)
}

// checkPeer admits receivers of our own uid, and root.
func (s *Server) checkPeer(uc *net.UnixConn) error {
	cred, err := peerCred(uc)
	if err != nil {
		return Errorf(EAUTH, "cannot read the receiver's credentials (SO_PEERCRED): %v", err)
	}
	if int(cred.Uid) != s.uid && cred.Uid != 0 {
		return Errorf(EAUTH, "receiver uid %d is not allowed: only the exporter's own uid or root may import", cred.Uid)
	}
	return nil
}
