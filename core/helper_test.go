package core

import (
	"bufio"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Fault, hostile-peer and attack tests need real separate processes: the
// test binary re-executes itself running only TestHelperProcess, with
// helperPartEnv naming the part to play. Helpers talk to the test over
// stdin/stdout, one line per message.

const helperPartEnv = "VMMIPC_TEST_HELPER"

// Helper parts (the roles they play).
const (
	partSender      = "sender"      // a server; registers on request ("register ...")
	partReceiver    = "receiver"    // pulls a ticket's chunks, can stop and wait to be killed
	partImpostor    = "impostor"    // a plain socket at an address, not a vmmipc server
	partOpener      = "opener"      // tries a ticket once and reports what it got
	partCacheEnv    = "cacheenv"    // imports with VMMIPC_CACHE_BYTES as the test set it
	partAddrSpace   = "addrspace"   // imports under a tight RLIMIT_AS
	partPidNS       = "pidns"       // runs the pid-reuse attack inside a new pid namespace
	partRelayRecord = "relayrecord" // imports through a recording proxy (TestSecretNeverCrossesTheSocket)
	partImporter    = "importer"    // imports a ticket once, verifies it, reports leaks
)

// Environment of the helpers.
const (
	envTicket     = "VMMIPC_TEST_TICKET"       // hex ticket for receivers and openers
	envStopAt     = "VMMIPC_TEST_STOP_AT"      // receiver: chunks to pull before waiting to be killed
	envAddr       = "VMMIPC_TEST_ADDR"         // impostor: the address to bind
	envListenFD   = "VMMIPC_TEST_LISTEN_FD"    // impostor: an inherited listening descriptor instead
	envListenMode = "VMMIPC_TEST_LISTEN_MODE"  // impostor: how to answer (see helperImpostor)
	envReplay     = "VMMIPC_TEST_REPLAY"       // impostor "replay": the hex message to answer with
	envNoFile     = "VMMIPC_TEST_NOFILE"       // sender: its soft RLIMIT_NOFILE
	envSeed       = "VMMIPC_TEST_SEED"         // importer: the pattern the bytes must follow
	envImports    = "VMMIPC_TEST_IMPORTS"      // importer: how many times to import
	envTake       = "VMMIPC_TEST_TAKE"         // impostor at a socket path: "swap", "lock" (see impostorListen)
	envNoSockDiag = "VMMIPC_TEST_NO_SOCK_DIAG" // any part: act as if sock_diag were refused (nodiag_test.go)
)

func TestHelperProcess(t *testing.T) {
	part := os.Getenv(helperPartEnv)
	if part == "" {
		t.Skip("not a test: the process that fault, hostile-peer and attack tests start as their peer")
	}
	out := &lineWriter{w: bufio.NewWriter(os.Stdout)}
	if os.Getenv(envNoSockDiag) != "" { // before any goroutine of the library runs
		probeSockDiag = func() error { return fmt.Errorf("refused for this test: %w", unix.EPROTONOSUPPORT) }
	}
	var err error
	switch part {
	case partSender:
		err = helperSender(t, out)
	case partReceiver:
		err = helperReceiver(out)
	case partImpostor:
		err = helperImpostor(t, out)
	case partOpener:
		err = helperOpener(out)
	case partCacheEnv:
		err = helperCacheEnv(t, out)
	case partAddrSpace:
		err = helperAddrSpace(t, out)
	case partPidNS:
		err = helperPidNS(t, out)
	case partRelayRecord:
		err = helperRelayRecord(t, out)
	case partImporter:
		err = helperImporter(t, out)
	default:
		err = fmt.Errorf("unknown part %q", part)
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

// helperSender runs a server, says "serving <address>" and obeys commands
// on stdin until it closes:
//
//	register <chunks> <chunk size> <uses> <block at> <seed>
//	    → "ticket <hex>"; a memfd of pattern(seed) registered with
//	      HostFile, whose descriptor the helper closes at once (the library
//	      keeps its own). With <block at> >= 0 the exporter says
//	      "blocked <id> <index>" and blocks forever at that chunk.
//	live → "live <n>"
//	goroutines → "goroutines <n>"
//	fds → "fds <n>", its open descriptors once they settle
//	close → closes the server (removing its files), "closed"
//	exec impostor <mode> [<hex>] → the process execs itself (same pid,
//	    same start time) as an impostor in <mode> at the server's address,
//	    with <hex> as its VMMIPC_TEST_REPLAY
//	exec sender → the same, as a sender again: a new server at a new
//	    address whose ids start at 1 again
//	fork-listener <mode> close|exit → starts a child that inherits the
//	    listening socket and answers as an impostor in <mode> ("forked
//	    <pid>"), hands it stdin, then closes its own server and lives on
//	    ("closed") or exits
//
// Its server listens in VMMIPC_SOCKET_DIR if set, else in the abstract
// namespace; it closes the server when stdin ends.
func helperSender(t *testing.T, out *lineWriter) error {
	if v := os.Getenv(envNoFile); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return err
		}
		var lim unix.Rlimit
		if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
			return err
		}
		lim.Cur = n
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
			return err
		}
	}
	s, err := NewServer(os.Getenv(SocketDirEnv))
	if err != nil {
		return err
	}
	defer s.Close()
	out.printf("serving %s", s.Addr())
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
			chunks, chunkSize, uses, blockAt, seed := v[0], uint64(v[1]), v[2], v[3], byte(v[4])
			size := uint64(chunks) * chunkSize
			fd := newMemfd(t, int(size), pattern(int(size), seed))
			var id uint64
			var idMu sync.Mutex
			spec := hookedFile(t, fd, size, chunkSize, func(i uint64) error {
				if int64(i) == blockAt {
					idMu.Lock()
					out.printf("blocked %d %d", id, i)
					idMu.Unlock()
					select {} // a stalled exporter
				}
				return nil
			})
			unix.Close(fd) // the library holds its own duplicate
			idMu.Lock()
			tk, err := s.Register(spec, RegisterOptions{Uses: uint32(uses)})
			if err != nil {
				idMu.Unlock()
				return err
			}
			id = tk.RegID
			idMu.Unlock()
			out.printf("ticket %s", ticketHex(t, tk))
		case len(f) == 1 && f[0] == "live":
			out.printf("live %d", s.Live())
		case len(f) == 1 && f[0] == "goroutines":
			out.printf("goroutines %d", runtime.NumGoroutine())
		case len(f) == 1 && f[0] == "fds":
			out.printf("fds %d", ourFDs().settled(t))
		case len(f) == 1 && f[0] == "close":
			s.Close()
			out.printf("closed")
		case len(f) >= 2 && f[0] == "exec":
			return execAs(s, f[1], f[2:])
		case len(f) == 3 && f[0] == "fork-listener":
			return forkListener(s, out, f[1], f[2])
		default:
			return fmt.Errorf("bad command %q", in.Text())
		}
	}
	return nil
}

// execAs replaces the process with the test binary playing part (with the
// impostor's mode and replay message in args), keeping its pid, start time
// and stdin/stdout.
func execAs(s *Server, part string, args []string) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	var set []string
	switch {
	case part == partSender && len(args) == 0:
	case part == partImpostor && len(args) == 1:
		set = []string{envAddr + "=" + s.Addr(), envListenMode + "=" + args[0]}
	case part == partImpostor && len(args) == 2:
		set = []string{envAddr + "=" + s.Addr(), envListenMode + "=" + args[0], envReplay + "=" + args[1]}
	default:
		return fmt.Errorf("exec %s %v: not a part and arguments to exec as", part, args)
	}
	return syscall.Exec(exe, os.Args, helperEnv(part, set...)) // returns only on failure
}

// helperEnv is our environment for a helper playing part, with set
// (key=value) added. Unlike os/exec, execve keeps the first of duplicate
// variables: ours that a helper reads are dropped before they are set anew.
func helperEnv(part string, set ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		switch k, _, _ := strings.Cut(kv, "="); k {
		case helperPartEnv, envAddr, envListenFD, envListenMode, envReplay:
		default:
			env = append(env, kv)
		}
	}
	return append(append(env, set...), helperPartEnv+"="+part)
}

// forkListener starts a child holding a duplicate of the server's listening
// socket (as fd 3), the way a forked child of the exporter would, and gives
// it stdin. Then the exporter stops listening (leaving its socket file and
// lock in place) and lives on without reading stdin ("close"), or exits
// ("exit").
//
// The child is started with syscall.ForkExec, not os/exec: ExtraFiles
// passes (*os.File).Fd, which puts the descriptor in blocking mode, and
// O_NONBLOCK belongs to the open file description that the server's own
// listener shares. Until the child's net.FileListener set it back, an
// accept() of the server's accept loop blocked in the kernel, and closing
// the listener then waited for it forever: the sender never said "closed"
// (a rare failure of TestImpostorInheritsListener/close under load).
func forkListener(s *Server, out *lineWriter, mode, then string) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	rc, err := s.ln.SyscallConn()
	if err != nil {
		return err
	}
	attr := &syscall.ProcAttr{Env: helperEnv(partImpostor, envListenFD+"=3", envListenMode+"="+mode)}
	var pid int
	cerr := rc.Control(func(fd uintptr) {
		attr.Files = []uintptr{0, 1, 2, fd} // stdin, stdout, stderr, the listener as fd 3
		pid, err = syscall.ForkExec(exe, []string{exe, "-test.run=^TestHelperProcess$", "-test.timeout=5m"}, attr)
	})
	if err = errors.Join(cerr, err); err != nil {
		return err
	}
	out.printf("forked %d", pid)
	switch then {
	case "close":
		s.adm.close()
		s.ln.SetUnlinkOnClose(false)
		s.ln.Close()
		out.printf("closed")
		select {} // alive, but no longer serving
	case "exit":
		os.Exit(0)
	}
	return fmt.Errorf("fork-listener: %q is neither close nor exit", then)
}

// helperReceiver opens VMMIPC_TEST_TICKET, pulls VMMIPC_TEST_STOP_AT chunks
// (closing each descriptor), says "at <n>" and waits to be killed; with a
// negative stop it pulls everything and says "ok".
func helperReceiver(out *lineWriter) error {
	tk, err := ticketFromEnv()
	if err != nil {
		return err
	}
	stopAt, _ := strconv.Atoi(os.Getenv(envStopAt))
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

// helperImpostor listens at VMMIPC_TEST_ADDR with a plain socket (or on the
// inherited listening descriptor VMMIPC_TEST_LISTEN_FD), says "listening
// <pid>", and answers each connection per VMMIPC_TEST_LISTEN_MODE:
//
//	count     says nothing; "read <n>" once the peer closed
//	silent    says nothing
//	pushfd    sends a welcome with a descriptor attached, at once
//	skipauth  answers a hello with a welcome and a descriptor (no proof)
//	fakeproof answers a hello with a challenge whose proof is random (it
//	          does not know the secret)
//	replay    answers a hello with the message in VMMIPC_TEST_REPLAY (a
//	          challenge the real exporter gave someone else)
//	relay     relays each connection, bytes and descriptors both ways, to
//	          the exporter's socket it swapped away (VMMIPC_TEST_TAKE=swap)
//
// It records every byte it receives. "report" on stdin waits (up to 5 s)
// until every peer has closed and answers "report <connections> <hex of
// all bytes received, or ->"; "relayed" answers "relayed <descriptors
// that crossed the relay>"; "restore" puts a swapped socket back
// ("restored").
func helperImpostor(t *testing.T, out *lineWriter) error {
	var ln net.Listener
	var err error
	if v := os.Getenv(envListenFD); v != "" {
		fd, _ := strconv.Atoi(v)
		ln, err = net.FileListener(os.NewFile(uintptr(fd), "inherited listener"))
	} else {
		ln, err = impostorListen(os.Getenv(envAddr))
	}
	if err != nil {
		return err
	}
	mode := os.Getenv(envListenMode)
	replay, err := hex.DecodeString(os.Getenv(envReplay))
	if err != nil {
		return err
	}
	var (
		mu        sync.Mutex
		conns     int    // accepted so far
		open      int    // of which not yet closed by the peer
		received  []byte // every byte, in order of the peers' closing
		relayed   int    // descriptors relayed
		restoring atomic.Bool
	)
	go func() {
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			switch in.Text() {
			case "relayed":
				mu.Lock()
				out.printf("relayed %d", relayed)
				mu.Unlock()
				continue
			case "restore":
				restoring.Store(true)
				ln.Close()
				if err := restoreSwapped(os.Getenv(envAddr)); err != nil {
					out.printf("error %v", err)
				} else {
					out.printf("restored")
				}
				continue
			case "report":
			default:
				out.printf("error bad command %q", in.Text())
				continue
			}
			if !waitUntil(5*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return open == 0 }) {
				out.printf("error a peer still holds its connection open 5 s later")
				continue
			}
			mu.Lock()
			h := hex.EncodeToString(received)
			if h == "" {
				h = "-"
			}
			out.printf("report %d %s", conns, h)
			mu.Unlock()
		}
	}()
	out.printf("listening %d", os.Getpid())
	for {
		c, err := ln.Accept()
		if err != nil && restoring.Load() {
			select {} // the test ends us
		}
		if err != nil {
			return err
		}
		uc := c.(*net.UnixConn)
		mu.Lock()
		conns++
		open++
		mu.Unlock()
		go func() {
			defer uc.Close()
			if mode == "pushfd" {
				sendWithDescriptor(t, uc, welcomeMsg{Count: 1, Total: 4096, Kind: MemoryHost, BufferID: 1}.encode())
			}
			var got []byte
			var hdr [headerSize]byte
			if mode == "relay" {
				var fds int
				got, fds = relaySwapped(uc, os.Getenv(envAddr))
				mu.Lock()
				relayed += fds
				mu.Unlock()
			} else if _, err := io.ReadFull(uc, hdr[:]); err == nil {
				got = append(got, hdr[:]...)
				h, err := parseHeader(hdr[:])
				body := make([]byte, h.Len)
				if err == nil {
					_, err = io.ReadFull(uc, body)
					got = append(got, body...)
				}
				if err == nil && h.Type == msgHello {
					answerHello(t, uc, mode, replay)
				}
			}
			rest, _ := io.ReadAll(uc)
			got = append(got, rest...)
			mu.Lock()
			received = append(received, got...)
			open--
			mu.Unlock()
			if mode == "count" {
				out.printf("read %d", len(got))
			}
		}()
	}
}

// answerHello is an impostor's answer to a receiver's hello.
func answerHello(t *testing.T, uc *net.UnixConn, mode string, replay []byte) {
	switch mode {
	case "skipauth":
		sendWithDescriptor(t, uc, welcomeMsg{Count: 1, Total: 4096, Kind: MemoryHost, BufferID: 1}.encode())
	case "fakeproof":
		var m challengeMsg
		ns, _ := newNonce()
		proof, _ := random32("fake proof")
		m.Nonce, m.Proof = ns, proof
		_, _ = uc.Write(m.encode())
	case "replay":
		_, _ = uc.Write(replay)
	}
}

// sendWithDescriptor sends msg with a memfd of one page attached.
func sendWithDescriptor(t *testing.T, uc *net.UnixConn, msg []byte) {
	fd := newMemfd(t, 4096, pattern(4096, 1))
	defer unix.Close(fd)
	_, _, _ = uc.WriteMsgUnix(msg, unix.UnixRights(fd), nil)
}

// helperOpener tries VMMIPC_TEST_TICKET twice: with Open, reporting
// "open code=<status>", and with a raw socket sending a well-formed hello,
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
	nr, _ := newNonce()
	_ = rawWrite(fd, helloMsg{RegID: tk.RegID, Nonce: nr}.encode())
	r := rawReadAll(fd, 5*time.Second)
	msgs, _ := splitMessages(r.Data)
	code := 0
	if m, ok := lastError(msgs); ok {
		code = int(m.Code)
	}
	out.printf("raw code=%d fds=%d", code, len(r.FDAt))
	return nil
}

// helperCacheEnv registers a memfd of 16 pages with a server of its own,
// imports it once with VMMIPC_CACHE_BYTES as the test set it, and reports
// "import code=<status> <message>" and, after unmapping, "cache limit=<n>
// entries=<n>".
func helperCacheEnv(t *testing.T, out *lineWriter) error {
	s, err := NewServer("")
	if err != nil {
		return err
	}
	fd := newMemfd(t, 16*4096, pattern(16*4096, 4))
	tk := registerFile(t, s, fd, 16*4096, 4096, RegisterOptions{})
	unix.Close(fd)
	r, err := Import(tk, DeviceHost, ImportOptions{}, nil)
	out.printf("import code=%d %v", CodeOf(err), err)
	if err == nil {
		if err := verifyAndUnmap(r, 4); err != nil {
			return err
		}
	}
	info := GetCacheInfo()
	out.printf("cache limit=%d entries=%d", info.LimitBytes, info.Entries)
	return nil
}

// helperAddrSpace lowers its own soft RLIMIT_AS to 1 GiB above what it uses
// and reports what checkAddressSpace and Import say for sizes that fit and
// that do not: "check <bytes> code=<status> <message>", then for a 2 GiB
// import "import code=<status> fds=<before>/<after> maps=<n> <message>",
// and "retry code=<status>" for the same import once the limit is back.
func helperAddrSpace(t *testing.T, out *lineWriter) error {
	s, err := NewServer("")
	if err != nil {
		return err
	}
	const big = 2 << 30
	fd := newMemfd(t, big, nil) // sparse: takes no memory
	tk := registerFile(t, s, fd, big, 64<<20, RegisterOptions{Uses: 1})
	unix.Close(fd)

	var saved unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_AS, &saved); err != nil {
		return err
	}
	used, err := addressSpaceInUse()
	if err != nil {
		return err
	}
	tight := saved
	tight.Cur = used + 1<<30
	if err := unix.Setrlimit(unix.RLIMIT_AS, &tight); err != nil {
		return err
	}
	for _, need := range []uint64{64 << 20, big} {
		err := checkAddressSpace(need, "import", " or import less at a time")
		out.printf("check %d code=%d %v", need, CodeOf(err), err)
	}
	before := ourFDs().settled(t)
	_, err = Import(tk, DeviceHost, ImportOptions{}, nil)
	after := ourFDs().settled(t) // the server's end of the session closes asynchronously
	maps, _ := memfdMappings(t)
	out.printf("import code=%d fds=%d/%d maps=%d %v", CodeOf(err), before, after, maps, err)
	if err := unix.Setrlimit(unix.RLIMIT_AS, &saved); err != nil {
		return err
	}
	r, err := Import(tk, DeviceHost, ImportOptions{}, nil)
	if err == nil {
		err = Unmap(r.ID, r.Base)
	}
	out.printf("retry code=%d %v", CodeOf(err), err)
	return nil
}

// helperPidNS is the first process of a new pid namespace (see
// TestImpostorReusesPid). It starts a sender, takes a ticket, kills the
// sender, hands its pid to an impostor (through ns_last_pid) at the
// sender's address, imports the ticket and reports "ticket <hex>", then
// "result code=<status> took=<ms> ticket-start=<t> impostor-start=<t>
// report=<impostor's report> <message>", or "skip <why>".
func helperPidNS(t *testing.T, out *lineWriter) error {
	sender := startHelper(t, partSender, helperOpts{})
	tk := sender.register(4, 4096, 1, -1, 2)
	out.printf("ticket %s", ticketHex(t, tk))
	pid := sender.pid()
	sender.kill()
	if err := os.WriteFile("/proc/sys/kernel/ns_last_pid", []byte(itoa(pid-1)), 0); err != nil {
		out.printf("skip cannot choose the next pid in the namespace (ns_last_pid): %v", err)
		return nil
	}
	imp := startHelper(t, partImpostor, helperOpts{env: []string{envAddr + "=" + tk.Address, envListenMode + "=fakeproof"}})
	imp.expect("listening", 10*time.Second)
	if imp.pid() != pid {
		out.printf("skip the impostor got pid %d, not the exporter's %d", imp.pid(), pid)
		return nil
	}
	impStart, err := processStartTime(pid)
	if err != nil {
		return err
	}
	start := time.Now()
	_, err = Import(tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: 10 * time.Second}}, nil)
	took := time.Since(start)
	imp.send("report")
	report := imp.expect("report ", 10*time.Second)
	out.printf("result code=%d took=%d ticket-start=%d impostor-start=%d report=%s %v",
		CodeOf(err), took.Milliseconds(), tk.StartTime, impStart, strings.ReplaceAll(report, " ", ","), err)
	return nil
}

func ticketFromEnv() (*Ticket, error) {
	b, err := hex.DecodeString(os.Getenv(envTicket))
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

func decodeTicketHex(t testing.TB, s string) *Ticket {
	t.Helper()
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	tk, err := DecodeTicket(b)
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

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

// register asks a sender helper for a registration and returns its ticket.
func (h *helper) register(chunks, chunkSize, uses, blockAt int, seed byte) *Ticket {
	h.t.Helper()
	h.send(fmt.Sprintf("register %d %d %d %d %d", chunks, chunkSize, uses, blockAt, seed))
	return decodeTicketHex(h.t, h.expect("ticket ", 10*time.Second))
}

// ask sends a sender helper a command that it answers with "<cmd> <n>",
// and returns n.
func (h *helper) ask(cmd string) int {
	h.t.Helper()
	h.send(cmd)
	n, err := strconv.Atoi(h.expect(cmd+" ", 10*time.Second))
	if err != nil {
		h.t.Fatal(err)
	}
	return n
}

// live asks a sender helper how many registrations it still holds.
func (h *helper) live() int { h.t.Helper(); return h.ask("live") }

// fds asks a sender helper for its settled descriptor count.
func (h *helper) fds() int { h.t.Helper(); return h.ask("fds") }

// goroutines asks a sender helper how many goroutines it runs, waiting up
// to 3 s for the count to drop to at most want.
func (h *helper) goroutines(want int) int {
	h.t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for {
		n := h.ask("goroutines")
		if n <= want || time.Now().After(deadline) {
			return n
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// report asks an impostor what it received: how many connections, and
// every byte.
func (h *helper) report() (conns int, received []byte) {
	h.t.Helper()
	h.send("report")
	return parseReport(h.t, h.expect("report ", 10*time.Second))
}

func parseReport(t testing.TB, s string) (int, []byte) {
	t.Helper()
	f := strings.Fields(strings.ReplaceAll(s, ",", " "))
	if len(f) != 2 {
		t.Fatalf("impostor report %q", s)
	}
	n, err := strconv.Atoi(f[0])
	if err != nil {
		t.Fatal(err)
	}
	if f[1] == "-" {
		return n, nil
	}
	b, err := hex.DecodeString(f[1])
	if err != nil {
		t.Fatal(err)
	}
	return n, b
}
