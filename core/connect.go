package core

import (
	"errors"
	"net"
	"os"
	"sync"
	"time"
)

// The start of a receiver's session, shared by a stream (stream.go) and a
// confirmation (confirm.go), held or not (holder.go), which may bring the
// exporter's grant table (granttable_view.go): the
// receiver's half of the handshake (handshake.go; the server's half is in
// session.go), on a connection dial.go made, bound by sockends.go.
// connect runs the start of a session: reachability and liveness, dial,
// peer check and handshake, retrying a full listen backlog and "busy"
// answers until timeout. It returns the authenticated connection, welcome
// checked. With ask, the use is held: on the lease ask names, or on a new
// one the session brings (ask.got). tail (a stream's first pull-run) goes
// out with the receiver's last message of the handshake, so that its
// answer follows the welcome without another round trip.
func connect(t *Ticket, timeout time.Duration, flags uint64, ask *holdAsk, tail []byte) (*conn, transcript, error) {
	if err := checkBeforeDial(t); err != nil {
		return nil, transcript{}, err
	}
	bound, err := bindingFlag(t)
	if err != nil {
		return nil, transcript{}, err
	}
	digest, err := t.Digest()
	if err != nil {
		return nil, transcript{}, err
	}
	// One round trip first, for a confirmation, and for a stream where the
	// exporter says it takes one (handshake.go).
	oneRound := (flags&helloConfirm != 0 || t.OneRound) && oneRoundWorks(t) && !twoRoundsOnly(t)
	if wantTable(t) {
		flags |= helloTable // once per exporter: later hits read it (granttable.go)
	}
	deadline := time.Now().Add(timeout)
	for backoff := time.Millisecond; ; backoff = min(2*backoff, 50*time.Millisecond) {
		c, err := dialConn(t, deadline, timeout)
		if err != nil {
			return nil, transcript{}, err
		}
		f := flags | bound
		if oneRound {
			f = flags | helloOneRound
		}
		tr, err := handshake(c, t, digest, f, ask, tail)
		if err == nil {
			return c, tr, nil
		}
		_ = c.Close()
		var refused *oneRoundRefused
		if errors.As(err, &refused) {
			oneRound = false // at once, in two rounds, and from now on with this exporter
			oneRoundRefusers.Store(t.exporterKey(), true)
			continue
		}
		if err != errBusy {
			return nil, transcript{}, err
		}
		if !time.Now().Add(backoff).Before(deadline) {
			return nil, transcript{}, WrapErr(EIO, err, "open: gave up after %v", timeout)
		}
		time.Sleep(backoff)
	}
}

// bindingFlag says what this receiver's handshakes bind the connection by:
// the exporter's socket (no flag), or, without sock_diag, its own pid, which
// only the exporter's PID namespace can check (sockends.go).
func bindingFlag(t *Ticket) (uint64, error) {
	err := sockDiagWorks()
	switch {
	case err == nil:
		return 0, nil
	case CodeOf(err) == ENFILE:
		return 0, err
	case t.NS.pidNS() == nsOther:
		return 0, Errorf(EIO, "open: this process cannot ask the kernel which socket is its peer (NETLINK_SOCK_DIAG for unix sockets: %w), which the handshake needs across PID namespaces, and the exporter (pid %d in its own) is in another one; the kernel needs unix_diag (CONFIG_UNIX_DIAG; modprobe unix_diag), and a seccomp profile must allow netlink sockets", err, t.Pid)
	}
	return helloPidBound, nil
}

// handshake runs the receiver's half of handshake.go, in one round trip
// where flags ask for it (helloOneRound) or else two, takes the lease the
// session brings (where ask asks for one), and checks the welcome.
func handshake(c *conn, t *Ticket, digest [32]byte, flags uint64, ask *holdAsk, tail []byte) (tr transcript, err error) {
	nr, err := newNonce()
	if err != nil {
		return tr, err
	}
	// Hold-on (or the releases queued on the lease, which stand for it),
	// hello and (one-round) the proof go out in one write.
	var first []byte
	challenged := false
	switch {
	case ask != nil && ask.on != nil:
		l := ask.on
		ids := l.takeQueued(maxReleaseBatch)
		if len(ids) == 0 {
			first = leaseRefMsg{Slot: l.slot, Token: l.token}.encode(msgHoldOn)
			break
		}
		first = releaseMsg{Slot: l.slot, Token: l.token, Flags: releaseHoldOn, RegIDs: ids}.encode()
		// The exporter challenges only once it let go of them; without
		// its proven challenge, they may or may not have been.
		defer func() {
			if !challenged && !errors.Is(err, errLeaseGone) {
				l.markLost()
			}
		}()
	case ask != nil:
		flags |= helloLease
	}
	first = append(first, helloMsg{RegID: t.RegID, Flags: flags, Nonce: nr}.encode()...)
	oneRound := flags&helloOneRound != 0
	// tail goes with our last message: the proof, or leased when the
	// session brings a lease, or the spend log when it brings a grant
	// table (the exporter reads those before anything).
	var proofTail, leasedTail, tableTail []byte
	switch {
	case flags&helloLease != 0:
		leasedTail = tail
	case flags&helloTable != 0:
		tableTail = tail
	default:
		proofTail = tail
	}
	if oneRound {
		tr = transcript{
			RegID: t.RegID, Flags: flags, Socket: uint64(os.Getpid()),
			TicketDigest: digest, ReceiverNonce: nr, StartTime: ourStartTime(),
		}
		first = append(first, proofMsg{Proof: tr.proof(t.Secret, roleReceiver)}.encode()...)
		first = append(first, proofTail...)
	}
	if err := c.send(first, -1); err != nil {
		// A server that refuses us at once hangs up after saying why:
		// read that rather than report a bare EPIPE.
		return tr, pendingError(c, err, beforeChunks)
	}
	f, err := recvControl(c, "challenge")
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) || isTimeout(err) {
			return tr, Errorf(EIO, "open: connected, but the exporter did not answer within %v: it may be serving its maximum of receivers at once (the rest wait their turn), or be hung; raise timeout_ms if it is just busy", c.timeout)
		}
		// Only the exporter's own refusal says that it may not take one
		// round: anything else from the peer is its fault, not the form's.
		if code := CodeOf(err); oneRound && f.Type == msgError && (code == EAUTH || code == EINVAL) {
			return tr, &oneRoundRefused{err}
		}
		return tr, err
	}
	ch, err := parseChallenge(f.Body)
	if err != nil {
		return tr, err
	}
	if !oneRound {
		if tr, err = boundTranscript(c, t, digest, flags, nr, ch.Nonce); err != nil {
			return tr, err
		}
	}
	// A one-round challenge has no nonce: one with a nonce proves nothing.
	if (oneRound && ch.Nonce != (nonce{})) || !tr.verify(t.Secret, roleServer, ch.Proof) {
		return tr, Errorf(EAUTH, "open: the process at %s could not prove that it knows this ticket's secret for this connection: the ticket is corrupted or forged, or another process is impersonating the exporter or relaying to it; nothing was accepted from it", t.Address)
	}
	challenged = true // by the exporter itself
	if !oneRound {
		if err := c.send(append(proofMsg{Proof: tr.proof(t.Secret, roleReceiver)}.encode(), proofTail...), -1); err != nil {
			return tr, pendingError(c, err, beforeChunks)
		}
	}
	if flags&helloLease != 0 {
		if ask.got, err = takeSessionLease(c, t, leasedTail); err != nil {
			return tr, err
		}
	}
	if flags&helloTable != 0 {
		if err := recvTable(c, t, tableTail); err != nil {
			return tr, err
		}
	}
	f, err = recvControl(c, "welcome")
	if err != nil {
		return tr, err
	}
	w, err := parseWelcome(f.Body)
	if err != nil {
		return tr, err
	}
	if w.Count != t.Count || w.Total != t.Total || w.Kind != t.Kind || w.BufferID != t.BufferID {
		return tr, Errorf(EINVAL, "protocol: the exporter describes %d chunks / %d bytes / kind %d / buffer %d, the ticket %d / %d / %d / %d", w.Count, w.Total, w.Kind, w.BufferID, t.Count, t.Total, t.Kind, t.BufferID)
	}
	return tr, nil
}

// boundTranscript is the two-round form's transcript, once the challenge
// has come: bound to the exporter's socket of the connection, or to our
// pid (helloPidBound).
func boundTranscript(c *conn, t *Ticket, digest [32]byte, flags uint64, nr, ns nonce) (transcript, error) {
	// The exporter has accepted the connection (it answered): its socket
	// is a socket now, with its inode and cookie.
	sock := uint64(os.Getpid())
	var err error
	if flags&helloPidBound == 0 {
		sock, err = exporterSocket(c.raw, roleReceiver)
	}
	if errors.Is(err, errNoPeer) {
		return transcript{}, pendingError(c, err, beforeChunks) // evicted after the challenge: "busy"
	}
	if err != nil {
		return transcript{}, WrapErr(EIO, err, "open")
	}
	return transcript{
		RegID: t.RegID, Flags: flags, Socket: sock,
		TicketDigest: digest, ReceiverNonce: nr, ServerNonce: ns,
	}, nil
}

// oneRoundRefused is the exporter's EAUTH or EINVAL to a one-round
// hello: its kernel, /proc or namespaces may not let it check our pid and
// start time (no SO_PEERPIDFD, say), or it is a library from before the
// one-round form (hello flags not understood), so connect asks again in
// two rounds, which answer for the ticket itself.
type oneRoundRefused struct{ err error }

func (e *oneRoundRefused) Error() string { return e.err.Error() }
func (e *oneRoundRefused) Unwrap() error { return e.err }

// oneRoundEnabled lets a test run confirmations in two rounds.
var oneRoundEnabled = true

// oneRoundWorks says whether a confirmation to t's exporter may try the
// one-round handshake: our pid and start time must read the same to it,
// so we must share its PID namespace and its clock (start times are
// counted in the reader's time namespace).
func oneRoundWorks(t *Ticket) bool {
	return oneRoundEnabled && t.NS.pidNS() == nsSame && sameClock(t) && ourStartTime() != 0
}

// oneRoundRefusers are the exporters that refused a one-round hello (a
// kernel without SO_PEERPIDFD, an older library): they are not asked again,
// so each confirmation to them costs no refused attempt first.
var oneRoundRefusers sync.Map // exporterKey → true

func twoRoundsOnly(t *Ticket) bool {
	_, ok := oneRoundRefusers.Load(t.exporterKey())
	return ok
}

var startTimeOnce struct {
	sync.Once
	v uint64
}

// ourStartTime is selfStartTime, read once: it never changes, and the
// library does not survive fork.
func ourStartTime() uint64 {
	startTimeOnce.Do(func() { startTimeOnce.v = selfStartTime() })
	return startTimeOnce.v
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
