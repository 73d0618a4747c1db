package core

import (
	"testing"

	"golang.org/x/sys/unix"
)

// A receiver that cannot use sock_diag (no unix_diag in the kernel, or a
// seccomp profile that refuses netlink) binds the handshake to its own pid
// instead (sockends.go). The importer helpers here act as if sock_diag were
// refused (VMMIPC_TEST_NO_SOCK_DIAG).

var noSockDiag = []string{envNoSockDiag + "=1"}

// TestWithoutSockDiag: in the exporter's PID namespace such a receiver
// imports (also through the import cache); a relay there is refused
// (EAUTH: the exporter sees the relay's pid); across PID namespaces the
// receiver is refused at once, saying what it lacks.
func TestWithoutSockDiag(t *testing.T) {
	t.Run("same PID namespace", func(t *testing.T) {
		sender, _ := startSender(t, nil, "")
		base := sender.fds()
		tk := sender.register(16, 4096, 2, -1, 60)
		r := importTimesIn(t, nil, tk, 60, 2, noSockDiag...)
		if r.ok(t); r.hits != 1 {
			t.Fatalf("%d import-cache hits for the second import, want 1", r.hits)
		}
		sender.expectDone(base)
	})
	t.Run("relay", func(t *testing.T) {
		s := newTestServer(t)
		proxy := proxyInFront(t, s)
		fd := newMemfd(t, 4*int(pageSize), pattern(4*int(pageSize), 61))
		tk := registerFile(t, s, fd, 4*pageSize, pageSize, RegisterOptions{Uses: 1})
		closeFD(&fd)
		importTimesIn(t, nil, tk, 61, 1, noSockDiag...).refused(t, "could not prove", EAUTH)
		if n := proxy.descriptors(); n != 0 {
			t.Fatalf("%d descriptors crossed the relay", n)
		}
		if n := s.Live(); n != 1 {
			t.Fatalf("%d live registrations after the relay, want the one, its use not spent", n)
		}
	})
	t.Run("across PID namespaces", func(t *testing.T) {
		lab := newNSLab(t)
		sender, _ := startSender(t, nil, lab.shared)
		tk := sender.register(4, 4096, 1, -1, 62)
		importTimesIn(t, lab.pidOnly(), tk, 62, 1, noSockDiag...).refused(t, "cannot ask the kernel which socket is its peer", EIO)
	})
}

// TestSockDiagOutOfDescriptorsIsNotKept: a probe that fails for lack of
// descriptors says nothing about the kernel: the receiver gets ENFILE, and
// the next call asks again (a kept failure would refuse every receiver
// across PID namespaces for the rest of the process's life).
func TestSockDiagOutOfDescriptorsIsNotKept(t *testing.T) {
	sockDiagProbe.mu.Lock()
	probed, kept := sockDiagProbe.probed, sockDiagProbe.err
	sockDiagProbe.probed = false
	sockDiagProbe.mu.Unlock()
	real, calls := probeSockDiag, 0
	probeSockDiag = func() error {
		if calls++; calls == 1 {
			return unix.EMFILE
		}
		return nil
	}
	defer func() {
		probeSockDiag = real
		sockDiagProbe.mu.Lock()
		sockDiagProbe.probed, sockDiagProbe.err = probed, kept
		sockDiagProbe.mu.Unlock()
	}()
	if err := sockDiagWorks(); CodeOf(err) != ENFILE {
		t.Fatalf("out of descriptors: %v (%v), want ENFILE", err, CodeOf(err))
	}
	for range 2 {
		if err := sockDiagWorks(); err != nil {
			t.Fatal(err)
		}
	}
	if calls != 2 {
		t.Fatalf("probed %d times, want 2: again after ENFILE, then the answer kept", calls)
	}
}
