package core

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"
)

// TicketSize is VMMIPC_TICKET_SIZE: a ticket is always exactly this long.
const TicketSize = 256

// TicketFormat is the ticket layout version this library writes and reads.
// Version 2 added the exporter's start time and the buffer id; the whole
// ticket is bound into the handshake (see handshake.go). Version 3 added
// the exporter's namespaces (namespaces.go), and its handshake binds the
// connection's sockets instead of pids (sockends.go). Version 4 added the
// flags byte: whether the registration holds (RegisterOptions.Hold), so
// that a receiver asks for a lease (holds.go) only where a hold can be,
// and whether the exporter takes a stream's handshake in one round.
const TicketFormat = 4

// Ticket flags.
const (
	ticketHolds      uint8 = 1 << 0 // registered with RegisterOptions.Hold
	ticketOneRound   uint8 = 1 << 1 // the exporter takes a stream's handshake in one round (handshake.go)
	ticketFlagsKnown       = ticketHolds | ticketOneRound
)

const (
	addrAbstract uint8 = 1   // Linux abstract socket namespace
	addrPath     uint8 = 2   // filesystem socket
	maxAddrLen         = 107 // sun_path is 108 bytes including the NUL
)

var ticketMagic = [8]byte{'V', 'M', 'M', 'I', 'P', 'C', 'T', 'K'}

// Ticket layout (little-endian):
//
//	0   [8]  magic "VMMIPCTK"
//	8   u16  format version
//	10  u8   memory kind
//	11  u8   address kind
//	12  u32  exporter pid
//	16  u64  exporter start time (clock ticks after boot; 0 = unknown)
//	24  u64  registration id
//	32  u64  buffer id
//	40  [32] secret
//	72  u64  chunk count
//	80  u64  total size
//	88  [16] device UUID (CUDA) or zeros
//	104 u16  address length
//	106 [107] address bytes (abstract names without the leading NUL)
//	213 u8   flags (bit 0: the registration holds; bit 1: the exporter
//	         takes a stream's handshake in one round)
//	214 [2]  reserved, must be zero
//	216 u64  namespace device (st_dev of /proc/self/ns/*; 0 = unknown)
//	224 u64  exporter's PID namespace (inode; 0 = unknown)
//	232 u64  exporter's network namespace (inode; 0 = unknown)
//	240 u64  exporter's time namespace (inode; 0 = unknown or none)
//	248 [8]  reserved, must be zero
const (
	offMagic     = 0
	offFormat    = 8
	offKind      = 10
	offAddrKind  = 11
	offPid       = 12
	offStartTime = 16
	offRegID     = 24
	offBufferID  = 32
	offSecret    = 40
	offCount     = 72
	offTotal     = 80
	offUUID      = 88
	offAddrLen   = 104
	offAddr      = 106
	offFlags     = offAddr + maxAddrLen
	offReserved  = offFlags + 1
	offNSDev     = 216
	offPidNS     = 224
	offNetNS     = 232
	offTimeNS    = 240
	offReserved2 = 248
)

// Secret is the 256-bit random value that only the exporter and holders of
// the ticket know. It never crosses the socket: both sides prove knowledge
// of it with an HMAC.
type Secret [32]byte

// NewSecret draws a fresh secret from crypto/rand.
func NewSecret() (Secret, error) { return random32("secret") }

// random32 draws 32 bytes from crypto/rand: a secret, or a handshake's
// nonce (handshake.go).
func random32(what string) ([32]byte, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return b, Errorf(EINTERNAL, "reading a random %s: %w", what, err)
	}
	return b, nil
}

// Ticket is the decoded form of a vmmipc_ticket.
type Ticket struct {
	Kind       uint8  // MemoryHost or MemoryCUDA
	Address    string // socket address; "@name" for the abstract namespace
	Pid        uint32 // exporter's pid
	StartTime  uint64 // exporter's start time (/proc/<pid>/stat); 0 = unknown
	RegID      uint64
	BufferID   uint64 // the memory's identity, shared by its registrations
	Secret     Secret
	Count      uint64
	Total      uint64
	DeviceUUID [16]byte
	NS         Namespaces // the exporter's; what its pid and address mean
	Holds      bool       // the registration holds its receivers' uses (holds.go)
	OneRound   bool       // the exporter takes a stream's handshake in one round (handshake.go)
}

// orDamaged is what a receiver's every "the ticket's exporter is not
// there" message adds (liveness.go, dial.go): the ticket's own fields (pid,
// start time, namespaces, address) may be what is wrong, so an exporter
// that still runs is not blamed alone.
const orDamaged = "or the ticket is damaged, or comes from another host or container"

// Marshal encodes t into exactly TicketSize bytes.
func (t *Ticket) Marshal() ([TicketSize]byte, error) {
	var b [TicketSize]byte
	if err := t.validate(); err != nil {
		return b, err
	}
	copy(b[offMagic:], ticketMagic[:])
	binary.LittleEndian.PutUint16(b[offFormat:], TicketFormat)
	b[offKind] = t.Kind
	addr := t.Address
	if strings.HasPrefix(addr, "@") {
		b[offAddrKind] = addrAbstract
		addr = addr[1:]
	} else {
		b[offAddrKind] = addrPath
	}
	binary.LittleEndian.PutUint32(b[offPid:], t.Pid)
	binary.LittleEndian.PutUint64(b[offStartTime:], t.StartTime)
	binary.LittleEndian.PutUint64(b[offRegID:], t.RegID)
	binary.LittleEndian.PutUint64(b[offBufferID:], t.BufferID)
	copy(b[offSecret:], t.Secret[:])
	binary.LittleEndian.PutUint64(b[offCount:], t.Count)
	binary.LittleEndian.PutUint64(b[offTotal:], t.Total)
	copy(b[offUUID:], t.DeviceUUID[:])
	binary.LittleEndian.PutUint16(b[offAddrLen:], uint16(len(addr)))
	copy(b[offAddr:], addr)
	binary.LittleEndian.PutUint64(b[offNSDev:], t.NS.Dev)
	binary.LittleEndian.PutUint64(b[offPidNS:], t.NS.PID)
	binary.LittleEndian.PutUint64(b[offNetNS:], t.NS.Net)
	binary.LittleEndian.PutUint64(b[offTimeNS:], t.NS.Time)
	if t.Holds {
		b[offFlags] |= ticketHolds
	}
	if t.OneRound {
		b[offFlags] |= ticketOneRound
	}
	return b, nil
}

func (t *Ticket) validate() error {
	switch {
	case t.Kind != MemoryHost && t.Kind != MemoryCUDA:
		return Errorf(EINVAL, "ticket: unknown memory kind %d (want 1 = host or 2 = cuda)", t.Kind)
	case t.Count == 0:
		return Errorf(EINVAL, "ticket: chunk count is 0")
	case t.Count > MaxChunks:
		return Errorf(EINVAL, "ticket: chunk count %d exceeds the limit of %d", t.Count, MaxChunks)
	case t.Total < t.Count:
		return Errorf(EINVAL, "ticket: total size %d is smaller than the chunk count %d", t.Total, t.Count)
	case t.Pid == 0:
		return Errorf(EINVAL, "ticket: exporter pid is 0")
	case t.RegID == 0:
		return Errorf(EINVAL, "ticket: registration id is 0 (corrupted ticket?)")
	case t.BufferID == 0:
		return Errorf(EINVAL, "ticket: buffer id is 0 (corrupted ticket?)")
	case t.Kind == MemoryHost && t.DeviceUUID != [16]byte{}:
		return Errorf(EINVAL, "ticket: a host-memory ticket carries a device UUID (corrupted ticket?)")
	case t.NS.Dev == 0 && t.NS != Namespaces{}:
		return Errorf(EINVAL, "ticket: namespaces without their device (corrupted ticket?)")
	}
	switch addr := strings.TrimPrefix(t.Address, "@"); {
	case addr == "":
		return Errorf(EINVAL, "ticket: socket address %q is empty", t.Address)
	case len(addr) > maxAddrLen:
		return Errorf(EINVAL, "ticket: socket address %q is %d bytes, longer than the %d a ticket holds", t.Address, len(addr), maxAddrLen)
	case strings.IndexByte(addr, 0) >= 0:
		return Errorf(EINVAL, "ticket: socket address %q contains a NUL byte", t.Address)
	}
	// DecodeTicket refuses relative paths, so Marshal must too: a ticket
	// that encodes must decode.
	if !strings.HasPrefix(t.Address, "@") && !strings.HasPrefix(t.Address, "/") {
		return Errorf(EINVAL, "ticket: socket path %q is not absolute", t.Address)
	}
	return nil
}

// DecodeTicket parses a ticket. Anything truncated, malformed or of another
// format version is rejected with EINVAL and a message saying which.
func DecodeTicket(b []byte) (*Ticket, error) {
	if len(b) < TicketSize {
		return nil, Errorf(EINVAL, "ticket: %d bytes, fewer than the %d of a ticket (truncated)", len(b), TicketSize)
	}
	if len(b) > TicketSize {
		return nil, Errorf(EINVAL, "ticket: %d bytes, more than the %d of a ticket", len(b), TicketSize)
	}
	if [8]byte(b[offMagic:offMagic+8]) != ticketMagic {
		return nil, Errorf(EINVAL, "ticket: wrong magic: these bytes are not a vmmipc ticket")
	}
	if f := binary.LittleEndian.Uint16(b[offFormat:]); f != TicketFormat {
		return nil, Errorf(EINVAL, "ticket: format version %d, this libvmmipc reads version %d (sender and receiver must use libvmmipc versions with the same ticket format)", f, TicketFormat)
	}
	for i := range TicketSize {
		if b[i] != 0 && (i >= offReserved && i < offNSDev || i >= offReserved2) {
			return nil, Errorf(EINVAL, "ticket: reserved byte %d is not zero (corrupted ticket?)", i)
		}
	}
	t := &Ticket{
		Kind:      b[offKind],
		Pid:       binary.LittleEndian.Uint32(b[offPid:]),
		StartTime: binary.LittleEndian.Uint64(b[offStartTime:]),
		RegID:     binary.LittleEndian.Uint64(b[offRegID:]),
		BufferID:  binary.LittleEndian.Uint64(b[offBufferID:]),
		Count:     binary.LittleEndian.Uint64(b[offCount:]),
		Total:     binary.LittleEndian.Uint64(b[offTotal:]),
		NS: Namespaces{
			Dev:  binary.LittleEndian.Uint64(b[offNSDev:]),
			PID:  binary.LittleEndian.Uint64(b[offPidNS:]),
			Net:  binary.LittleEndian.Uint64(b[offNetNS:]),
			Time: binary.LittleEndian.Uint64(b[offTimeNS:]),
		},
	}
	if b[offFlags]&^ticketFlagsKnown != 0 {
		return nil, Errorf(EINVAL, "ticket: flags %#x not understood (corrupted ticket?)", b[offFlags])
	}
	t.Holds = b[offFlags]&ticketHolds != 0
	t.OneRound = b[offFlags]&ticketOneRound != 0
	copy(t.Secret[:], b[offSecret:])
	copy(t.DeviceUUID[:], b[offUUID:])
	n := int(binary.LittleEndian.Uint16(b[offAddrLen:]))
	if n == 0 || n > maxAddrLen {
		return nil, Errorf(EINVAL, "ticket: socket address length %d out of range 1..%d", n, maxAddrLen)
	}
	for i := offAddr + n; i < offFlags; i++ {
		if b[i] != 0 {
			return nil, Errorf(EINVAL, "ticket: bytes after the socket address are not zero (corrupted ticket?)")
		}
	}
	addr := string(b[offAddr : offAddr+n])
	switch b[offAddrKind] {
	case addrAbstract:
		t.Address = "@" + addr
	case addrPath:
		if !strings.HasPrefix(addr, "/") {
			return nil, Errorf(EINVAL, "ticket: socket path %q is not absolute", addr)
		}
		t.Address = addr
	default:
		return nil, Errorf(EINVAL, "ticket: unknown socket address kind %d", b[offAddrKind])
	}
	if err := t.validate(); err != nil {
		return nil, err
	}
	return t, nil
}

// Digest is the SHA-256 of the ticket's encoded bytes. The handshake binds
// it, so a ticket that differs from the exporter's in any byte is refused.
func (t *Ticket) Digest() ([32]byte, error) {
	b, err := t.Marshal()
	if err != nil {
		return [32]byte{}, err
	}
	return sha256.Sum256(b[:]), nil
}

// exporterKey names the process that issued t: its address, PID
// namespace, pid and start time (a pid alone can be reused, and repeats
// across namespaces).
func (t *Ticket) exporterKey() string {
	// Appended, not Sprintf'd: a table hit asks for it three times.
	b := make([]byte, 0, len(t.Address)+48)
	b = append(b, t.Address...)
	b = strconv.AppendUint(append(b, '|'), uint64(t.NS.PID), 10)
	b = strconv.AppendUint(append(b, '|'), uint64(t.Pid), 10)
	b = strconv.AppendUint(append(b, '|'), t.StartTime, 10)
	return string(b)
}

// String describes the ticket without its secret.
func (t *Ticket) String() string {
	kind := "host"
	if t.Kind == MemoryCUDA {
		kind = "cuda"
	}
	return fmt.Sprintf("ticket{%s, %d chunks, %d bytes, registration %d of buffer %d at %s, pid %d}",
		kind, t.Count, t.Total, t.RegID, t.BufferID, t.Address, t.Pid)
}
