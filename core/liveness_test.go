package core

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// zombie starts a child that exits at once and is reaped only when the
// test ends, and returns its pid once /proc shows it a zombie.
func zombie(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Wait() })
	pid := cmd.Process.Pid
	if !waitUntil(5*time.Second, func() bool {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		return strings.Contains(string(b), ") Z ")
	}) {
		t.Fatal("the child did not become a zombie")
	}
	return pid
}

// TestExporterAliveRereadsAfterItsWindow: a table hit trusts the exporter's
// last liveness check that passed less than aliveRecheck ago, and reads
// /proc again after it (vouchedUse.exporterAlive). The ticket's pid here
// is a zombie's: only a fresh check sees that it has exited.
func TestExporterAliveRereadsAfterItsWindow(t *testing.T) {
	pid := zombie(t)
	s := newTestServer(t)
	z := *registerCounting(t, s, 4096, 46, RegisterOptions{Uses: 1}).tk
	z.Pid = uint32(pid)
	u := vouchedUse{view: &tableView{}}
	u.view.aliveAt.Store(monotonicNanos())
	if err := u.exporterAlive(&z); err != nil {
		t.Fatalf("within %v of a check that passed: %v, want it trusted", aliveRecheck, err)
	}
	u.view.aliveAt.Store(monotonicNanos() - uint64(aliveRecheck) - 1)
	if err := u.exporterAlive(&z); CodeOf(err) != EIO {
		t.Fatalf("%v after a check that passed: %v, want EIO (read again: a zombie)", aliveRecheck, err)
	}
	if err := (vouchedUse{view: &tableView{}}).exporterAlive(&z); CodeOf(err) != EIO {
		t.Fatalf("with no check made yet: %v, want EIO", err)
	}
}

// TestZombieHasExited: a process that exited but is not reaped yet (a
// zombie) keeps its pid and start time in /proc; it counts as exited for a
// receiver checking its exporter (checkPidAlive: at once, where a forked
// child of the exporter may still hold its socket and a connection would
// wait out its timeout) and for an exporter checking a spend log's owner
// (ownerExited: its records are spent now, not once it is reaped).
func TestZombieHasExited(t *testing.T) {
	pid := zombie(t)
	if _, err := processStartTime(pid); !errors.Is(err, errZombie) || !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a zombie's start time: %v, want errZombie (an fs.ErrNotExist)", err)
	}
	s := newTestServer(t)
	z := *registerCounting(t, s, 4096, 45, RegisterOptions{Uses: 1}).tk
	z.Pid = uint32(pid)
	if err := checkPidAlive(&z); CodeOf(err) != EIO || !strings.Contains(err.Error(), "not reaped") {
		t.Fatalf("a zombie exporter: %v, want EIO saying it has exited", err)
	}
	if !ownerExited(&spendLog{pid: uint32(pid), start: z.StartTime}) {
		t.Fatal("a zombie receiver's spend log was taken as its live owner's")
	}
}
