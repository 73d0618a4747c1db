package core

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Fault and hostile-peer tests need real separate processes: the test binary
// re-executes itself running only TestHelperProcess, with helperRoleEnv
// naming the part to play. Helpers talk to the test over stdin/stdout, one
// line per message.

const helperRoleEnv = "VMMIPC_TEST_HELPER"

// Helper roles.
const (
	roleSender   = "sender"   // a server; registers on request ("register ...")
	roleReceiver = "receiver" // pulls a ticket's chunks, can stop and wait to be killed
	roleListener = "listener" // a plain socket on an address, not a vmmipc server
	roleOpener   = "opener"   // tries a ticket once and reports what it got
)

// faultMemfdName names the sender helper's memfds, so /proc/<pid>/maps shows
// whether any of them is still mapped.
const faultMemfdName = "vmmipc-fault-sender"

func TestHelperProcess(t *testing.T) {
	role := os.Getenv(helperRoleEnv)
	if role == "" {
		t.Skip("not a test: the process that fault and hostile-peer tests start as their peer")
	}
	out := &lineWriter{w: bufio.NewWriter(os.Stdout)}
	var err error
	switch role {
	case roleSender:
		err = helperSender(out)
	case roleReceiver:
		err = helperReceiver(out)
	case roleListener:
		err = helperListener(out)
	case roleOpener:
		err = helperOpener(out)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		out.printf("error %v", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// lineWriter prints whole lines from any goroutine and flushes each.
type lineWriter struct {
	mu sync.Mutex
	w  *bufio.Writer
}

func (l *lineWriter) printf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintf(l.w, format+"\n", args...)
	l.w.Flush()
}

// patternMemfd makes a named memfd of n bytes holding pattern(seed).
func patternMemfd(n int, seed byte) (int, error) {
	fd, err := unix.MemfdCreate(faultMemfdName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, err
	}
	if _, err := unix.Pwrite(fd, pattern(n, seed), 0); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// pattern is the content of test buffers: it differs per page and per seed,
// so a chunk mapped at the wrong place or from the wrong buffer shows.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i/4096) ^ byte(i) ^ seed
	}
	return b
}

// helperSender runs a server and obeys commands on stdin until it closes:
//
//	register <chunks> <chunk size> <uses> <block at> <seed>
//	    → "ticket <hex>"; the exporter announces "blocked <id> <index>"
//	      and blocks forever at chunk <block at> (-1: never)
//	live → "live <n>"
//	goroutines → "goroutines <n>"
func helperSender(out *lineWriter) error {
	s, err := NewServer("")
	if err != nil {
		return err
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		switch {
		case len(f) == 6 && f[0] == "register":
			var v [5]int64
			for i := range v {
				if v[i], err = strconv.ParseInt(f[i+1], 10, 64); err != nil {
					return err
				}
			}
			chunks, chunkSize, uses, blockAt, seed := v[0], v[1], v[2], v[3], byte(v[4])
			fd, err := patternMemfd(int(chunks*chunkSize), seed)
			if err != nil {
				return err
			}
			sizes, err := FileChunks(fd, uint64(chunks*chunkSize), uint64(chunkSize))
			if err != nil {
				return err
			}
			file := &FileExporter{FD: fd, ChunkSize: uint64(chunkSize)}
			var id uint64
			var idMu sync.Mutex
			exp := &FuncExporter{
				Export: func(i uint64) (int, uint64, error) {
					if int64(i) == blockAt {
						idMu.Lock()
						out.printf("blocked %d %d", id, i)
						idMu.Unlock()
						select {} // a stalled exporter
					}
					return file.ExportChunk(i)
				},
				OnRelease: func() { unix.Close(fd) },
			}
			idMu.Lock()
			tk, err := s.Register(sizes, exp, RegisterOptions{Uses: uint32(uses)})
			if err != nil {
				idMu.Unlock()
				return err
			}
			id = tk.RegID
			idMu.Unlock()
			b, _ := tk.Marshal()
			out.printf("ticket %s", hex.EncodeToString(b[:]))
		case len(f) == 1 && f[0] == "live":
			out.printf("live %d", s.Registry().Live())
		case len(f) == 1 && f[0] == "goroutines":
			out.printf("goroutines %d", runtime.NumGoroutine())
		default:
			return fmt.Errorf("bad command %q", in.Text())
		}
	}
	return nil
}

// helperReceiver opens VMMIPC_TEST_TICKET, pulls VMMIPC_TEST_STOP_AT chunks
// (closing each descriptor), says "at <n>" and waits to be killed; with a
// negative stop it pulls everything and says "ok".
func helperReceiver(out *lineWriter) error {
	tk, err := ticketFromEnv()
	if err != nil {
		return err
	}
	stopAt, _ := strconv.Atoi(os.Getenv("VMMIPC_TEST_STOP_AT"))
	s, err := Open(tk, OpenOptions{Timeout: 10 * time.Second})
	if err != nil {
		return err
	}
	for n := 0; ; n++ {
		if n == stopAt {
			out.printf("at %d", n)
			select {}
		}
		ch, err := s.Next()
		if IsEnd(err) {
			out.printf("ok")
			return nil
		}
		if err != nil {
			return err
		}
		unix.Close(ch.FD)
	}
}

// helperListener listens on VMMIPC_TEST_ADDR with a plain socket and, for
// each connection, per VMMIPC_TEST_LISTEN_MODE: "count" reads until the
// peer closes and says "read <n>"; "silent" says nothing and keeps the
// connection open; "pushfd" sends a welcome with a descriptor attached.
func helperListener(out *lineWriter) error {
	ln, err := net.Listen("unix", os.Getenv("VMMIPC_TEST_ADDR"))
	if err != nil {
		return err
	}
	out.printf("listening %d", os.Getpid())
	mode := os.Getenv("VMMIPC_TEST_LISTEN_MODE")
	var held []net.Conn
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		switch mode {
		case "count":
			go func() {
				n, _ := io.Copy(io.Discard, c)
				c.Close()
				out.printf("read %d", n)
			}()
		case "silent":
			held = append(held, c)
		case "pushfd":
			fd, err := patternMemfd(4096, 1)
			if err != nil {
				return err
			}
			raw, _ := c.(*net.UnixConn).SyscallConn()
			_ = raw.Write(func(s uintptr) bool {
				_, _ = unix.SendmsgN(int(s), welcomeMsg{Count: 1, Total: 4096, Kind: MemoryHost}.encode(), unix.UnixRights(fd), nil, unix.MSG_NOSIGNAL)
				return true
			})
			unix.Close(fd)
			held = append(held, c)
		}
	}
}

// helperOpener tries VMMIPC_TEST_TICKET twice: with Open, reporting
// "open code=<status>", and with a raw socket sending a valid hello,
// reporting "raw code=<status of the error message, 0 if none> fds=<n>".
func helperOpener(out *lineWriter) error {
	tk, err := ticketFromEnv()
	if err != nil {
		return err
	}
	s, err := Open(tk, OpenOptions{Timeout: 5 * time.Second})
	if err == nil {
		s.Close()
	}
	out.printf("open code=%d", CodeOf(err))
	fd, err := rawDial(tk.Address)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_ = rawWrite(fd, helloMsg{RegID: tk.RegID, Secret: tk.Secret}.encode())
	r := rawReadAll(fd, 5*time.Second)
	msgs, _ := splitMessages(r.Data)
	code := 0
	if m, ok := lastError(msgs); ok {
		code = int(m.Code)
	}
	out.printf("raw code=%d fds=%d", code, len(r.FDAt))
	return nil
}

func ticketFromEnv() (*Ticket, error) {
	b, err := hex.DecodeString(os.Getenv("VMMIPC_TEST_TICKET"))
	if err != nil {
		return nil, err
	}
	return DecodeTicket(b)
}

func ticketHex(t testing.TB, tk *Ticket) string {
	b, err := tk.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b[:])
}

// helper is a running helper process as the test sees it.
type helper struct {
	t     testing.TB
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
	done  chan struct{} // closed once the process was reaped
	mu    sync.Mutex
	err   error // its exit status
}

// startHelper starts the test binary (or bin, when not empty) as role.
func startHelper(t testing.TB, role string, env []string, cred *syscall.Credential, bin string) *helper {
	t.Helper()
	if bin == "" {
		bin = os.Args[0]
	}
	cmd := exec.Command(bin, "-test.run=^TestHelperProcess$", "-test.timeout=5m")
	cmd.Env = append(append(os.Environ(), helperRoleEnv+"="+role), env...)
	cmd.Stderr = os.Stderr
	if cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting the %s helper: %v", role, err)
	}
	h := &helper{t: t, cmd: cmd, stdin: stdin, lines: make(chan string, 1024), done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			h.lines <- sc.Text()
		}
		close(h.lines)
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

// expect waits for the next line that starts with prefix (skipping the test
// framework's own output) and returns the rest of it.
func (h *helper) expect(prefix string, timeout time.Duration) string {
	h.t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case l, ok := <-h.lines:
			if !ok {
				<-h.done
				h.t.Fatalf("helper %d exited (%v) before saying %q", h.pid(), h.err, prefix)
			}
			if strings.HasPrefix(l, "error ") {
				h.t.Fatalf("helper %d: %s", h.pid(), l)
			}
			if rest, ok := strings.CutPrefix(l, prefix); ok {
				return strings.TrimSpace(rest)
			}
		case <-deadline:
			h.t.Fatalf("helper %d did not say %q within %v", h.pid(), prefix, timeout)
		}
	}
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
}

// register asks a sender helper for a registration and returns its ticket.
func (h *helper) register(chunks, chunkSize, uses, blockAt int, seed byte) *Ticket {
	h.t.Helper()
	h.send(fmt.Sprintf("register %d %d %d %d %d", chunks, chunkSize, uses, blockAt, seed))
	b, err := hex.DecodeString(h.expect("ticket ", 10*time.Second))
	if err != nil {
		h.t.Fatal(err)
	}
	tk, err := DecodeTicket(b)
	if err != nil {
		h.t.Fatal(err)
	}
	return tk
}

// live asks a sender helper how many registrations it still holds.
func (h *helper) live() int {
	h.t.Helper()
	h.send("live")
	n, err := strconv.Atoi(h.expect("live ", 10*time.Second))
	if err != nil {
		h.t.Fatal(err)
	}
	return n
}

// goroutines asks a sender helper how many goroutines it runs, waiting up
// to 3 s for the count to drop to at most want.
func (h *helper) goroutines(want int) int {
	h.t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for {
		h.send("goroutines")
		n, err := strconv.Atoi(h.expect("goroutines ", 10*time.Second))
		if err != nil {
			h.t.Fatal(err)
		}
		if n <= want || time.Now().After(deadline) {
			return n
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// procFDs counts the open descriptors of process pid.
// samplePeakFDs samples pid's descriptor count every 200 µs until the
// returned function is called, which returns the highest count seen.
func samplePeakFDs(pid int) (stop func() int) {
	done := make(chan struct{})
	peak := make(chan int)
	go func() {
		most := 0
		for {
			if n, err := countProcFDs(pid); err == nil { // no t.Fatal off the test goroutine
				most = max(most, n)
			}
			select {
			case <-done:
				peak <- most
				return
			case <-time.After(200 * time.Microsecond):
			}
		}
	}()
	return func() int {
		close(done)
		return <-peak
	}
}

func procFDs(t testing.TB, pid int) int {
	t.Helper()
	n, err := countProcFDs(pid)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func countProcFDs(pid int) (int, error) {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	return len(ents), err
}

// waitProcFDs waits up to 3 s for process pid to hold at most want
// descriptors and returns the last count.
func waitProcFDs(t testing.TB, pid, want int) int {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	n := procFDs(t, pid)
	for n > want && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
		n = procFDs(t, pid)
	}
	return n
}

// recordingImporter is a HostImporter that remembers its reserved range and
// can act when a chunk arrives (to kill a peer at a chosen chunk).
type recordingImporter struct {
	HostImporter
	base, size uint64
	onMap      func(index uint64)
}

func (r *recordingImporter) Reserve(total uint64) (uint64, error) {
	base, err := r.HostImporter.Reserve(total)
	r.base, r.size = base, roundUp(total, pageSize)
	return base, err
}

func (r *recordingImporter) Map(c Chunk) error {
	if r.onMap != nil {
		r.onMap(c.Index)
	}
	return r.HostImporter.Map(c)
}

// checkRangeUnmapped fails if /proc/self/maps still shows anything in
// [base, base+size) or any mapping of the fault helpers' memfds.
func checkRangeUnmapped(t testing.TB, base, size uint64) {
	t.Helper()
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(maps), "\n") {
		if line == "" {
			continue
		}
		if strings.Contains(line, faultMemfdName) {
			t.Fatalf("a sender's memfd is still mapped: %s", line)
		}
		var lo, hi uint64
		if _, err := fmt.Sscanf(line, "%x-%x", &lo, &hi); err != nil {
			continue
		}
		if size > 0 && lo < base+size && base < hi {
			t.Fatalf("[%#x, %#x) still has a mapping after the failed import: %s", base, base+size, line)
		}
	}
}

// verifyMapping checks a finished import byte for byte against pattern(seed).
func verifyMapping(m *Mapping, seed byte) error {
	want := pattern(int(m.Size), seed)
	if got := bytesAt(m.Base, m.Size); !bytes.Equal(got, want) {
		for i := range want {
			if got[i] != want[i] {
				return fmt.Errorf("byte %d (chunk %d) is %#x, want %#x", i, i/4096, got[i], want[i])
			}
		}
	}
	return nil
}

// trials returns n, or short under -short.
func trials(n, short int) int {
	if testing.Short() {
		return short
	}
	return n
}

// randIndex picks a chunk index in [0, n).
func randIndex(n int) int { return rand.IntN(n) }
