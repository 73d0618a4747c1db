package core

import (
	"encoding/binary"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// The handshake binds the connection it runs on by the exporter's socket
// of it, named by its cookie: a 64-bit number the kernel gives each socket
// once per boot and never to another (SO_COOKIE). The exporter reads its
// own socket's cookie; the receiver asks the kernel (sock_diag) which
// socket is its peer, and that socket's cookie. A relay between a receiver
// and the exporter holds two connections: the receiver's peer is the
// relay's socket, never the exporter's, and neither side's proof checks out
// for the other. This holds across namespaces: the socket an exporter
// accepts lives in the connecting receiver's network namespace, so the
// receiver's query always finds it (the exporter's query for the
// receiver's socket could not). Pids cannot do this across PID namespaces:
// SO_PEERCRED reports 0 for a process we cannot see.

// Without sock_diag (no unix_diag in the kernel, or a seccomp profile that
// refuses netlink), a receiver in the exporter's PID namespace binds its
// own pid instead, as SO_PEERCRED reports it to the exporter (hello flag
// helloPidBound, which the proofs cover, so no relay can set or clear
// it): a relay there has a pid of its own. Elsewhere that pid is 0 or
// another number, and the receiver is refused with the cause.

var sockDiagProbe = struct {
	mu     sync.Mutex
	probed bool
	err    error
}{}

// sockDiagWorks tells whether this process can ask the kernel about its
// unix sockets (asked of a socket pair). The answer is kept, except a lack
// of descriptors, which says nothing about the kernel: then it is ENFILE
// and asked again next time.
func sockDiagWorks() error {
	sockDiagProbe.mu.Lock()
	defer sockDiagProbe.mu.Unlock()
	if !sockDiagProbe.probed {
		err := probeSockDiag()
		if ioCode(err) == ENFILE {
			return Errorf(ENFILE, "out of descriptors asking the kernel about unix sockets: %w", err)
		}
		sockDiagProbe.probed, sockDiagProbe.err = true, err
	}
	return sockDiagProbe.err
}

// probeSockDiag is a variable only so that a test can run a receiver that
// lacks sock_diag, in a process of its own that sets it before anything
// runs.
var probeSockDiag = func() error {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	var st unix.Stat_t
	if err := unix.Fstat(fds[0], &st); err != nil {
		return err
	}
	_, err = unixSockDiag(st.Ino)
	return err
}

// exporterSocket is the cookie of the exporter's socket of the connection
// raw is one end of; side is roleServer or roleReceiver, the side raw is.
func exporterSocket(raw syscall.RawConn, side byte) (uint64, error) {
	var cookie uint64
	var opErr error
	if err := raw.Control(func(fd uintptr) { cookie, opErr = exporterSocketOf(int(fd), side) }); err != nil {
		return 0, Errorf(EIO, "socket: %w", err)
	}
	return cookie, opErr
}

// exporterSocketOf is exporterSocket on a descriptor. It is a variable
// only so that TestSecretNeverCrossesTheSocket can relay a whole session
// to record it, in a process of its own that sets it before anything
// runs.
var exporterSocketOf = kernelExporterSocket

func kernelExporterSocket(fd int, side byte) (uint64, error) {
	if side == roleServer {
		c, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
		if err != nil {
			return 0, Errorf(EIO, "cannot name our socket of the connection (SO_COOKIE): %w", err)
		}
		return c, nil
	}
	var st unix.Stat_t
	err := unix.Fstat(fd, &st)
	var peer sockDiag
	nl := -1 // one netlink socket for both questions: every connection asks them
	if err == nil {
		nl, err = sockDiagSocket()
	}
	if nl >= 0 {
		defer unix.Close(nl)
	}
	if err == nil {
		peer, err = askSockDiag(nl, st.Ino)
	}
	if err == nil && peer.peer == 0 {
		return 0, errNoPeer
	}
	if err == nil {
		peer, err = askSockDiag(nl, peer.peer)
	}
	if errors.Is(err, unix.ENOENT) {
		return 0, errNoPeer // closed between the two questions
	}
	if ioCode(err) == ENFILE {
		return 0, Errorf(ENFILE, "cannot name the exporter's socket of the connection: out of descriptors: %w", err)
	}
	if err != nil {
		return 0, Errorf(EIO, "cannot name the exporter's socket of the connection (NETLINK_SOCK_DIAG for unix sockets): %w; the kernel needs unix_diag (CONFIG_UNIX_DIAG; modprobe unix_diag), and a seccomp profile must allow netlink sockets", err)
	}
	return peer.cookie, nil
}

// errNoPeer: the other end of the connection is closed.
var errNoPeer = Errorf(EIO, "the other side has closed the connection (it exited, or ended this registration)")

// sockDiag is what sock_diag says of one unix socket.
type sockDiag struct {
	cookie uint64
	peer   uint64 // the inode of the socket connected to it; 0 = none
}

// sock_diag for AF_UNIX (linux/unix_diag.h); x/sys/unix lacks these.
const (
	udiagShowPeer   = 0x4 // UDIAG_SHOW_PEER
	unixDiagPeerAtt = 2   // UNIX_DIAG_PEER
	unixDiagReqSize = 24  // struct unix_diag_req
	unixDiagMsgSize = 16  // struct unix_diag_msg
)

// unixSockDiag asks the kernel about the unix socket of inode ino in our
// network namespace. sock_diag answers within the request's sendto, so
// the read never waits.
func unixSockDiag(ino uint64) (sockDiag, error) {
	fd, err := sockDiagSocket()
	if err != nil {
		return sockDiag{}, err
	}
	defer unix.Close(fd)
	return askSockDiag(fd, ino)
}

// sockDiagSocket opens a netlink socket for sock_diag questions.
func sockDiagSocket() (int, error) {
	return unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
}

// askSockDiag is unixSockDiag on the netlink socket fd (sockDiagSocket),
// which may be asked again: each answer is read before the next question.
func askSockDiag(fd int, ino uint64) (sockDiag, error) {
	req := make([]byte, unix.SizeofNlMsghdr+unixDiagReqSize)
	le := binary.LittleEndian
	le.PutUint32(req[0:], uint32(len(req)))
	le.PutUint16(req[4:], unix.SOCK_DIAG_BY_FAMILY)
	le.PutUint16(req[6:], unix.NLM_F_REQUEST)
	le.PutUint32(req[8:], 1) // sequence number
	r := req[unix.SizeofNlMsghdr:]
	r[0] = unix.AF_UNIX
	le.PutUint32(r[4:], ^uint32(0)) // every state
	le.PutUint32(r[8:], uint32(ino))
	le.PutUint32(r[12:], udiagShowPeer)
	le.PutUint32(r[16:], ^uint32(0)) // no cookie to match
	le.PutUint32(r[20:], ^uint32(0))
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return sockDiag{}, err
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, unix.MSG_DONTWAIT)
	if err != nil {
		return sockDiag{}, err
	}
	return parseSockDiag(buf[:n], ino)
}

// parseSockDiag reads sock_diag's answer about socket ino.
func parseSockDiag(b []byte, ino uint64) (sockDiag, error) {
	le := binary.LittleEndian
	if len(b) < unix.SizeofNlMsghdr {
		return sockDiag{}, Errorf(EIO, "sock_diag: a reply of %d bytes", len(b))
	}
	n := int(le.Uint32(b[0:]))
	if n < unix.SizeofNlMsghdr || n > len(b) {
		return sockDiag{}, Errorf(EIO, "sock_diag: a message of %d bytes in a reply of %d", n, len(b))
	}
	typ, body := le.Uint16(b[4:]), b[unix.SizeofNlMsghdr:n]
	switch {
	case typ == unix.NLMSG_ERROR && len(body) >= 4:
		return sockDiag{}, syscall.Errno(-int32(le.Uint32(body)))
	case typ != unix.SOCK_DIAG_BY_FAMILY || len(body) < unixDiagMsgSize:
		return sockDiag{}, Errorf(EIO, "sock_diag: unexpected message type %d of %d bytes", typ, len(body))
	case uint64(le.Uint32(body[4:])) != ino:
		return sockDiag{}, Errorf(EIO, "sock_diag: asked about socket %d, told about %d", ino, le.Uint32(body[4:]))
	}
	d := sockDiag{cookie: uint64(le.Uint32(body[8:])) | uint64(le.Uint32(body[12:]))<<32}
	for a := body[unixDiagMsgSize:]; len(a) >= 4; {
		alen, atyp := int(le.Uint16(a[0:])), le.Uint16(a[2:])
		if alen < 4 || alen > len(a) {
			break
		}
		if atyp == unixDiagPeerAtt && alen >= 8 {
			d.peer = uint64(le.Uint32(a[4:]))
		}
		a = a[min((alen+3)&^3, len(a)):]
	}
	return d, nil
}

// The one-round form (handshake.go) binds the receiver's pid and start
// time instead of the exporter's socket: both read from the kernel by the
// exporter, never taken from the receiver.

// soPeerPidfd is SO_PEERPIDFD (Linux 6.5+; x/sys/unix lacks it): a pidfd
// of the process that connected, which names that process and no other
// even after its pid is handed out again.
const soPeerPidfd = 77

// peerIdentity is the pid (in our PID namespace) and start time of the
// process that connected uc. It reads the start time from /proc and then
// takes the peer's pidfd (SO_PEERPIDFD, which the kernel gives only while
// the process that connected has not been reaped) and checks that the
// process lives: then it lived all through the read, its pid was not
// handed out again, and the start time read is its own. The two
// descriptors are open one after the other, never together: an exporter's
// sessions cost it as few descriptors as they can (issue 31's bound).
// Where the kernel or /proc cannot tell (another PID namespace, no
// SO_PEERPIDFD, a /proc not ours) it fails, and the receiver falls back to
// the two-round form.
func peerIdentity(uc *net.UnixConn) (pid uint32, start uint64, err error) {
	if f := peerIdentityForTest.Load(); f != nil {
		return (*f)(uc)
	}
	return kernelPeerIdentity(uc)
}

// peerIdentityForTest, when set (only by a test), stands in for the
// kernel: an exporter that cannot check a receiver's identity. Atomic,
// since the server's goroutines read it while a test sets it.
var peerIdentityForTest atomic.Pointer[func(*net.UnixConn) (uint32, uint64, error)]

func kernelPeerIdentity(uc *net.UnixConn) (pid uint32, start uint64, err error) {
	cred, err := peerCred(uc)
	if err != nil {
		return 0, 0, Errorf(EAUTH, "cannot read the receiver's credentials (SO_PEERCRED): %w", err)
	}
	if cred.Pid <= 0 || !procShowsOurPIDs() {
		return 0, 0, Errorf(EAUTH, "the receiver asked for a one-round handshake bound to its pid, but it is not in the exporter's PID namespace (its pid here is %d), or this /proc is not of it: it must use the two-round handshake", cred.Pid)
	}
	st, err := processStartTime(int(cred.Pid))
	if err != nil {
		return 0, 0, Errorf(EAUTH, "cannot read the receiver's start time: %w", err)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return 0, 0, Errorf(EAUTH, "socket: %w", err)
	}
	pidfd := -1
	var opErr error
	if err := raw.Control(func(s uintptr) { pidfd, opErr = unix.GetsockoptInt(int(s), unix.SOL_SOCKET, soPeerPidfd) }); err != nil || opErr != nil {
		return 0, 0, Errorf(EAUTH, "cannot take a pidfd of the receiver (SO_PEERPIDFD, Linux 6.5+; refused once it has exited): %v%v; it must use the two-round handshake", err, opErr)
	}
	defer unix.Close(pidfd)
	// Signal 0 only asks whether it lives; EPERM (a receiver of another
	// uid) says it does.
	if err := unix.PidfdSendSignal(pidfd, 0, nil, 0); err != nil && err != unix.EPERM {
		return 0, 0, Errorf(EAUTH, "the process that connected (pid %d) has exited: %w", cred.Pid, err)
	}
	return uint32(cred.Pid), st, nil
}
