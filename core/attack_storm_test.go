package core

import (
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Peers that come in numbers or say nothing: a thousand receivers at once,
// idle connections that never speak, and exporters that go silent in the
// handshake. The sender stays within its descriptor limit, a legitimate
// receiver is still served, and a receiver gives up after its timeout.

// raiseNoFile raises this process's soft RLIMIT_NOFILE to at least n (up
// to the hard limit), for the test's duration, or skips.
func raiseNoFile(t *testing.T, n uint64) {
	t.Helper()
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if lim.Cur < n {
		setSoftNoFile(t, n)
	}
}

// TestThousandReceiversAtOnce: 1024 receivers (goroutines here, each with
// its own connection) import the same unlimited registration at the same
// instant from a sender whose RLIMIT_NOFILE is 1024, so it serves C = 256
// at a time and holds at most 64 unauthenticated connections. Every
// receiver gets every byte; the sender never comes near its descriptor
// limit and gives everything back.
func TestThousandReceiversAtOnce(t *testing.T) {
	const receivers, chunks = 1024, 16
	raiseNoFile(t, 3*receivers)
	flushCache(t)
	receiversAtALimit(t, 1024, receivers, chunks, 12, func(base, _ int) int {
		limit := 1024 / 4
		return base + 2*(limit+pendingLimit(limit)) // a socket and a chunk in hand per connection
	})
}

// TestIdleConnectionsDoNotLockOut: 300 same-uid connections that never
// speak are held open to a sender at RLIMIT_NOFILE 1024 (C = 256, at most 64
// unauthenticated), each re-dialled as soon as the sender drops it, so the
// pressure never lets up. A legitimate receiver still imports within 1 s
// (only its import is timed), and no idle connection ever gets a
// descriptor.
func TestIdleConnectionsDoNotLockOut(t *testing.T) {
	const idle = 300
	raiseNoFile(t, 2*idle+64)
	flushCache(t)
	sender := startHelper(t, partSender, helperOpts{env: []string{envNoFile + "=1024"}})
	senderFDs := fdsOf(sender.pid())
	tk := sender.register(64, 4096, 1, -1, 13)
	base := senderFDs.settled(t)
	fdsBefore := ourFDs().settled(t)

	stop := make(chan struct{})
	var attackers sync.WaitGroup
	var mu sync.Mutex
	var dials, descriptors int
	var dialErr error
	for i := 0; i < idle; i++ {
		attackers.Add(1)
		go func() {
			defer attackers.Done()
			for {
				fd, err := rawDial(tk.Address)
				mu.Lock()
				dials++
				dialErr = cmpOr(dialErr, err)
				mu.Unlock()
				if err != nil {
					return
				}
				// Idle until the sender drops us (a "busy" message at
				// most), or the test ends.
				closed := make(chan struct{})
				go func() {
					defer close(closed)
					r := rawReadAll(fd, time.Minute)
					mu.Lock()
					descriptors += len(r.FDAt)
					mu.Unlock()
				}()
				select {
				case <-closed:
					unix.Close(fd)
				case <-stop:
					unix.Shutdown(fd, unix.SHUT_RDWR)
					<-closed
					unix.Close(fd)
					return
				}
			}
		}()
	}
	time.Sleep(300 * time.Millisecond) // the sender fills its unauthenticated bound
	start := time.Now()
	r, err := Import(tk, DeviceHost, ImportOptions{}, nil)
	took := time.Since(start)
	close(stop)
	attackers.Wait()
	if err != nil {
		t.Fatalf("a legitimate receiver among %d idle connections: %v", idle, err)
	}
	if err := verifyAndUnmap(r, 13); err != nil {
		t.Fatal(err)
	}
	if dialErr != nil {
		t.Fatalf("an idle connection could not even connect: %v", dialErr)
	}
	if descriptors != 0 {
		t.Fatalf("idle connections received %d descriptors", descriptors)
	}
	if took > time.Second {
		t.Fatalf("the legitimate receiver took %v among %d idle connections, want at most 1 s", took, idle)
	}
	senderFDs.waitFor(t, base-1, "the sender, after the idle connections and the only use")
	if live := sender.live(); live != 0 {
		t.Fatalf("the sender holds %d registrations after the only use", live)
	}
	ourFDs().waitFor(t, fdsBefore, "after the idle connections")
	t.Logf("imported in %v among %d idle connections (%d dials in all)", took, idle, dials)
}

// TestReceiverHandshakeTimesOut: exporters that go silent during the
// handshake (after the hello, or after a valid challenge) make the receiver
// give up after its timeout with EIO, holding nothing.
func TestReceiverHandshakeTimesOut(t *testing.T) {
	const timeout = 300 * time.Millisecond
	for _, tc := range []struct {
		name      string
		challenge bool
		want      string
	}{
		{"silent after the hello", false, "did not answer within"},
		{"silent after the challenge", true, "timed out"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fdsBefore := ourFDs().settled(t)
			released := make(chan struct{})
			fake := newFakeExporter(t, 1, 4096, func(uc *net.UnixConn, tk *Ticket) {
				c, _ := newConn(uc, 5*time.Second, "server")
				f, err := c.recv()
				if err == nil && tc.challenge {
					hello, _ := parseHello(f.Body)
					tr := serverTranscript(t, uc, tk, hello)
					tr.ServerNonce, _ = newNonce()
					_ = c.send(challengeMsg{Nonce: tr.ServerNonce, Proof: tr.proof(tk.Secret, roleServer)}.encode(), -1)
				}
				<-released
			})
			start := time.Now()
			_, err := Import(fake.tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: timeout}}, nil)
			took := time.Since(start)
			close(released)
			fake.close()
			if CodeOf(err) != EIO || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want EIO saying %q", err, tc.want)
			}
			if took < timeout || took > timeout+promptly {
				t.Fatalf("gave up after %v with a timeout of %v", took, timeout)
			}
			ourFDs().waitFor(t, fdsBefore, "after the silent exporter")
		})
	}
}
