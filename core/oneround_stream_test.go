package core

import (
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestAHostImportInOneRound: a new host import in the exporter's PID
// namespace sends its hello (one-round flag), its proof and the pull-run
// of every chunk before the exporter has said anything, and the exporter
// answers with its proof, the welcome, one run (one descriptor) and the
// done-ack: one round trip after connecting. (The relay is in this
// process: the one-round form binds the receiver's pid, which it shares.)
func TestAHostImportInOneRound(t *testing.T) {
	s := newTestServer(t)
	proxy := proxyInFront(t, s)
	const chunks = 8
	fd := newMemfd(t, chunks*int(pageSize), pattern(chunks*int(pageSize), 4))
	defer unix.Close(fd)
	tk := registerFile(t, s, fd, chunks*pageSize, pageSize, RegisterOptions{Uses: 1})
	if !tk.OneRound {
		t.Fatal("a registration's ticket does not say that its exporter takes one-round streams")
	}
	if err := importVerified(tk, ImportOptions{NoCache: true}, 4); err != nil {
		t.Fatal(err)
	}
	toServer, toReceiver := proxy.recorded(t)
	sent, err := splitMessages(toServer)
	// The table is answered with the spend log, which the pull-run follows.
	if err != nil || len(sent) != 4 || sent[0].Type != msgHello || sent[1].Type != msgProof || sent[2].Type != msgSpendLog || sent[3].Type != msgPullRun {
		t.Fatalf("the receiver sent %s (%v), want hello, proof, spend-log, pull-run", describeAll(sent), err)
	}
	if h, err := parseHello(sent[0].Body); err != nil || h.Flags&helloOneRound == 0 {
		t.Fatalf("the hello's flags %#x (%v) do not ask for one round", h.Flags, err)
	}
	got, err := splitMessages(toReceiver)
	// This process meets the exporter for the first time: the session
	// brings its grant table (granttable.go), one descriptor more.
	if err != nil || len(got) != 6 || got[0].Type != msgChallenge || got[1].Type != msgTable || got[2].Type != msgLogAck || got[3].Type != msgWelcome || got[4].Type != msgRun || got[5].Type != msgDoneAck {
		t.Fatalf("the exporter sent %s (%v), want challenge, table, log-ack, welcome, run, done-ack", describeAll(got), err)
	}
	if n := proxy.descriptors(); n != 3 {
		t.Fatalf("%d descriptors crossed, want the table's, the spend log's and the run's", n)
	}
}

func describeAll(ms []rawMsg) string {
	names := make([]string, len(ms))
	for i, m := range ms {
		names[i] = msgName(m.Type)
	}
	return "[" + strings.Join(names, ", ") + "]"
}
