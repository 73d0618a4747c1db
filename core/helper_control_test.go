package core

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The test's side of a helper process: starting it, reading its lines,
// sending it commands, and killing and reaping it. The questions a part
// answers live in that part's file.

// helperOpts are how a helper is started.
type helperOpts struct {
	env  []string
	cred *syscall.Credential // run as this user
	bin  string              // this binary instead of the test binary
	wrap []string            // a command that runs the binary (unshare ...)
}

// helper is a running helper process as the test sees it.
type helper struct {
	t     testing.TB
	cmd   *exec.Cmd
	stdin *os.File
	lines chan string   // closed once every writer of its stdout is gone
	inNS  bool          // started by a wrapper (another PID namespace): its pids mean nothing here
	done  chan struct{} // closed once the process was reaped
	mu    sync.Mutex
	err   error // its exit status
}

// exited reports whether the helper's process has been reaped.
func (h *helper) exited() bool {
	select {
	case <-h.done:
		return true
	default:
		return false
	}
}

// startHelper starts the test binary playing part. Its stdin and stdout are
// plain pipes, so that a child it hands them to (fork-listener) can use them
// after it exited, and it is reaped as soon as it exits.
func startHelper(t testing.TB, part string, o helperOpts) *helper {
	t.Helper()
	bin := o.bin
	if bin == "" {
		var err error
		if bin, err = os.Executable(); err != nil {
			t.Fatal(err)
		}
	}
	args := append(append([]string(nil), o.wrap...), bin, "-test.run=^TestHelperProcess$", "-test.timeout=5m")
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(append(os.Environ(), helperPartEnv+"="+part), o.env...)
	cmd.Stderr = os.Stderr
	if o.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: o.cred}
	}
	inR, inW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdin, cmd.Stdout = inR, outW
	err = cmd.Start()
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		t.Fatalf("starting the %s helper: %v", part, err)
	}
	h := &helper{t: t, cmd: cmd, stdin: inW, lines: make(chan string, 1024), done: make(chan struct{}), inNS: len(o.wrap) > 0}
	go func() {
		sc := bufio.NewScanner(outR)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			h.lines <- sc.Text()
		}
		outR.Close()
		// No process is left that could answer (the helper, or a child it
		// handed its stdout and stdin to): stop talking to it, so that a
		// helper that has finished holds no descriptor here.
		h.stdin.Close()
		close(h.lines)
	}()
	go func() {
		err := cmd.Wait()
		h.mu.Lock()
		h.err = err
		h.mu.Unlock()
		close(h.done)
	}()
	t.Cleanup(h.kill)
	return h
}

func (h *helper) pid() int { return h.cmd.Process.Pid }

func (h *helper) exitErr() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

// expect waits for the next line that starts with prefix (skipping the test
// framework's own output) and returns the rest of it.
func (h *helper) expect(prefix string, timeout time.Duration) string {
	h.t.Helper()
	deadline := time.After(timeout)
	for {
		if rest, ok := strings.CutPrefix(h.nextLine(deadline, timeout, fmt.Sprintf("%q", prefix)), prefix); ok {
			return strings.TrimSpace(rest)
		}
	}
}

// expectAll waits for lines starting with each of prefixes, in any order,
// and puts the rest of each into got as it comes (so that a cleanup can use
// what came before a failure).
func (h *helper) expectAll(timeout time.Duration, got map[string]string, prefixes ...string) {
	h.t.Helper()
	deadline := time.After(timeout)
	missing := map[string]bool{}
	for _, p := range prefixes {
		missing[p] = true
	}
	for len(missing) > 0 {
		l := h.nextLine(deadline, timeout, fmt.Sprint(missing))
		for p := range missing {
			if rest, ok := strings.CutPrefix(l, p); ok {
				delete(missing, p)
				got[p] = strings.TrimSpace(rest)
			}
		}
	}
}

// nextLine returns the helper's next line. It fails the test if the helper
// reported an error, or if its output ended or deadline (timeout after the
// wait began) passed before it said awaited.
func (h *helper) nextLine(deadline <-chan time.Time, timeout time.Duration, awaited string) string {
	h.t.Helper()
	select {
	case l, ok := <-h.lines:
		if !ok {
			h.t.Fatalf("helper %d: its output ended (exit: %v) before it said %s", h.pid(), h.exitErr(), awaited)
		}
		if strings.HasPrefix(l, "error ") {
			h.t.Fatalf("helper %d: %s", h.pid(), l)
		}
		return l
	case <-deadline:
		h.t.Fatalf("helper %d did not say %s within %v", h.pid(), awaited, timeout)
	}
	return "" // not reached: Fatalf ends the test's goroutine
}

func (h *helper) send(line string) {
	h.t.Helper()
	if _, err := io.WriteString(h.stdin, line+"\n"); err != nil {
		h.t.Fatalf("writing to helper %d: %v", h.pid(), err)
	}
}

// kill SIGKILLs the helper and reaps it.
func (h *helper) kill() {
	_ = h.cmd.Process.Signal(syscall.SIGKILL)
	<-h.done
	timeout := time.After(10 * time.Second)
	for { // until its output ends, which closes stdin
		select {
		case _, ok := <-h.lines:
			if !ok {
				return
			}
		case <-timeout:
			h.t.Errorf("helper %d was killed 10 s ago, but its stdout is still open (a child of it holds it?)", h.pid())
			return
		}
	}
}
