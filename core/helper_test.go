package core

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// Fault, hostile-peer and attack tests need real separate processes: the
// test binary re-executes itself running only TestHelperProcess, with
// helperPartEnv naming the part to play. Helpers talk to the test over
// stdin/stdout, one line per message. The parts live in
// helper_sender_test.go, helper_impostor_test.go and
// helper_receivers_test.go (the pid namespace's in
// attack_pidreuse_test.go); the test's side of a helper in
// helper_control_test.go.

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
	partHoldMany    = "holdmany"    // holds a use of each of many tickets at a low RLIMIT_NOFILE
	partHoldFork    = "holdfork"    // holds a use, then forks a child that shuts every socket down
	partLeaseHog    = "leasehog"    // asks an exporter for leases and sessions in a loop
	partTableHit    = "tablehit"    // imports a ticket, then takes table hits' uses without their confirmations, and waits to be killed
)

// Environment of the helpers.
const (
	envTicket       = "VMMIPC_TEST_TICKET"         // hex ticket for receivers and openers
	envStopAt       = "VMMIPC_TEST_STOP_AT"        // receiver: chunks to pull before waiting to be killed
	envAddr         = "VMMIPC_TEST_ADDR"           // impostor: the address to bind
	envListenFD     = "VMMIPC_TEST_LISTEN_FD"      // impostor: an inherited listening descriptor instead
	envListenMode   = "VMMIPC_TEST_LISTEN_MODE"    // impostor: how to answer (see helperImpostor)
	envReplay       = "VMMIPC_TEST_REPLAY"         // impostor "replay": the hex message to answer with
	envNoFile       = "VMMIPC_TEST_NOFILE"         // sender: its soft RLIMIT_NOFILE
	envLeasesPerPid = "VMMIPC_TEST_LEASES_PER_PID" // sender: maxLeasesPerPid (tests that emulate many receivers in one process)
	envSeed         = "VMMIPC_TEST_SEED"           // importer: the pattern the bytes must follow
	envImports      = "VMMIPC_TEST_IMPORTS"        // importer: how many times to import
	envTake         = "VMMIPC_TEST_TAKE"           // impostor at a socket path: "swap", "lock" (see impostorListen)
	envNoSockDiag   = "VMMIPC_TEST_NO_SOCK_DIAG"   // any part: act as if sock_diag were refused (nodiag_test.go)
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
	case partHoldMany:
		err = helperHoldMany(t, out)
	case partHoldFork:
		err = helperHoldFork(out)
	case partLeaseHog:
		err = helperLeaseHog(out)
	case partTableHit:
		err = helperTableHit(t, out)
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
