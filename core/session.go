package core

import "time"

// maxStatusQueries bounds the status queries one connection may ask.
const maxStatusQueries = 4096

// One receiver's session on the server (accept.go starts it): status
// queries, or a release (session_holds.go), or hold-on and hello, the
// server's half of the handshake (handshake.go), a lease if asked
// (session_holds.go), one use (its chunks: session_chunks.go) and the
// done-ack. Every session ends there: no connection outlives its use.

// serve runs one connection.
func serve(reg *Registry, adm *admission, p *pendingConn) {
	ss := &session{reg: reg, adm: adm, p: p}
	defer adm.done(p)
	c, err := newConn(p.uc, 0, "server")
	if err != nil {
		_ = p.uc.Close()
		return
	}
	defer c.Close()
	defer func() { _ = recover() }() // a bug here must not take the host down
	c.deadline = p.since.Add(handshakeTimeout)
	ss.c = c
	ss.run()
	// A peer dropped before it authenticated, evicted or out of time (a
	// receiver starved of CPU, say), is told "busy": a libvmmipc receiver
	// retries within its own timeout.
	if !ss.authed && !ss.refused && (adm.wasEvicted(p) || time.Now().After(p.since.Add(handshakeTimeout))) {
		c.deadline, c.timeout = time.Time{}, 100*time.Millisecond
		_ = c.send(encodeMsg(msgBusy, nil), -1)
	}
}

func (ss *session) run() {
	f, ok := ss.recv()
	if !ok {
		return
	}
	var l *lease // the lease this use is held on (hold-on, or granted below)
	defer func() {
		if l != nil {
			ss.reg.leases.done(l)
		}
	}()
	switch f.Type {
	case msgStatus:
		ss.answerStatus(f)
		return
	case msgRelease, msgHoldOn:
		if f.Type == msgRelease {
			l, ok = ss.serveRelease(f) // ok: it carries a held use
		} else {
			l, ok = ss.holdOn(f)
		}
		if !ok {
			return
		}
		if f, ok = ss.recv(); !ok {
			return
		}
		if f.Type != msgHello {
			ss.refuse(Errorf(EINVAL, "protocol: expected hello after hold-on, got %s", msgName(f.Type)))
			return
		}
	case msgHello:
	default:
		ss.refuse(Errorf(EINVAL, "protocol: expected hello, got %s", msgName(f.Type)))
		return
	}
	hello, err := parseHello(f.Body)
	if err != nil {
		ss.refuse(err)
		return
	}
	if l != nil && hello.Flags&helloLease != 0 {
		ss.refuse(Errorf(EINVAL, "protocol: a hello after hold-on cannot ask for a lease too"))
		return
	}
	g, err := ss.reg.lookup(hello.RegID)
	if err != nil {
		ss.refuse(err)
		return
	}
	if !ss.authenticate(g, hello) {
		return
	}
	if hello.Flags&helloLease != 0 {
		if l, ok = ss.grantLease(); !ok {
			return
		}
	}
	if hello.Flags&helloTable != 0 && !ss.sendTable() {
		return
	}
	if ss.serveUse(g, hello, l) && hello.Flags&helloMore != 0 {
		ss.serveMoreUses(l)
	}
}

// serveUse serves the use the hello asked for: the chunks, or a
// confirmation of a cached mapping, then the done-ack. A holdable
// registration's use is held on l (if any) from right before it is spent.
// It reports whether the done-ack went out.
func (ss *session) serveUse(g *registration, hello helloMsg, l *lease) bool {
	cl, err := g.claim(func() { _ = ss.c.Close() })
	if err != nil {
		ss.refuse(err)
		return false
	}
	defer g.drop(cl)
	ss.c.deadline = time.Time{}
	ss.c.timeout = idleTimeout
	b := g.buf
	welcome := welcomeMsg{Count: uint64(len(b.sizes)), Total: b.total, Kind: b.kind, BufferID: b.id}.encode()
	if hello.Flags&helloConfirm != 0 {
		ss.c.queue(welcome) // with the done-ack: a confirmation is one write
	} else if err := ss.c.send(welcome, -1); err != nil {
		return false
	}
	// The use is spent as the last chunk goes out (or a cached mapping is
	// confirmed), whether or not the receiver says done: counting only
	// "done" would let a receiver pull everything, hang up and pull again.
	// It is spent just before that chunk is sent, so that a receiver never
	// holds every chunk of a use the exporter has not counted yet; it is
	// given back if the chunk cannot be sent. A used-up registration ends
	// after the receiver has its answer (or has gone): its release
	// (dropping CUDA references, say) may take a while. A hold is taken
	// before the use is spent, so that the registration can never be
	// released in between.
	var spent, usedUp, held bool
	spend := func(spendIt bool) {
		switch {
		case spendIt && !spent:
			held = l != nil && ss.reg.leases.take(l, g)
			spent, usedUp = true, g.spend(cl)
		case !spendIt && spent:
			g.unspend(cl)
			if held {
				ss.reg.leases.letGo(l, []uint64{g.id}, false)
			}
			spent, usedUp, held = false, false, false
		}
	}
	defer func() {
		if usedUp {
			g.endUsedUp()
		}
	}()
	acked := false
	defer func() {
		// Only the done-ack tells the receiver that its use is held:
		// without it the receiver never lets go, so neither may its lease
		// keep it.
		if held && !acked {
			ss.reg.leases.letGo(l, []uint64{g.id}, false)
		}
	}()
	if hello.Flags&helloConfirm != 0 {
		spend(true)
	} else if !ss.serveChunks(g, spend) {
		return false
	}
	acked = ss.c.send(doneAckMsg{Flags: ss.ackFlags(g, usedUp, held)}.encode(), -1) == nil
	return acked
}

// sendTable answers helloTable: a read-only descriptor of the grant table
// (granttable.go), or word that there is none; after a table, it takes the
// receiver's spend log (spendlog.go) and says whether it did (with the
// welcome).
func (ss *session) sendTable() bool {
	fd, own, err := ss.reg.table.readOnly()
	m := tableMsg{Slots: tableSlots, FD: uint64(own)}
	if err != nil {
		m = tableMsg{}
	}
	err = ss.c.send(m.encode(), fd)
	closeFD(&fd)
	if err != nil || m.Slots == 0 {
		return err == nil
	}
	f, err := ss.c.recv() // the one message a receiver sends a descriptor with
	if err != nil {
		closeFD(&f.FD)
		if CodeOf(err) == EINVAL {
			ss.refuse(err)
		}
		return false
	}
	defer closeFD(&f.FD)
	if f.Type != msgSpendLog {
		ss.refuse(Errorf(EINVAL, "protocol: expected spend-log after the table, got %s", msgName(f.Type)))
		return false
	}
	lm, err := parseSpendLog(f.Body)
	if err == nil && lm.Records != 0 && lm.Records != spendRecords {
		err = Errorf(EINVAL, "protocol: a spend log of %d records, want %d", lm.Records, spendRecords)
	}
	if err == nil && (lm.Records != 0) != (f.FD >= 0) {
		err = Errorf(EINVAL, "protocol: a spend-log of %d records came with %s", lm.Records, map[bool]string{true: "a descriptor", false: "none"}[f.FD >= 0])
	}
	if err != nil {
		ss.refuse(err)
		return false
	}
	taken := false
	if f.FD >= 0 {
		pid, start := ss.peerProcess()
		taken = ss.reg.spends.adopt(f.FD, pid, start)
	}
	ss.c.queue(logAckMsg{Taken: taken}.encode())
	return true
}

// peerProcess is the receiver's pid and start time: as the one-round
// handshake proved them, or as the kernel and /proc say (0, 0 if they
// cannot).
func (ss *session) peerProcess() (uint32, uint64) {
	if ss.tr.Flags&helloOneRound != 0 {
		return uint32(ss.tr.Socket), ss.tr.StartTime
	}
	pid := ss.peerPid()
	if pid <= 0 {
		return 0, 0
	}
	start, err := processStartTime(int(pid))
	if err != nil {
		return 0, 0
	}
	return uint32(pid), start
}

// authenticate runs the server's half of the handshake (handshake.go) and
// then takes the connection out of the pending set.
func (ss *session) authenticate(g *registration, hello helloMsg) bool {
	if hello.Flags&helloOneRound != 0 {
		return ss.authenticateOneRound(g, hello)
	}
	ns, err := newNonce()
	if err != nil {
		ss.refuse(err)
		return false
	}
	sock, err := ss.binding(hello.Flags)
	if err != nil {
		ss.refuse(err)
		return false
	}
	tr := transcript{
		RegID: hello.RegID, Flags: hello.Flags, Socket: sock,
		TicketDigest: g.digest, ReceiverNonce: hello.Nonce, ServerNonce: ns,
	}
	if err := ss.c.send(challengeMsg{Nonce: ns, Proof: tr.proof(g.secret, roleServer)}.encode(), -1); err != nil {
		return false
	}
	pm, ok := ss.recvProof("proof")
	if !ok {
		return false
	}
	if !tr.verify(g.secret, roleReceiver, pm.Proof) {
		ss.refuse(Errorf(EAUTH, "the receiver's proof for registration %d does not check out: its ticket is corrupted or forged", g.id))
		return false
	}
	ss.tr = tr
	ss.authed = ss.adm.authenticated(ss.p)
	return ss.authed
}

// authenticateOneRound is the server's half of the one-round form
// (handshake.go): the receiver's proof has followed its hello, bound to
// the pid and start time the kernel reports of the process that
// connected. Only once it checks out does the server prove itself, and
// the welcome follows in the same breath.
func (ss *session) authenticateOneRound(g *registration, hello helloMsg) bool {
	if hello.Flags&helloPidBound != 0 {
		ss.refuse(Errorf(EINVAL, "protocol: the one-round handshake binds the receiver's pid and start time itself, got hello flags %#x", hello.Flags))
		return false
	}
	pm, ok := ss.recvProof("proof after a one-round hello")
	if !ok {
		return false
	}
	pid, start, err := peerIdentity(ss.p.uc)
	if err != nil {
		ss.refuse(err)
		return false
	}
	tr := transcript{
		RegID: hello.RegID, Flags: hello.Flags, Socket: uint64(pid),
		TicketDigest: g.digest, ReceiverNonce: hello.Nonce, StartTime: start,
	}
	if !tr.verify(g.secret, roleReceiver, pm.Proof) {
		ss.refuse(Errorf(EAUTH, "the receiver's one-round proof for registration %d does not check out: its ticket is corrupted or forged, or another process (pid %d, started at tick %d) relays or replays it", g.id, pid, start))
		return false
	}
	// The proof goes out with the welcome (and a confirmation's done-ack:
	// serveUse), or with whatever comes next (a lease, a refusal), in one
	// write.
	ss.c.queue(challengeMsg{Proof: tr.proof(g.secret, roleServer)}.encode())
	ss.tr = tr
	ss.authed = ss.adm.authenticated(ss.p)
	return ss.authed
}

// binding is what this session's proofs bind the connection by
// (sockends.go): our socket's cookie, or the receiver's pid where it asked
// for that (it has no sock_diag), which must be one of our PID namespace.
func (ss *session) binding(flags uint64) (uint64, error) {
	if flags&helloPidBound == 0 {
		return exporterSocket(ss.c.raw, roleServer)
	}
	cred, err := peerCred(ss.p.uc)
	if err != nil {
		return 0, Errorf(EAUTH, "cannot read the receiver's credentials (SO_PEERCRED): %w", err)
	}
	if cred.Pid == 0 {
		return 0, Errorf(EAUTH, "the receiver, which cannot use sock_diag, binds the handshake to its pid, but it is not in the exporter's PID namespace (its pid here is 0): it needs unix_diag in the kernel (modprobe unix_diag) and netlink sockets allowed by its seccomp profile")
	}
	return uint64(cred.Pid), nil
}

// answerStatus answers status queries until the peer stops asking.
func (ss *session) answerStatus(f frame) {
	for n := 0; n < maxStatusQueries; n++ {
		q, err := parseStatus(f.Body)
		if err != nil {
			ss.refuse(err)
			return
		}
		alive := ss.reg.bufferLives(q.BufferID)
		if ss.c.send(statusAckMsg{BufferID: q.BufferID, Alive: alive}.encode(), -1) != nil {
			return
		}
		var ok bool
		if f, ok = ss.recv(); !ok {
			return
		}
		if f.Type != msgStatus {
			ss.refuse(Errorf(EINVAL, "protocol: only status queries may follow a status query, got %s", msgName(f.Type)))
			return
		}
	}
}

// recvProof reads the receiver's proof message (what: how the refusal
// names the message expected), refusing anything else.
func (ss *session) recvProof(what string) (proofMsg, bool) {
	f, ok := ss.recv()
	if !ok {
		return proofMsg{}, false
	}
	if f.Type != msgProof {
		ss.refuse(Errorf(EINVAL, "protocol: expected %s, got %s", what, msgName(f.Type)))
		return proofMsg{}, false
	}
	pm, err := parseProof(f.Body)
	if err != nil {
		ss.refuse(err)
		return proofMsg{}, false
	}
	return pm, true
}
