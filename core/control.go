package core

import "fmt"

// The control messages a receiver reads, none of which may bring a
// descriptor: the one it expects next, or the exporter's error or "busy"
// turned into an error; the error an exporter that hung up left queued;
// the done-ack that ends a use.
// errBusy is the server's "too many unauthenticated peers, retry".
var errBusy = Errorf(EIO, "the exporter is busy with other connections (its bound of connections not yet authenticated is full)")

// recvControl receives a message of type want (no descriptor allowed),
// turning error and busy messages into errors.
func recvControl(c *conn, want string) (frame, error) {
	f, err := c.recv()
	if err != nil {
		return f, err
	}
	if f.FD >= 0 {
		closeFD(&f.FD)
		return f, Errorf(EINVAL, "protocol: the exporter sent a descriptor with its %s message", msgName(f.Type))
	}
	switch {
	case f.Type == msgError:
		return f, remoteError(f.Body, beforeChunks)
	case f.Type == msgBusy:
		return f, errBusy
	case f.Type == msgLeaseGone:
		return f, errLeaseGone
	case msgName(f.Type) != want:
		return f, Errorf(EINVAL, "protocol: expected %s, got %s", want, msgName(f.Type))
	}
	return f, nil
}

// peerPhase says what a receiver was doing when its exporter sent an error:
// which statuses of the exporter's its call may return.
type peerPhase bool

const (
	beforeChunks peerPhase = false // the handshake, confirms, status, done-ack
	whileChunks  peerPhase = true  // pulling chunks: EEXPORT may come too
)

// remoteError turns the exporter's error message into a local error. Its
// status is kept when it is one the receiver's call lists as the
// exporter's (EINVAL, EAUTH, ENOENT, EIO, and EEXPORT while chunks flow);
// any other reads as EIO, naming it. An exporter's own trouble (ENFILE,
// EINTERNAL) is not the receiver's, and a peer not yet authenticated could
// otherwise pick any status (EFORK, EBADF) for a call whose contract does
// not list it.
func remoteError(body []byte, phase peerPhase) error {
	m, err := parseError(body)
	if err != nil {
		return err
	}
	switch m.Code {
	case EINVAL, EAUTH, ENOENT, EIO:
	case EEXPORT:
		if phase == whileChunks {
			break
		}
		fallthrough
	default:
		return &Error{Code: EIO, Msg: fmt.Sprintf("exporter: failed with %s: %s", m.Code, m.Text)}
	}
	return &Error{Code: m.Code, Msg: "exporter: " + m.Text}
}

// pendingError returns the exporter's queued error message if there is one,
// else fallback.
func pendingError(c *conn, fallback error, phase peerPhase) error {
	f, err := c.recv()
	if err != nil {
		return fallback
	}
	closeFD(&f.FD)
	switch f.Type {
	case msgError:
		return remoteError(f.Body, phase)
	case msgBusy:
		return errBusy
	case msgLeaseGone:
		return errLeaseGone
	}
	return fallback
}

// readDoneAck reads the done-ack and says whether the buffer lives on.
func readDoneAck(c *conn) (bool, error) {
	flags, err := readDoneAckFlags(c)
	return flags&ackBufferLives != 0, err
}

// readDoneAckFlags reads the done-ack and returns its flags.
func readDoneAckFlags(c *conn) (uint64, error) {
	f, err := recvControl(c, "done-ack")
	if err != nil {
		return 0, WrapErr(EIO, err, "waiting for the exporter to confirm")
	}
	ack, err := parseDoneAck(f.Body)
	if err != nil {
		return 0, err
	}
	return ack.Flags, nil
}
