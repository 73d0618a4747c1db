package core

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The huge-page attacks of issue 27 item 1, run for real: this test process
// is the hostile exporter, and a re-executed copy of the test binary
// (TestHugePageReceiverChild) the receiver, so that the receiver dying of
// them fails the test instead of ending it.

const envHugeReceiver = "VMMIPC_TEST_HUGE_RECEIVER"

// TestHugePageAttacksFromAnExporter: an exporter that sends a memfd of huge
// pages (its own export_fn: no registration checks it) can (a) have a chunk
// that is not a multiple of the huge page size mapped MAP_FIXED and rounded
// up past the receiver's reservation, over whatever lies there, or (b) punch
// a hole in a mapped huge page and take every free one, so that the
// receiver's next read is SIGBUS. Before, the receiver mapped such files
// and died (b: SIGBUS at "touch"; a: mapped or crashed); now it refuses them
// with EINVAL, maps nothing and lives.
func TestHugePageAttacksFromAnExporter(t *testing.T) {
	huge := freeHugePages(t, 4)
	for _, tc := range []struct {
		name  string
		chunk uint64
		punch bool
	}{
		{"a chunk not a multiple of the huge page size", 4096, false},
		{"a hole punched and the free huge pages taken", huge, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fd := hugeMemfd(t, int64(huge))
			if err := unix.Fallocate(fd, 0, 0, int64(huge)); err != nil { // its page exists
				t.Fatal(err)
			}
			tk := sendAnyway(t, newTestServer(t), fd, tc.chunk)
			rc := startHugeReceiver(t, tk)
			line := rc.line(t)
			if rest, ok := strings.CutPrefix(line, "refused "); ok {
				f := strings.SplitN(rest, " ", 3)
				if len(f) != 3 || f[0] != strconv.Itoa(int(EINVAL)) || f[1] != "0" || !strings.Contains(f[2], "hugetlbfs") {
					t.Errorf("the receiver said %q, want a refusal with code EINVAL (%d), no mapping left (0) and a message saying hugetlbfs", line, EINVAL)
				}
				if err := rc.wait(); err != nil {
					t.Errorf("the receiver, after refusing: %v", err)
				}
				t.Logf("the receiver said %s", line)
				return
			}
			// The receiver mapped it: what follows is the attack.
			if tc.punch {
				if err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, int64(huge)); err != nil {
					t.Fatal(err)
				}
				takeFreeHugePages(t, huge)
			}
			rc.send("touch")
			var said []string
			for l := rc.lineOrEnd(); l != ""; l = rc.lineOrEnd() {
				said = append(said, l)
			}
			t.Errorf("the receiver said %q and mapped the huge-page file; then it said %q and ended with %v", line, said, rc.wait())
		})
	}
}

// TestHugePageReceiverChild is not a test: it is the receiver process of
// TestHugePageAttacksFromAnExporter. It imports VMMIPC_TEST_TICKET and says
// "refused <code> <memfd mappings left> <message>", or "mapped"; then it
// waits for "touch" on stdin, reads every byte, says "touched", unmaps and
// says "unmapped <error> <memfd mappings left>".
func TestHugePageReceiverChild(t *testing.T) {
	if os.Getenv(envHugeReceiver) == "" {
		t.Skip("not a test: the receiver process of TestHugePageAttacksFromAnExporter")
	}
	tk, err := ticketFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	r, err := Import(tk, DeviceHost, ImportOptions{NoCache: true}, nil)
	if err != nil {
		n, _ := memfdMappings(t)
		fmt.Printf("refused %d %d %v\n", CodeOf(err), n, err)
		os.Exit(0)
	}
	fmt.Println("mapped")
	bufio.NewReader(os.Stdin).ReadString('\n')
	var any byte
	for _, b := range bytesAt(r.Base, r.Size) {
		any |= b
	}
	fmt.Println("touched", any)
	err = Unmap(r.ID, r.Base)
	n, _ := memfdMappings(t)
	fmt.Println("unmapped", err, n)
	os.Exit(0)
}

// hugeReceiver is a running TestHugePageReceiverChild.
type hugeReceiver struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
}

func startHugeReceiver(t *testing.T, tk *Ticket) *hugeReceiver {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^TestHugePageReceiverChild$", "-test.timeout=2m")
	cmd.Env = append(os.Environ(), envHugeReceiver+"=1", envTicket+"="+ticketHex(t, tk))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	rc := &hugeReceiver{cmd: cmd, stdin: stdin, lines: make(chan string, 16)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			rc.lines <- sc.Text()
		}
		close(rc.lines)
	}()
	t.Cleanup(func() {
		stdin.Close()
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return rc
}

// line is the receiver's next line; its output ending first fails the test.
func (rc *hugeReceiver) line(t *testing.T) string {
	t.Helper()
	if l := rc.lineOrEnd(); l != "" {
		return l
	}
	t.Fatalf("the receiver said nothing and ended with %v", rc.wait())
	return ""
}

// lineOrEnd is the receiver's next line, or "" once its output ended (or
// after 30 s of silence).
func (rc *hugeReceiver) lineOrEnd() string {
	select {
	case l, ok := <-rc.lines:
		if ok {
			return l
		}
	case <-time.After(30 * time.Second):
	}
	return ""
}

func (rc *hugeReceiver) send(line string) { _, _ = io.WriteString(rc.stdin, line+"\n") }

// wait ends the receiver's stdin and reaps it: nil for a clean exit, else
// how it ended (a signal: it died).
func (rc *hugeReceiver) wait() error {
	rc.stdin.Close()
	done := make(chan error, 1)
	go func() { done <- rc.cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		_ = rc.cmd.Process.Kill()
		return fmt.Errorf("still running 30 s later (killed): %v", <-done)
	}
}

// freeHugePages makes sure at least n huge pages are free and returns the
// huge page size. Where fewer are free it raises vm.nr_hugepages for the
// test (restoring the old value after it); where it cannot, it skips the
// test saying why.
func freeHugePages(t *testing.T, n int) uint64 {
	t.Helper()
	size := meminfo(t, "Hugepagesize") * 1024
	if size == 0 {
		t.Skip("no huge pages in this kernel (no Hugepagesize in /proc/meminfo)")
	}
	free := meminfo(t, "HugePages_Free")
	if free >= uint64(n) {
		return size
	}
	const sysctl = "/proc/sys/vm/nr_hugepages"
	old, err := os.ReadFile(sysctl)
	if err != nil {
		t.Skipf("huge pages: %d free, and %s cannot be read: %v", free, sysctl, err)
	}
	total, err := strconv.ParseUint(strings.TrimSpace(string(old)), 10, 64)
	if err != nil {
		t.Fatalf("%s: %q", sysctl, old)
	}
	want := total + uint64(n) - free
	if err := os.WriteFile(sysctl, []byte(strconv.FormatUint(want, 10)), 0); err != nil {
		t.Skipf("huge pages: %d free, and setting %s to %d failed (it needs root): %v", free, sysctl, want, err)
	}
	t.Cleanup(func() { // last: after the test closed its huge-page files
		if err := os.WriteFile(sysctl, old, 0); err != nil {
			t.Errorf("restoring %s to %s: %v", sysctl, strings.TrimSpace(string(old)), err)
		}
	})
	if free = meminfo(t, "HugePages_Free"); free < uint64(n) {
		t.Skipf("huge pages: %s set to %d, but only %d are free (memory too fragmented?)", sysctl, want, free)
	}
	return size
}

// takeFreeHugePages allocates every free huge page into a file of its own,
// held until the test ends: what a hostile exporter does so that a
// receiver's fault in a punched hole finds none.
func takeFreeHugePages(t *testing.T, size uint64) {
	t.Helper()
	free := meminfo(t, "HugePages_Free")
	if free == 0 {
		return
	}
	fd, err := unix.MemfdCreate("vmmipc-test-hog", unix.MFD_CLOEXEC|unix.MFD_HUGETLB)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Fallocate(fd, 0, 0, int64(free*size)); err != nil {
		t.Fatalf("taking the %d free huge pages: %v", free, err)
	}
}

// meminfo is a field of /proc/meminfo (its number: kB, or a count).
func meminfo(t *testing.T, field string) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, field+":"); ok {
			f := strings.Fields(rest)
			if len(f) == 0 {
				break
			}
			n, err := strconv.ParseUint(f[0], 10, 64)
			if err != nil {
				t.Fatalf("/proc/meminfo: %q", l)
			}
			return n
		}
	}
	return 0
}
