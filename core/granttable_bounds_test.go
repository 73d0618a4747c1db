package core

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The header's bounds of table hits (vmmipc_import, "a hit that holds
// nothing"): 64 tables per receiver process, those of exporters gone
// dropped for room; 63 uses in its spend log per exporter not yet answered,
// beyond which hits ask the exporter; and two processes hitting the last
// use of one ticket.

// hitGrant imports a new one-use grant of anchor (whose buffer this
// process has mapped: a hit) and lets go of it; it returns the mapping's
// address.
func hitGrant(t *testing.T, s *Server, anchor *Ticket) uint64 {
	t.Helper()
	return hit(t, again(t, s, anchor, RegisterOptions{Uses: 1}))
}

// hit imports g (a grant of a buffer this process has mapped) and lets go
// of it; it returns the mapping's address.
func hit(t *testing.T, g *Ticket) uint64 {
	t.Helper()
	r, err := Import(g, DeviceHost, ImportOptions{}, nil)
	if err != nil {
		t.Fatalf("a hit on grant %d: %v", g.RegID, err)
	}
	unmapRef(t, r)
	return r.Base
}

// mappedSender starts a sender helper with a buffer of pattern(seed) that
// this process maps (the miss that brings the sender's table and takes
// this process's spend log); the caller unmaps the mapping.
func mappedSender(t *testing.T, seed byte) (*helper, *Ticket, Ref) {
	t.Helper()
	sender := startHelper(t, partSender, helperOpts{})
	anchor := sender.register(4, 4096, 0, -1, seed)
	return sender, anchor, importHost(t, anchor, ImportOptions{})
}

// TestTablesBoundedAndSwept: with 64 tables mapped (of exporters whose
// images still hold them: one server and stand-ins), a new exporter's table is not
// taken and its hits ask it; once those exporters are gone, the next
// session sweeps their tables and brings the new one.
func TestTablesBoundedAndSwept(t *testing.T) {
	before := cacheTest(t)
	s1 := newTestServer(t)
	anchor1, first1 := tableGrant(t, s1, 41)
	defer unmapRef(t, first1)

	// Stand-ins for 63 live exporters: their "own descriptor" is one of ours.
	pin := newMemfd(t, 4096, nil)
	var st unix.Stat_t
	if err := unix.Fstat(pin, &st); err != nil {
		t.Fatal(err)
	}
	holder := fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), pin)
	var fakes []string
	tables.mu.Lock()
	sweepTables() // earlier tests' servers have closed: their tables go
	for i := 0; len(tables.m) < maxTables; i++ {
		mem, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			tables.mu.Unlock()
			t.Fatal(err)
		}
		key := fmt.Sprintf("stand-in|%d", i)
		tables.m[key] = &tableView{mem: mem, mine: map[uint64]uint32{}, pending: map[uint64]uint32{},
			holder: holder, dev: st.Dev, ino: st.Ino}
		fakes = append(fakes, key)
	}
	tables.mu.Unlock()
	t.Cleanup(func() {
		unix.Close(pin)
		tables.mu.Lock()
		defer tables.mu.Unlock()
		for _, k := range fakes {
			if v := tables.m[k]; v != nil {
				v.unmap()
				delete(tables.m, k)
			}
		}
	})
	if len(fakes) == 0 {
		t.Fatal("no room for stand-ins: other live exporters' tables fill it")
	}

	s2 := newTestServer(t)
	anchor2 := registerCounting(t, s2, cacheSize, 42, RegisterOptions{Uses: 0}).tk
	first2 := importHost(t, anchor2, ImportOptions{})
	defer unmapRef(t, first2)
	if tableMapped(anchor2) {
		t.Fatalf("a %dth table was taken", maxTables+1)
	}
	hits := func() uint64 { return cacheDelta(before).TableHits }
	base := hits()
	hitGrant(t, s2, anchor2) // no table taken for want of room: it asks the exporter
	if n := hits() - base; n != 0 {
		t.Fatalf("%d table hits on an exporter whose table was not taken", n)
	}
	if err := verifyRef(first2, 42); err != nil {
		t.Fatal(err)
	}

	unix.Close(pin) // the stand-ins' exporters are gone
	pin = -1
	hitGrant(t, s2, anchor2)
	if !tableMapped(anchor2) {
		t.Fatal("the tables of exporters gone were not swept for the new one")
	}
	tables.mu.Lock()
	left := 0
	for k := range tables.m {
		if strings.HasPrefix(k, "stand-in|") {
			left++
		}
	}
	tables.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d tables of exporters gone are still mapped", left)
	}
	hitGrant(t, s2, anchor2) // the table came with that session: it vouches for this hit
	if n := hits() - base; n != 1 {
		t.Fatalf("%d table hits after the sweep, want 1", n)
	}
	if !tableMapped(anchor1) {
		t.Fatal("the sweep dropped a live exporter's table")
	}
}

// TestSpendLogFullAsksTheExporter: with the exporter stopped, 63 table hits
// return at once, each with its record in this process's spend log; the
// 64th finds the log full and asks the exporter, within its own timeout.
// Once the exporter runs again every recorded use is spent and hits are
// vouched by the table again.
func TestSpendLogFullAsksTheExporter(t *testing.T) {
	before := cacheTest(t)
	sender, anchor, first := mappedSender(t, 43)
	defer unmapRef(t, first)
	grants := make([]*Ticket, spendRecords+2)
	for i := range grants {
		grants[i] = sender.grant(anchor)
	}
	live := sender.live()
	if err := unix.Kill(sender.pid(), unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer unix.Kill(sender.pid(), unix.SIGCONT)
	if !waitUntil(5*time.Second, func() bool { return stoppedProcess(sender.pid()) }) {
		t.Fatal("the sender did not stop")
	}
	long := ImportOptions{OpenOptions: OpenOptions{Timeout: 20 * time.Second}}
	for i := range spendRecords {
		start := time.Now()
		r, err := Import(grants[i], DeviceHost, long, nil)
		if err != nil {
			t.Fatalf("table hit %d on a stopped exporter: %v", i+1, err)
		}
		if took := time.Since(start); took > time.Second {
			t.Fatalf("table hit %d took %v", i+1, took)
		}
		unmapRef(t, r)
	}
	if n := GetCacheInfo().TableHits - before.TableHits; n != spendRecords {
		t.Fatalf("%d table hits, want %d", n, spendRecords)
	}
	start := time.Now()
	short := ImportOptions{OpenOptions: OpenOptions{Timeout: 300 * time.Millisecond}}
	if _, err := Import(grants[spendRecords], DeviceHost, short, nil); CodeOf(err) != EIO {
		t.Fatalf("a hit with the spend log full, the exporter stopped: %v, want EIO (it asks the exporter)", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("the hit that asked a stopped exporter took %v, past its 300ms timeout", took)
	}
	if err := unix.Kill(sender.pid(), unix.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// Every recorded use is spent (the one that asked may be too: the
	// exporter reads its hello once it runs).
	if !waitUntil(20*time.Second, func() bool { return sender.live() <= live-spendRecords }) {
		t.Fatalf("%d of %d recorded uses spent", live-sender.live(), spendRecords)
	}
	if !confirmsAnswered(20 * time.Second) {
		t.Fatal("confirmations still pending")
	}
	r, err := Import(grants[spendRecords+1], DeviceHost, ImportOptions{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	unmapRef(t, r)
	if n := GetCacheInfo().TableHits - before.TableHits; n != spendRecords+1 {
		t.Fatalf("%d table hits after the log emptied, want %d", n, spendRecords+1)
	}
	if err := verifyRef(first, 43); err != nil {
		t.Fatal(err)
	}
}

// TestTwoProcessesHitTheLastUse: a receiver took a grant's only use on the
// table (its record written, its spend not yet made) when this process
// hits the same grant: both are vouched, each had the buffer mapped
// already, and the exporter spends the use once: this process's spend
// first; the other's record, read once it dies, spends nothing more.
func TestTwoProcessesHitTheLastUse(t *testing.T) {
	before := cacheTest(t)
	s := newTestServer(t)
	anchor, first := tableGrant(t, s, 44)
	defer unmapRef(t, first)
	g := again(t, s, anchor, RegisterOptions{Uses: 1})
	other, ours := otherTookTheUse(t, s, anchor, g)
	r, err := Import(g, DeviceHost, ImportOptions{}, nil)
	if err != nil {
		t.Fatalf("this process's hit on the last use: %v", err)
	}
	if r.Base != first.Base {
		t.Fatalf("the hit at %#x, not this process's mapping at %#x", r.Base, first.Base)
	}
	unmapRef(t, r)
	got := cacheDelta(before)
	if got.TableHits != 1 || got.ConfirmsFailed != 0 {
		t.Fatalf("%d table hits, %d failed confirmations; want 1 and 0", got.TableHits, got.ConfirmsFailed)
	}
	spentOnce(t, s, g, other, ours)
	hitGrant(t, s, anchor) // the anchor lives on, unharmed
}

// spendLogsMapped is how many receivers' spend logs s maps.
func spendLogsMapped(s *Server) int {
	s.reg.spends.mu.Lock()
	defer s.reg.spends.mu.Unlock()
	return len(s.reg.spends.logs)
}

// otherTookTheUse starts another receiver of s (it maps anchor, which
// brings it s's table and gives s its spend log) and has it take a use of
// g on the table without spending it. ours is how many spend logs s mapped
// before: this process's own.
func otherTookTheUse(t *testing.T, s *Server, anchor, g *Ticket) (other *helper, ours int) {
	t.Helper()
	ours = spendLogsMapped(s)
	other = startHelper(t, partTableHit, helperOpts{env: []string{envTicket + "=" + ticketHex(t, anchor)}})
	other.send("vouch " + ticketHex(t, g))
	if got := other.expect("vouched ", 10*time.Second); got != fmt.Sprint(int(tableVouched)) {
		t.Fatalf("the other receiver's table said %s, want %d (vouched)", got, tableVouched)
	}
	return other, ours
}

// spentOnce checks that g's use was spent (by this process), then kills
// the other receiver, whose record of the same use, read once it died,
// must spend nothing more.
func spentOnce(t *testing.T, s *Server, g *Ticket, other *helper, ours int) {
	t.Helper()
	if err := s.Wait(g, 5*time.Second); err != nil {
		t.Fatalf("the grant's use was not spent: %v", err)
	}
	live := s.Live()
	if n := spendLogsMapped(s); n != ours+1 {
		t.Fatalf("the exporter maps %d spend logs, want %d (ours and the other receiver's)", n, ours+1)
	}
	other.kill()
	if !waitUntil(5*time.Second, func() bool { return spendLogsMapped(s) == ours }) {
		t.Fatal("the dead receiver's log was not read and dropped")
	}
	if n := s.Live(); n != live {
		t.Fatalf("reading the dead receiver's record of a spent grant changed the live registrations: %d, was %d", n, live)
	}
}
