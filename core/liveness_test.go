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

// TestZombieHasExited: a process that exited but is not reaped yet (a
// zombie) keeps its pid and start time in /proc; it counts as exited for a
// receiver checking its exporter (checkPidAlive: at once, where a forked
// child of the exporter may still hold its socket and a connection would
// wait out its timeout) and for an exporter checking a spend log's owner
// (ownerExited: its records are spent now, not once it is reaped).
func TestZombieHasExited(t *testing.T) {
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	pid := cmd.Process.Pid
	if !waitUntil(5*time.Second, func() bool {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		return strings.Contains(string(b), ") Z ")
	}) {
		t.Fatal("the child did not become a zombie")
	}
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
