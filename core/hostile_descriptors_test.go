package core

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Descriptors where none belong: sent to the server by a receiver, pushed
// by a "sender" before any challenge, several on one message. Each is
// closed and the peer refused.

// TestHostileReceiverSendsDescriptor: descriptors sent to the server, with
// the hello, with the proof or while streaming, are closed by it and the
// receiver refused.
func TestHostileReceiverSendsDescriptor(t *testing.T) {
	for _, tc := range []struct {
		name   string
		stage  int // 0: with the hello, 1: with the proof, 2: with the second pull
		chunks int
	}{
		{"with hello", 0, 0},
		{"with the proof", 1, 0},
		{"with a pull", 2, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostileSetup(t)
			file := newMemfd(t, 4096, pattern(4096, 1))
			var fd int
			var with []byte
			switch tc.stage {
			case 0:
				var err error
				if fd, err = rawDial(h.s.Addr()); err != nil {
					t.Fatal(err)
				}
				nr, _ := newNonce()
				with = helloMsg{RegID: h.tk.RegID, Nonce: nr}.encode()
			case 1:
				s, _ := rawHello(t, h.tk, 0)
				fd, with = s.fd, s.proof(h.tk.Secret)
			case 2:
				fd = rawAuthenticate(t, h.tk, 0)
				if err := rawWrite(fd, pullMsg{0, 1}.encode()); err != nil {
					t.Fatal(err)
				}
				time.Sleep(20 * time.Millisecond) // let the server act on it first
				with = pullMsg{1, 1}.encode()
			}
			if err := sendWithFDs(fd, with, []fdAttach{{0, 1}}, file); err != nil {
				t.Fatal(err)
			}
			unix.Close(file)
			_ = unix.Shutdown(fd, unix.SHUT_WR)
			msgs, r := readReply(t, fd)
			unix.Close(fd)
			expectRefused(t, msgs, r, EINVAL, "must not send descriptors", tc.chunks)
			for _, m := range msgs {
				if tc.stage < 2 && (m.Type == msgWelcome || m.Type == msgChunk) {
					t.Fatalf("a %s reached a receiver that sent a descriptor before authenticating", msgName(m.Type))
				}
			}
			h.check(t) // counts descriptors: the server closed the one we sent
		})
	}
}

// TestHostileSenderPushesDescriptor: a process that is the ticket's pid but
// speaks nonsense (a welcome with a descriptor attached, before any
// challenge): the receiver refuses it with EINVAL and closes the
// descriptor.
func TestHostileSenderPushesDescriptor(t *testing.T) {
	flushCache(t)
	addr := fmt.Sprintf("@vmmipc-test-pushfd-%d-%d", os.Getpid(), randIndex(1<<30))
	l := startHelper(t, partImpostor, helperOpts{env: []string{envAddr + "=" + addr, envListenMode + "=pushfd"}})
	l.expect("listening", faultTimeout)
	tk := ticketOf(t, l.pid(), addr)
	tk.Count, tk.Total = 1, 4096
	fdsBefore := ourFDs().settled(t)
	_, err := Import(tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: faultTimeout}}, nil)
	if CodeOf(err) != EINVAL || !strings.Contains(err.Error(), "descriptor") {
		t.Fatalf("got %v, want EINVAL about a descriptor", err)
	}
	ourFDs().waitFor(t, fdsBefore, "after the exporter that pushed a descriptor")
	expectNoMemfdMappings(t, "after the exporter that pushed a descriptor")
}

// TestHostileManyDescriptorsInOneMessage: a peer that attaches several
// descriptors to one message broke the protocol (EINVAL, not "out of
// descriptors"), and none of them stays open. Two still fit the control
// buffer; three overflow it (MSG_CTRUNC).
func TestHostileManyDescriptorsInOneMessage(t *testing.T) {
	for n := 2; n <= 5; n++ {
		t.Run(strconv.Itoa(n), func(t *testing.T) { testManyDescriptors(t, n) })
	}
}

func testManyDescriptors(t *testing.T, n int) {
	fdsBefore := ourFDs().settled(t)
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	file := newMemfd(t, 4096, pattern(4096, 1))
	msg := chunkMsg{Index: 0, Offset: 0, Size: 4096}.encode()
	if err := sendWithFDs(sp[1], msg, []fdAttach{{0, n}}, file); err != nil {
		t.Fatal(err)
	}
	unix.Close(file)
	c := socketConn(t, sp[0], "receiver")
	f, err := c.recv()
	c.Close()
	if CodeOf(err) != EINVAL || f.FD >= 0 {
		t.Fatalf("%d descriptors with one message: got %v (fd %d), want EINVAL", n, err, f.FD)
	}
	unix.Close(sp[1])
	ourFDs().waitFor(t, fdsBefore, "after a message with "+itoa(n)+" descriptors")
}
