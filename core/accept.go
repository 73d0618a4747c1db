package core

import (
	"errors"
	"net"
	"time"
)

// The server's accept loop: a connection is accepted only while admission
// (admission.go) has room for it; a peer of a foreign uid is told why and
// dropped; every other connection is served on a goroutine of its own
// (session.go). A receiver's side of this is dial.go.

// acceptLoop accepts on ln until it is closed (Server.Close). uid is the
// exporter's: receivers of that uid, and root's, are served.
func acceptLoop(ln *net.UnixListener, uid int, adm *admission, reg *Registry) {
	retry := backoff{first: fdWaitFirst, most: fdWaitMost}
	for adm.room() {
		uc, err := ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// EMFILE and friends (the host took the descriptor room()
			// counted): the connection stays in the backlog; wait for a
			// descriptor to free instead of spinning.
			time.Sleep(retry.wait())
			continue
		}
		retry.reset()
		// The uid is checked before the connection is counted: abstract
		// sockets have no permissions, so a process of any uid can
		// connect, and its connections must not take the slots of ours.
		if err := checkPeer(uc, uid); err != nil {
			if !adm.takeRefusal() {
				_ = uc.Close()
				continue
			}
			go func() {
				defer adm.doneRefusal()
				refuseConn(uc, err)
			}()
			continue
		}
		p := adm.admit(uc)
		go serve(reg, adm, p)
	}
}

// checkPeer admits receivers of our own uid, and root.
func checkPeer(uc *net.UnixConn, uid int) error {
	cred, err := peerCred(uc)
	if err != nil {
		return Errorf(EAUTH, "cannot read the receiver's credentials (SO_PEERCRED): %v", err)
	}
	if int(cred.Uid) != uid && cred.Uid != 0 {
		return Errorf(EAUTH, "receiver uid %d is not allowed: only the exporter's own uid or root may import", cred.Uid)
	}
	return nil
}

// refuseConn tells a peer that may not connect why, and hangs up. It does
// not wait for the peer: the message fits in the socket buffer.
func refuseConn(uc *net.UnixConn, err error) {
	defer func() { _ = recover() }()
	defer uc.Close()
	c, cerr := newConn(uc, 100*time.Millisecond, "server")
	if cerr != nil {
		return
	}
	_ = c.send(errorMsg{Code: CodeOf(err), Text: err.Error()}.encode(), -1)
}
