package core

import (
	"encoding/binary"
	"errors"
	"syscall"

	"golang.org/x/sys/unix"
)

// The handshake binds the connection it runs on by the inode numbers of
// its two sockets, which the kernel reports alike to both ends in every
// namespace: each side fstats its own socket and asks sock_diag for its
// peer's. A relay between a receiver and the exporter holds two
// connections, so the receiver's pair and the exporter's pair always
// differ, and neither side's proof checks out for the other. (Pids cannot
// do this across PID namespaces: SO_PEERCRED reports 0 for a process we
// cannot see.)

// connEnds names the two sockets of one connection.
type connEnds struct {
	Receiver, Server uint64 // socket inode numbers
}

// socketEnds reads the ends of the connection raw is one end of; side is
// roleServer or roleReceiver, the side raw is.
func socketEnds(raw syscall.RawConn, side byte) (connEnds, error) {
	var ends connEnds
	var opErr error
	if err := raw.Control(func(fd uintptr) { ends, opErr = endsOf(int(fd), side) }); err != nil {
		return connEnds{}, Errorf(EIO, "socket: %w", err)
	}
	return ends, opErr
}

// endsOf is socketEnds on a descriptor. It is a variable only so that
// TestSecretNeverCrossesTheSocket can relay a whole session to record it,
// in a process of its own that sets it before anything runs.
var endsOf = kernelEnds

func kernelEnds(fd int, side byte) (connEnds, error) {
	var st unix.Stat_t
	err := unix.Fstat(fd, &st)
	var peer uint64
	if err == nil {
		peer, err = unixPeerInode(st.Ino)
	}
	if errors.Is(err, errNoPeer) {
		return connEnds{}, err
	}
	if err != nil {
		return connEnds{}, Errorf(EIO, "cannot name the two ends of the connection (fstat, and NETLINK_SOCK_DIAG for the peer's unix socket): %w; the kernel needs unix_diag (CONFIG_UNIX_DIAG; modprobe unix_diag), and a seccomp profile must allow netlink sockets", err)
	}
	if side == roleServer {
		return connEnds{Receiver: peer, Server: st.Ino}, nil
	}
	return connEnds{Receiver: st.Ino, Server: peer}, nil
}

// sock_diag for AF_UNIX (linux/unix_diag.h); x/sys/unix lacks these.
const (
	udiagShowPeer   = 0x4 // UDIAG_SHOW_PEER
	unixDiagPeerAtt = 2   // UNIX_DIAG_PEER
	unixDiagReqSize = 24  // struct unix_diag_req
	unixDiagMsgSize = 16  // struct unix_diag_msg
)

// unixPeerInode asks the kernel (sock_diag) for the inode of the socket
// connected to our unix socket of inode ino. sock_diag answers within the
// request's sendto, so the read never waits.
func unixPeerInode(ino uint64) (uint64, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
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
		return 0, err
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, unix.MSG_DONTWAIT)
	if err != nil {
		return 0, err
	}
	return parsePeerInode(buf[:n], ino)
}

// parsePeerInode reads sock_diag's answer about socket ino.
func parsePeerInode(b []byte, ino uint64) (uint64, error) {
	le := binary.LittleEndian
	if len(b) < unix.SizeofNlMsghdr {
		return 0, Errorf(EIO, "sock_diag: a reply of %d bytes", len(b))
	}
	n := int(le.Uint32(b[0:]))
	if n < unix.SizeofNlMsghdr || n > len(b) {
		return 0, Errorf(EIO, "sock_diag: a message of %d bytes in a reply of %d", n, len(b))
	}
	typ, body := le.Uint16(b[4:]), b[unix.SizeofNlMsghdr:n]
	switch {
	case typ == unix.NLMSG_ERROR && len(body) >= 4:
		return 0, syscall.Errno(-int32(le.Uint32(body)))
	case typ != unix.SOCK_DIAG_BY_FAMILY || len(body) < unixDiagMsgSize:
		return 0, Errorf(EIO, "sock_diag: unexpected message type %d of %d bytes", typ, len(body))
	case uint64(le.Uint32(body[4:])) != ino:
		return 0, Errorf(EIO, "sock_diag: asked about socket %d, told about %d", ino, le.Uint32(body[4:]))
	}
	for a := body[unixDiagMsgSize:]; len(a) >= 4; {
		alen, atyp := int(le.Uint16(a[0:])), le.Uint16(a[2:])
		if alen < 4 || alen > len(a) {
			break
		}
		if atyp == unixDiagPeerAtt && alen >= 8 {
			if peer := le.Uint32(a[4:]); peer != 0 {
				return uint64(peer), nil
			}
		}
		a = a[min((alen+3)&^3, len(a)):]
	}
	return 0, errNoPeer
}

// errNoPeer: the other end of the connection is closed.
var errNoPeer = Errorf(EIO, "the other side has closed the connection")
