package core

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// The attacks of attack_*_test.go, and those a shared socket directory
// allows, with exporter, receiver and attacker each in a container of its
// own (namespace_test.go), all of our uid, sharing only the directory. Each
// asserts that the receiver fails at once with the cause, that the
// attacker learns nothing it could use (no proof, no secret, no
// descriptor), and that nothing leaks in the receiver (importIn checks its
// descriptors and mappings) or the exporter.

// exporterIn starts a sender in a container of lab and registers one use
// of a buffer of pattern(seed).
func exporterIn(t *testing.T, lab *nsLab, o containerOpts, seed byte) (*helper, *Ticket) {
	t.Helper()
	sender, _ := startSender(t, lab.container(o), lab.shared)
	return sender, sender.register(4, 4096, 1, -1, seed)
}

// attackerIn starts an impostor in a container of lab at addr, answering
// in mode, taking the address as take says (impostorListen). It returns
// the impostor and its pid in its container.
func attackerIn(t *testing.T, lab *nsLab, addr, mode, take string) (*helper, string) {
	t.Helper()
	imp := startHelper(t, partImpostor, helperOpts{wrap: lab.container(containerOpts{}), env: []string{envAddr + "=" + addr, envListenMode + "=" + mode, envTake + "=" + take}})
	return imp, imp.expect("listening ", faultTimeout)
}

// receiver is where the receivers of these tests run.
func receiver(lab *nsLab) []string { return lab.container(containerOpts{}) }

// TestCrashedExporterAcrossContainers: an exporter killed outright leaves
// its socket and lock in the directory. A receiver is told at once that it
// has exited (nothing holds its lock). The next exporter to start there
// removes what dead exporters of our uid left (with a lock, or without one
// and nothing listening), and nothing else: a live exporter's files and a
// socket of another uid stay.
func TestCrashedExporterAcrossContainers(t *testing.T) {
	lab := newNSLab(t)
	sender, tk := exporterIn(t, lab, containerOpts{}, 40)
	sender.kill()
	lab.expectFiles(t, "after the exporter was killed", exporterFiles(tk.Address)...)
	importIn(t, receiver(lab), tk, 40).refused(t, "has exited: nothing holds its lock", EIO)

	live, liveAddr := startSender(t, nil, lab.shared)
	plantSocket(t, filepath.Join(lab.shared, "vmmipc-1-1-0000000000000000.sock"), -1) // no lock, nothing listening
	foreign := plantSocket(t, filepath.Join(lab.shared, "vmmipc-1-2-0000000000000000.sock"), 65534)
	next, nextAddr := startSender(t, lab.container(containerOpts{}), lab.shared)
	want := append(append(exporterFiles(liveAddr), exporterFiles(nextAddr)...), filepath.Base(foreign))
	lab.expectFiles(t, "after the next exporter started", want...)
	for i, h := range []*helper{live, next} {
		tk := h.register(4, 4096, 1, -1, byte(41+i))
		importIn(t, receiver(lab), tk, byte(41+i)).ok(t)
	}
}

// plantSocket leaves a socket file at path that nothing listens on, owned
// by uid (-1: ours), as a dead process of that uid would.
func plantSocket(t *testing.T, path string, uid int) string {
	t.Helper()
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	if uid >= 0 {
		if err := os.Lchown(path, uid, uid); err != nil {
			t.Skipf("cannot give %s to uid %d (%v): the test of another uid's socket needs root", path, uid, err)
		}
	}
	return path
}

// TestImpostorAcrossContainers: processes of our uid in another container
// take a dead exporter's address: after it crashed (the receiver is told
// at once that it exited: its lock is free, and connects to nothing), or
// with its lock taken too and the exporter's pid number (the same in its
// own container as the exporter's in its: the receiver connects, and
// refuses the impostor's proof at once).
func TestImpostorAcrossContainers(t *testing.T) {
	for _, tc := range []struct {
		name, take, want string
		code             Code
		conns            int
	}{
		{"after a crash", "", "has exited", EIO, 0},
		{"same pid, lock taken", "lock", "could not prove", EAUTH, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lab := newNSLab(t)
			sender, tk := exporterIn(t, lab, containerOpts{}, 42)
			sender.kill()
			imp, pid := attackerIn(t, lab, tk.Address, "fakeproof", tc.take)
			if pid != strconv.Itoa(int(tk.Pid)) {
				t.Fatalf("the exporter was pid %d in its container, the impostor is pid %s in its own; want the same", tk.Pid, pid)
			}
			importIn(t, receiver(lab), tk, 42).refused(t, tc.want, tc.code)
			impostorLearnedNothing(t, imp, tk, tc.conns)
		})
	}
}

// TestExecAcrossContainers: the exporter execs an impostor (same pid, same
// start time) that takes the address it left. Its lock went with the exec,
// so a receiver in another container is told at once that it exited, and
// never connects.
func TestExecAcrossContainers(t *testing.T) {
	lab := newNSLab(t)
	sender, tk := exporterIn(t, lab, containerOpts{}, 43)
	sender.send("exec impostor fakeproof")
	if pid := sender.expect("listening ", faultTimeout); pid != strconv.Itoa(int(tk.Pid)) {
		t.Fatalf("the exec'd impostor is pid %s, the ticket's %d", pid, tk.Pid)
	}
	importIn(t, receiver(lab), tk, 43).refused(t, "has exited", EIO)
	impostorLearnedNothing(t, sender, tk, 0)
}

// TestForkedListenerAcrossContainers: a child of the exporter holds its
// listening socket and answers in its place. While the exporter lives
// (holding its lock), only the proof stops the receiver (EAUTH); once it
// has exited, its lock is free and the receiver is told at once, though the
// child keeps the socket alive and would never answer.
func TestForkedListenerAcrossContainers(t *testing.T) {
	for _, tc := range forkListenerCases {
		t.Run(tc.then, func(t *testing.T) {
			lab := newNSLab(t)
			sender, tk := exporterIn(t, lab, containerOpts{keep: true}, 44)
			lock, _ := lockPathFor(tk.Address)
			sender.forkListener(tc.mode, tc.then, func() bool { s, _ := probeLock(lock); return s == lockFree })
			importIn(t, receiver(lab), tk, 44).refused(t, tc.want, tc.code)
			impostorLearnedNothing(t, sender, tk, tc.conns)
		})
	}
}

// TestSwappedSocketAcrossContainers: a process of our uid in a third
// container renames the live exporter's socket and puts its own in its
// place: answering with a proof it made up, or relaying every byte and
// descriptor to the exporter's renamed socket. The receiver refuses either
// at once (EAUTH: the relay's proofs are bound to the exporter's socket of
// the relay's own connection), nothing but a hello reaches the attacker,
// no descriptor crosses, the use is not spent: with the socket put back,
// the receiver imports.
func TestSwappedSocketAcrossContainers(t *testing.T) {
	for _, mode := range []string{"fakeproof", "relay"} {
		t.Run(mode, func(t *testing.T) {
			lab := newNSLab(t)
			sender, _ := startSender(t, lab.container(containerOpts{}), lab.shared)
			base := sender.fds()
			tk := sender.register(4, 4096, 1, -1, 45)
			imp, _ := attackerIn(t, lab, tk.Address, mode, "swap")
			importIn(t, receiver(lab), tk, 45).refused(t, "could not prove", EAUTH)
			impostorLearnedNothing(t, imp, tk, 1)
			if mode == "relay" {
				imp.send("relayed")
				if n := imp.expect("relayed ", faultTimeout); n != "0" {
					t.Fatalf("%s descriptors crossed the relay", n)
				}
			}
			if n := sender.live(); n != 1 {
				t.Fatalf("%d registrations live after the attack, want the one, not spent", n)
			}
			imp.send("restore")
			imp.expect("restored", faultTimeout)
			importIn(t, receiver(lab), tk, 45).ok(t)
			sender.expectDone(base)
		})
	}
}
