package core

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The sender helper: a server in a process of its own that registers memfds
// on request and says what it holds, and that can exec itself or fork a
// child that inherits its listening socket (attack_impostor_test.go); and
// the test's questions to it (register, live, fds, goroutines).

// helperSender runs a server, says "serving <address>" and obeys commands
// on stdin until it closes:
//
//	register <chunks> <chunk size> <uses> <block at> <seed>
//	register <chunks> <chunk size> <uses> <block at> <seed> hold
//	    → the same, registered with Hold
//	    → "ticket <hex>"; a memfd of pattern(seed) registered with
//	      HostFile, whose descriptor the helper closes at once (the library
//	      keeps its own). With <block at> >= 0 the exporter says
//	      "blocked <id> <index>" and blocks forever at that chunk.
//	live → "live <n>"
//	holds → "holds <n>", the uses its receivers hold
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
	if v := os.Getenv(envLeasesPerPid); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return err
		}
		maxLeasesPerPid = n
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
		case (len(f) == 6 || len(f) == 7 && f[6] == "hold") && f[0] == "register":
			var v [5]int64
			hold := len(f) == 7
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
			tk, err := s.Register(spec, RegisterOptions{Uses: uint32(uses), Hold: hold})
			if err != nil {
				idMu.Unlock()
				return err
			}
			id = tk.RegID
			idMu.Unlock()
			out.printf("ticket %s", ticketHex(t, tk))
		case len(f) == 3 && f[0] == "file": // file <size> <seed>: a plain host-file registration (FileBacked), unlimited uses
			size, err := strconv.Atoi(f[1])
			if err != nil {
				return err
			}
			seed, err := strconv.Atoi(f[2])
			if err != nil {
				return err
			}
			fd := newMemfd(t, size, pattern(size, byte(seed)))
			tk, err := s.RegisterHostFile(fd, uint64(size), 4096, RegisterOptions{})
			unix.Close(fd)
			if err != nil {
				return err
			}
			out.printf("ticket %s", ticketHex(t, tk))
		case len(f) == 3 && f[0] == "again": // again <ticket hex> <uses>: a grant of that registration's memory
			uses, err := strconv.ParseUint(f[2], 10, 32)
			if err != nil {
				return err
			}
			tk, err := s.RegisterAgain(decodeTicketHex(t, f[1]), RegisterOptions{Uses: uint32(uses)})
			if err != nil {
				return err
			}
			out.printf("ticket %s", ticketHex(t, tk))
		case len(f) == 2 && f[0] == "dumpable": // dumpable <0|1>: prctl(PR_SET_DUMPABLE)
			on, err := strconv.Atoi(f[1])
			if err != nil {
				return err
			}
			if err := unix.Prctl(unix.PR_SET_DUMPABLE, uintptr(on), 0, 0, 0); err != nil {
				return err
			}
			out.printf("dumpable %d", on)
		case len(f) == 1 && f[0] == "live":
			out.printf("live %d", s.Live())
		case len(f) == 1 && f[0] == "holds":
			out.printf("holds %d", s.Holds())
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

// grant asks a sender helper for a grant of one use of anchor's memory
// (register_again) and returns its ticket.
func (h *helper) grant(anchor *Ticket) *Ticket {
	h.t.Helper()
	h.send("again " + ticketHex(h.t, anchor) + " 1")
	return decodeTicketHex(h.t, h.expect("ticket ", 10*time.Second))
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
