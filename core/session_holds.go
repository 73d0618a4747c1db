package core

// A session's part in holds (holds.go has the why, leases.go the table):
// the lease a held use names (hold-on) or is granted, and a release
// connection. The receiver's side is holder.go.

// holdOn finds the lease a hold-on names; a lease this exporter does not
// know (any more) is answered lease-gone, so that the receiver asks for a
// new one.
func (ss *session) holdOn(f frame) (*lease, bool) {
	m, err := parseLeaseRef(msgHoldOn, f.Body)
	if err != nil {
		ss.refuse(err)
		return nil, false
	}
	l, err := ss.reg.leases.use(m, ss.peerPid(), true)
	if err == errLeaseGone {
		ss.leaseGone()
		return nil, false
	}
	if err != nil {
		ss.refuse(err)
		return nil, false
	}
	return l, true
}

// grantLease makes a lease for the authenticated receiver, sends it with a
// descriptor of the lease file, and believes it once the receiver says it
// locked its slot and the lock is there.
func (ss *session) grantLease() (*lease, bool) {
	l, fd, err := ss.reg.leases.grant(ss.peerPid())
	if err != nil {
		ss.refuse(err)
		return nil, false
	}
	err = ss.c.send(leaseRefMsg{Slot: l.slot, Token: l.token}.encode(msgLease), fd)
	closeFD(&fd)
	if err != nil {
		return l, false
	}
	f, ok := ss.recv()
	if !ok {
		return l, false
	}
	if f.Type != msgLeased {
		ss.refuse(Errorf(EINVAL, "protocol: expected leased, got %s", msgName(f.Type)))
		return l, false
	}
	if err := ss.reg.leases.verify(l); err != nil {
		ss.refuse(err)
		return l, false
	}
	return l, true
}

// serveRelease lets go of the holds a release names on its lease. On a
// connection of its own it is answered release-ack (and, at the receiver's
// word, the lease ends); carried by a held use (releaseHoldOn) it stands
// for that use's hold-on: it returns the lease and true, and the use's
// answers answer it.
func (ss *session) serveRelease(f frame) (*lease, bool) {
	m, err := parseRelease(f.Body)
	if err != nil {
		ss.refuse(err)
		return nil, false
	}
	holdOn := m.Flags&releaseHoldOn != 0
	l, err := ss.reg.leases.use(leaseRefMsg{Slot: m.Slot, Token: m.Token}, ss.peerPid(), false)
	if err == errLeaseGone {
		ss.leaseGone()
		return nil, false
	}
	if err != nil {
		ss.refuse(err)
		return nil, false
	}
	n := ss.reg.leases.letGo(l, m.RegIDs, m.Flags&releaseEnd != 0)
	if holdOn {
		if err := ss.reg.leases.holdsItsMost(l); err != nil {
			ss.reg.leases.done(l)
			ss.refuse(err)
			return nil, false
		}
		return l, true
	}
	ss.reg.leases.done(l)
	_ = ss.c.send(releaseAckMsg{LetGo: uint64(n)}.encode(), -1)
	return nil, false
}

func (ss *session) leaseGone() {
	ss.refused = true
	_ = ss.c.send(encodeMsg(msgLeaseGone, nil), -1)
}

// peerPid is the receiver's pid in our PID namespace (0: it is in another
// one, or SO_PEERCRED failed): a lease is bound to it.
func (ss *session) peerPid() int32 {
	cred, err := peerCred(ss.p.uc)
	if err != nil {
		return 0
	}
	return cred.Pid
}
