package core

import (
	"errors"
	"net"
	"os"
	"strings"
	"syscall"
	"time"
)

// Dialing: how every connection of a receiver to an exporter begins (a
// stream's, a confirmation's (held or not): connect.go; a release's:
// clientlease.go; status
// queries': status.go), once liveness.go has found the exporter reachable
// and alive. Connect to the ticket's address, retrying while the listen
// backlog is full; check with SO_PEERCRED who holds the socket; and, when
// nobody listens there, say why. The server's side of this is accept.go.

// dialConn is dialExporter with the socket framed as a receiver's conn.
func dialConn(t *Ticket, deadline time.Time, timeout time.Duration) (*conn, error) {
	uc, err := dialExporter(t, deadline)
	if err != nil {
		return nil, err
	}
	c, err := newConn(uc, timeout, "receiver")
	if err != nil {
		_ = uc.Close()
		return nil, err
	}
	return c, nil
}

// dialExporter connects to the ticket's address, retrying while the listen
// backlog is full (EAGAIN from a Unix connect), and checks with SO_PEERCRED
// who holds the socket (checkExporter).
func dialExporter(t *Ticket, deadline time.Time) (*net.UnixConn, error) {
	for backoff := 100 * time.Microsecond; ; backoff = min(2*backoff, 20*time.Millisecond) {
		d := net.Dialer{Deadline: deadline}
		nc, err := d.Dial("unix", t.Address)
		if err == nil {
			uc := nc.(*net.UnixConn)
			if err := checkExporter(uc, t); err != nil {
				_ = uc.Close()
				return nil, err
			}
			return uc, nil
		}
		full := errors.Is(err, syscall.EAGAIN)
		switch {
		case full && time.Now().Add(backoff).Before(deadline):
			time.Sleep(backoff)
			continue
		case full:
			return nil, &Error{Code: EIO, Msg: "open: the exporter's listen backlog stayed full until the timeout: it is serving its maximum of receivers at once and many more are waiting; raise timeout_ms", Err: err}
		case errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT):
			return nil, &Error{Code: EIO, Msg: "open: nothing listens at " + t.Address + ": " + nobodyListens(t, err), Err: err}
		default:
			return nil, &Error{Code: ioCode(err), Msg: "open: cannot connect to the exporter at " + t.Address, Err: err}
		}
	}
}

// nobodyListens says why a connect found no listener at t's address.
func nobodyListens(t *Ticket, err error) string {
	switch {
	case strings.HasPrefix(t.Address, "@") && t.NS.netNS() == nsSame:
		return "the exporter closed its server or exited, " + orDamaged
	case strings.HasPrefix(t.Address, "@"):
		return "the exporter closed its server or exited, or it is in another network namespace: abstract sockets do not cross network namespaces; set " + SocketDirEnv + " to a directory both sides mount; " + orDamaged
	case errors.Is(err, syscall.ENOENT):
		return "no such socket file: the exporter closed its server, or this process does not see its socket directory (mount the same directory at the same path on both sides), " + orDamaged
	}
	return "the exporter exited or closed its server, leaving its socket file behind, " + orDamaged
}

// checkExporter is the first filter before the handshake proves anything:
// the socket's owner must be our uid or root, and, where the ticket's pid
// means something here (the exporter's PID namespace), that pid. Across
// PID namespaces the kernel reports a pid of ours for the exporter, or 0
// when it cannot see it: no evidence either way, so only the uid, the
// exporter's lock (liveness.go) and the handshake decide.
func checkExporter(uc *net.UnixConn, t *Ticket) error {
	cred, err := peerCred(uc)
	if err != nil {
		return Errorf(EAUTH, "open: cannot read the exporter's credentials (SO_PEERCRED): %v", err)
	}
	if me := uint32(os.Getuid()); cred.Uid != me && cred.Uid != 0 && me != 0 {
		return Errorf(EAUTH, "open: the socket %s belongs to uid %d; only our own uid or root may export to us%s", t.Address, cred.Uid, overflowUIDNote(cred.Uid))
	}
	if t.NS.pidNS() == nsSame && uint32(cred.Pid) != t.Pid {
		return Errorf(EAUTH, "open: the socket %s belongs to pid %d, but the ticket was issued by pid %d; refusing to trust it (the exporter exited and another process took its address, or the ticket is damaged or forged)", t.Address, cred.Pid, t.Pid)
	}
	return nil
}
