package core

import (
	"fmt"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A recording proxy in front of a server: it relays receivers' connections,
// bytes and descriptors alike, so that a test sees everything that crossed
// the socket in each direction.

// recordingProxy relays connections between receivers and a server, bytes
// and descriptors alike, and records the bytes in each direction.
type recordingProxy struct {
	addr   string
	ln     *net.UnixListener
	relays sync.WaitGroup

	mu                   sync.Mutex
	toServer, toReceiver []byte
	fds                  int // descriptors relayed, both ways
}

func newRecordingProxy(t testing.TB, target string) *recordingProxy {
	t.Helper()
	p := &recordingProxy{addr: fmt.Sprintf("@vmmipc-test-proxy-%d-%d", os.Getpid(), randIndex(1<<30))}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: p.addr, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	p.ln = ln
	p.relays.Add(1)
	go func() {
		defer p.relays.Done()
		for {
			rc, err := ln.AcceptUnix()
			if err != nil {
				return
			}
			sc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: target, Net: "unix"})
			if err != nil {
				rc.Close()
				continue
			}
			p.relays.Add(1)
			go func() {
				defer p.relays.Done()
				var both sync.WaitGroup
				both.Add(2)
				go func() { defer both.Done(); p.relay(rc, sc, &p.toServer) }()
				go func() { defer both.Done(); p.relay(sc, rc, &p.toReceiver) }()
				both.Wait()
				rc.Close()
				sc.Close()
			}()
		}
	}()
	t.Cleanup(func() { p.recorded(t) })
	return p
}

// proxyInFront puts a recording proxy in front of s: the tickets s issues
// from now on name the proxy's address, so receivers connect to it.
func proxyInFront(t testing.TB, s *Server) *recordingProxy {
	t.Helper()
	p := newRecordingProxy(t, s.Addr())
	s.reg.mu.Lock()
	s.reg.addr = p.addr
	s.reg.mu.Unlock()
	return p
}

// relay copies from one connection to the other until end of stream,
// descriptors included, then half-closes the other. It reads one message
// at a time (its header, then its body), as a libvmmipc peer does: a
// larger read could take the bytes of a message and those of the next,
// with the next one's descriptor, which the proxy would then attach to
// the first.
func (p *recordingProxy) relay(from, to *net.UnixConn, record *[]byte) {
	for {
		msg, fds, err := readMessage(from)
		if len(msg) > 0 {
			p.mu.Lock()
			*record = append(*record, msg...)
			p.fds += len(fds)
			p.mu.Unlock()
			var rights []byte
			if len(fds) > 0 {
				rights = unix.UnixRights(fds...)
			}
			for rest := msg; len(rest) > 0 && err == nil; rights = nil {
				var k int
				k, _, err = to.WriteMsgUnix(rest, rights, nil)
				rest = rest[k:]
			}
		}
		closeAll(fds)
		if err != nil || len(msg) == 0 {
			_ = to.CloseWrite()
			_ = from.CloseRead()
			return
		}
	}
}

// readMessage reads one message, header and body (all that arrives, when
// the header does not parse), and the descriptors that came with it.
func readMessage(from *net.UnixConn) (msg []byte, fds []int, err error) {
	read := func(n int) error {
		oob := make([]byte, unix.CmsgSpace(4*8))
		for want := len(msg) + n; len(msg) < want; {
			buf := make([]byte, want-len(msg))
			k, oobn, _, _, err := from.ReadMsgUnix(buf, oob)
			if oobn > 0 {
				if msgs, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
					for i := range msgs {
						got, _ := unix.ParseUnixRights(&msgs[i])
						fds = append(fds, got...)
					}
				}
			}
			if k > 0 {
				msg = append(msg, buf[:k]...)
			}
			if err != nil || k <= 0 {
				return fmt.Errorf("read: %v (%d bytes)", err, k)
			}
		}
		return nil
	}
	if err := read(headerSize); err != nil {
		return msg, fds, err
	}
	h, herr := parseHeader(msg)
	if herr != nil {
		return msg, fds, nil // relayed as it came: the peer refuses it
	}
	return msg, fds, read(int(h.Len))
}

// recorded stops the proxy, waits for every relay to end and returns what
// crossed it.
func (p *recordingProxy) recorded(t testing.TB) (toServer, toReceiver []byte) {
	p.ln.Close()
	done := make(chan struct{})
	go func() { p.relays.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("a proxied connection is still open 10 s after the proxy was stopped")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.toServer, p.toReceiver
}

// descriptors is how many descriptors crossed the proxy.
func (p *recordingProxy) descriptors() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.fds
}
