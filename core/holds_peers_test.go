package core

import (
	"bytes"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Holds against other processes (issue 31): a receiver killed, a receiver
// that forks, an exporter stopped or gone with a child alive, a peer that
// asks for leases in a loop.

// (h *helper) holds asks a sender helper how many uses its receivers hold.
func (h *helper) holds() int { h.t.Helper(); return h.ask("holds") }

// waitHolds waits until the sender's receivers hold want uses and returns
// how long that took.
func waitHolds(t *testing.T, sender *helper, want int, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		if n := sender.holds(); n == want {
			return time.Since(start)
		} else if time.Since(start) > within {
			t.Fatalf("the sender's receivers hold %d uses after %v, want %d", n, within, want)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestForkedReceiverChildCannotEndItsParentsHolds: a receiver that holds
// forks a child that shuts down every socket it inherited and exits; the
// parent's hold lives on (at 860d711 the child's shutdown of the inherited
// holder session ended it within 0.5 s). Then the parent is SIGKILLed:
// its hold is let go within the exporter's poll (~20 ms; 100 ms allowed).
func TestForkedReceiverChildCannotEndItsParentsHolds(t *testing.T) {
	sender := startHelper(t, partSender, helperOpts{})
	sender.send("register 4 4096 0 -1 5 hold")
	hexTk := sender.expect("ticket ", 10*time.Second)
	r := startHelper(t, partHoldFork, helperOpts{env: []string{envTicket + "=" + hexTk}})
	r.expect("forked ", faultTimeout)
	time.Sleep(500 * time.Millisecond)
	if n := sender.holds(); n != 1 {
		t.Fatalf("after the receiver's child shut its sockets down and exited, the sender's receivers hold %d uses, want the parent's 1", n)
	}
	killed := time.Now()
	r.kill()
	took := waitHolds(t, sender, 0, 5*time.Second)
	if took > 100*time.Millisecond {
		t.Fatalf("a SIGKILLed receiver's hold was let go %v after the kill, want within 100 ms", took)
	}
	t.Logf("a SIGKILLed receiver's hold let go %v after the kill", time.Since(killed))
}

// helperHoldFork holds a use of VMMIPC_TEST_TICKET, forks a child that
// shuts down (both ways) and closes every descriptor it inherited and
// exits, waits for it, says "forked <pid>" and waits to be killed. The
// child runs raw system calls only (the Go runtime does not survive fork).
func helperHoldFork(out *lineWriter) error {
	tk, err := ticketFromEnv()
	if err != nil {
		return err
	}
	if err := Confirm(tk, ImportOptions{Hold: true}); err != nil {
		return err
	}
	syscall.ForkLock.Lock()
	pid, _, errno := syscall.RawSyscall(syscall.SYS_FORK, 0, 0, 0)
	if errno == 0 && pid == 0 {
		for fd := uintptr(3); fd < 4096; fd++ {
			syscall.RawSyscall(syscall.SYS_SHUTDOWN, fd, syscall.SHUT_RDWR, 0)
			syscall.RawSyscall(syscall.SYS_CLOSE, fd, 0, 0)
		}
		syscall.RawSyscall(syscall.SYS_EXIT_GROUP, 0, 0, 0)
	}
	syscall.ForkLock.Unlock()
	if errno != 0 {
		return errno
	}
	var ws unix.WaitStatus
	if _, err := unix.Wait4(int(pid), &ws, 0, nil); err != nil {
		return err
	}
	out.printf("forked %d", pid)
	select {}
}

// TestStoppedExporterKeepsHeldCallsDeadlines: with the exporter stopped
// (SIGSTOP), held imports (hits) and confirmations return by their
// timeout (at 860d711 a held hit returned OK at once, before any answer,
// and after ~280 of them blocked until SIGCONT), a release returns at
// once, and another exporter's held imports are not held up meanwhile.
// Once the exporter runs again the release arrives.
func TestStoppedExporterKeepsHeldCallsDeadlines(t *testing.T) {
	cacheTest(t)
	sender := startHelper(t, partSender, helperOpts{})
	sender.send("register 4 4096 0 -1 6 hold")
	tk := decodeTicketHex(t, sender.expect("ticket ", 10*time.Second))
	other := newTestServer(t)
	otherTk := registerCounting(t, other, cacheSize, 8, RegisterOptions{Uses: 0, Hold: true}).tk

	r := importHost(t, tk, holdImport) // a miss: mapped and held
	defer Unmap(r.ID, r.Base)
	if err := unix.Kill(sender.pid(), unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer unix.Kill(sender.pid(), unix.SIGCONT)
	if !waitUntil(5*time.Second, func() bool { return stoppedProcess(sender.pid()) }) {
		t.Fatal("the sender did not stop")
	}
	const timeout = 300 * time.Millisecond
	opts := ImportOptions{Hold: true, OpenOptions: OpenOptions{Timeout: timeout}}
	otherDone := make(chan error, 1)
	go func() { // another exporter's held uses while the calls below wait
		for range 20 {
			if err := Confirm(otherTk, holdImport); err != nil {
				otherDone <- err
				return
			}
		}
		otherDone <- nil
	}()
	for i := range 400 {
		start := time.Now()
		ref, err := Import(tk, DeviceHost, opts, nil)
		if err == nil {
			Unmap(ref.ID, ref.Base)
			t.Fatalf("held hit %d on a stopped exporter returned OK: nothing granted it", i)
		}
		if took := time.Since(start); took > timeout+time.Second {
			t.Fatalf("held hit %d on a stopped exporter returned after %v, timeout %v: %v", i, took, timeout, err)
		}
		if i == 2 {
			break // each waits its whole timeout: a few show it
		}
	}
	start := time.Now()
	if err := Confirm(tk, opts); err == nil || time.Since(start) > timeout+time.Second {
		t.Fatalf("a held confirmation on a stopped exporter: %v after %v", err, time.Since(start))
	}
	select {
	case err := <-otherDone:
		if err != nil {
			t.Fatalf("another exporter's held uses: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("another exporter's held uses were held up by the stopped one")
	}
	start = time.Now()
	if err := Release(tk); err != nil || time.Since(start) > 100*time.Millisecond {
		t.Fatalf("release to a stopped exporter: %v after %v", err, time.Since(start))
	}
	for range 20 {
		if err := Release(otherTk); err != nil {
			t.Fatal(err)
		}
	}
	unix.Kill(sender.pid(), unix.SIGCONT)
	waitHolds(t, sender, 0, 10*time.Second)
}

// stoppedProcess reports whether process pid is stopped (its state in
// /proc/<pid>/stat is T): a SIGSTOP has taken effect.
func stoppedProcess(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i > 0 && i+2 < len(b) && (b[i+2] == 'T' || b[i+2] == 't')
}

// TestHeldCallsToAnExporterThatForkedAndDied: the exporter forks a child
// that keeps its listening socket (and lease file) and never answers, then
// exits. A receiver holding from it: its held import and confirmation
// return at once (the exporter's pid is gone) with its timeout far off,
// its release returns, and its lease is dropped.
func TestHeldCallsToAnExporterThatForkedAndDied(t *testing.T) {
	cacheTest(t)
	sender := startHelper(t, partSender, helperOpts{})
	sender.send("register 4 4096 0 -1 3 hold")
	tk := decodeTicketHex(t, sender.expect("ticket ", 10*time.Second))
	r := importHost(t, tk, holdImport)
	defer Unmap(r.ID, r.Base)
	sender.forkListener("silent", "exit", sender.exited)
	opts := ImportOptions{Hold: true, OpenOptions: OpenOptions{Timeout: 20 * time.Second}}
	start := time.Now()
	if ref, err := Import(tk, DeviceHost, opts, nil); err == nil || time.Since(start) > time.Second {
		if err == nil {
			Unmap(ref.ID, ref.Base)
		}
		t.Fatalf("a held import from an exporter that died: %v after %v", err, time.Since(start))
	}
	start = time.Now()
	if err := Confirm(tk, opts); err == nil || time.Since(start) > time.Second {
		t.Fatalf("a held confirmation to an exporter that died: %v after %v", err, time.Since(start))
	}
	if err := Release(tk); err != nil && CodeOf(err) != ENOENT {
		t.Fatalf("release: %v", err)
	}
	if !waitUntil(5*time.Second, func() bool { return leaseOf(tk) == nil }) {
		t.Fatal("the lease to an exporter that died was kept")
	}
}

// TestLeaseHogLocksNoReceiverOut: a process that asks one exporter for
// leases and opens sessions in a loop gets at most maxLeasesPerPid leases,
// refused beyond with a clear error, and honest receivers' held uses all
// succeed meanwhile.
func TestLeaseHogLocksNoReceiverOut(t *testing.T) {
	sender := startHelper(t, partSender, helperOpts{env: []string{envNoFile + "=64"}})
	sender.send("register 4 4096 0 -1 4 hold")
	hexTk := sender.expect("ticket ", 10*time.Second)
	tk := decodeTicketHex(t, hexTk)
	base := fdsOf(sender.pid()).settled(t)
	hog := startHelper(t, partLeaseHog, helperOpts{env: []string{envTicket + "=" + hexTk}})
	line := hog.expect("hog ", faultTimeout)
	var leasesGot int
	var code int
	if _, err := fmt.Sscanf(line, "leases=%d code=%d", &leasesGot, &code); err != nil {
		t.Fatalf("%q: %v", line, err)
	}
	if leasesGot != maxLeasesPerPid || Code(code) != EIO {
		t.Fatalf("the hog got %d leases then code %d, want %d then EIO", leasesGot, code, maxLeasesPerPid)
	}
	hog.expect("looping", faultTimeout) // it now opens leases and sessions without end
	for i := range 50 {
		if err := Confirm(tk, holdImport); err != nil {
			t.Fatalf("honest held use %d while the hog loops: %v", i, err)
		}
	}
	for range 50 {
		if err := Release(tk); err != nil {
			t.Fatal(err)
		}
	}
	waitHolds(t, sender, leasesGot, 10*time.Second) // the hog's own
	if n := fdsOf(sender.pid()).now(t); n > base+8 {
		t.Fatalf("the sender holds %d descriptors with the hog looping, %d before", n, base)
	}
	hog.kill()
	waitHolds(t, sender, 0, 5*time.Second)
}

// helperLeaseHog takes leases of its own at the exporter of
// VMMIPC_TEST_TICKET, each holding a use, until refused, says "hog
// leases=<n> code=<refusal status>", then asks again and opens
// unauthenticated sessions in a loop ("looping") until killed.
func helperLeaseHog(out *lineWriter) error {
	tk, err := ticketFromEnv()
	if err != nil {
		return err
	}
	var n int
	var ls []*clientLease
	for {
		l, err := holdWithNewLease(tk)
		if err != nil {
			out.printf("hog leases=%d code=%d %v", n, CodeOf(err), err)
			break
		}
		ls = append(ls, l)
		n++
		if n > 100 {
			return fmt.Errorf("100 leases, unbounded")
		}
	}
	out.printf("looping")
	for {
		_, _ = holdWithNewLease(tk)
		if fd, err := rawDial(tk.Address); err == nil {
			nr, _ := newNonce()
			_ = rawWrite(fd, helloMsg{RegID: tk.RegID, Nonce: nr}.encode())
			unix.Close(fd)
		}
		_ = os.Getpid()
	}
}
