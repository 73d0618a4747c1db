package core

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// An impostor that is given the exporter's pid: in a pid namespace of its
// own, the exporter exits and the next pid goes to a process at its
// address. The test and the namespace's first process (helperPidNS).

// TestImpostorReusesPid: in a new pid namespace, the exporter exits and an
// impostor is given its pid (ns_last_pid) and binds its address. The
// receiver, in the same namespace, fails at once: the start time differs
// (EIO), or, should both have started in the same clock tick, the proof
// does (EAUTH). The impostor learns nothing.
func TestImpostorReusesPid(t *testing.T) {
	wrap := []string{"unshare", "--pid", "--fork", "--kill-child", "--map-root-user", "--mount-proc"}
	if out, err := exec.Command(wrap[0], append(wrap[1:], "true")...).CombinedOutput(); err != nil {
		t.Skipf("cannot make a pid namespace here (%s true: %v: %s); the pid-reuse attack needs unshare and unprivileged user namespaces", strings.Join(wrap, " "), err, strings.TrimSpace(string(out)))
	}
	ns := startHelper(t, partPidNS, helperOpts{wrap: wrap})
	tk := decodeTicketHex(t, ns.expect("ticket ", faultTimeout))
	var result string
	select {
	case l, ok := <-ns.lines:
		switch {
		case !ok:
			t.Fatalf("the namespace helper ended (%v) without a result", ns.exitErr())
		case strings.HasPrefix(l, "skip "):
			t.Skip(strings.TrimPrefix(l, "skip "))
		case strings.HasPrefix(l, "result "):
			result = strings.TrimPrefix(l, "result ")
		default:
			t.Fatalf("the namespace helper said %q", l)
		}
	case <-time.After(faultTimeout):
		t.Fatal("no result from the namespace helper")
	}
	var code, took int
	var tickStart, impStart uint64
	var report string
	if _, err := fmt.Sscanf(result, "code=%d took=%d ticket-start=%d impostor-start=%d report=%s", &code, &took, &tickStart, &impStart, &report); err != nil {
		t.Fatalf("result %q: %v", result, err)
	}
	switch {
	case Code(code) == EIO && tickStart != impStart && strings.Contains(result, "now belongs to another process"):
	case Code(code) == EAUTH && tickStart == impStart && strings.Contains(result, "could not prove"):
	default:
		t.Fatalf("the receiver facing an impostor with the exporter's pid: %s", result)
	}
	if time.Duration(took)*time.Millisecond > promptly {
		t.Fatalf("the receiver took %d ms to refuse the impostor", took)
	}
	_, got := parseReport(t, report)
	if msgs, err := splitMessages(got); err != nil || len(msgs) > 1 || (len(msgs) == 1 && msgs[0].Type != msgHello) || containsSecret(got, tk.Secret) {
		t.Fatalf("the impostor received %d bytes (%v) beyond a hello, or some of the secret", len(got), err)
	}
	t.Logf("pid %d reused in a pid namespace: %s", tk.Pid, result)
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
	// In two rounds, so that the impostor may get nothing but a hello (a
	// one-round hello's proof, bound to this process's pid and start time,
	// is attack_oneround_test.go's).
	oneRoundEnabled = false
	_, err = Import(tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: 10 * time.Second}}, nil)
	took := time.Since(start)
	imp.send("report")
	report := imp.expect("report ", 10*time.Second)
	out.printf("result code=%d took=%d ticket-start=%d impostor-start=%d report=%s %v",
		CodeOf(err), took.Milliseconds(), tk.StartTime, impStart, strings.ReplaceAll(report, " ", ","), err)
	return nil
}
