package core

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The grant table (granttable.go): a hit that holds nothing is checked
// against the exporter's published grants without a round trip, and is
// refused exactly where the exporter would refuse it.

// tableGrant registers a memfd of pattern(seed) with unlimited uses (the
// anchor), imports it once (the miss that brings the exporter's table) and
// returns the anchor and its mapping.
func tableGrant(t *testing.T, s *Server, seed byte) (*Ticket, Ref) {
	t.Helper()
	anchor := registerCounting(t, s, cacheSize, seed, RegisterOptions{Uses: 0}).tk
	r := importHost(t, anchor, ImportOptions{})
	if !tableMapped(anchor) {
		t.Fatal("the first session with the exporter did not bring its grant table")
	}
	return anchor, r
}

func tableMapped(tk *Ticket) bool {
	tables.mu.Lock()
	defer tables.mu.Unlock()
	return tables.m[tk.exporterKey()] != nil
}

func again(t *testing.T, s *Server, anchor *Ticket, opts RegisterOptions) *Ticket {
	t.Helper()
	tk, err := s.RegisterAgain(anchor, opts)
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// TestTableHitsRefuseWhatTheExporterRefuses: a table hit returns the
// mapping and spends the use right after; an unregistered grant, one past
// its ttl, one used up (by this process: no round trip), and a ticket
// changed in any byte of its secret, id or size are refused with the
// exporter's own codes, and none of those counts as a table hit.
func TestTableHitsRefuseWhatTheExporterRefuses(t *testing.T) {
	before := cacheTest(t)
	s := newTestServer(t)
	anchor, first := tableGrant(t, s, 21)
	defer unmapRef(t, first)

	hit := func(tk *Ticket) (Ref, error) { return Import(tk, DeviceHost, ImportOptions{}, nil) }
	tableHits := func() uint64 { return GetCacheInfo().TableHits - before.TableHits }

	one := again(t, s, anchor, RegisterOptions{Uses: 1})
	r, err := hit(one)
	if err != nil || r.Base != first.Base {
		t.Fatalf("a table hit: %+v, %v (the mapping is at %#x)", r, err, first.Base)
	}
	if err := verifyRef(r, 21); err != nil {
		t.Fatal(err)
	}
	unmapRef(t, r)
	if n := tableHits(); n != 1 {
		t.Fatalf("%d table hits, want 1", n)
	}
	if _, err := hit(one); CodeOf(err) != ENOENT {
		t.Fatalf("the same one-use ticket again: %v, want ENOENT", err)
	}
	if err := s.Wait(one, 5*time.Second); err != nil {
		t.Fatalf("the table hit's use was not spent: %v", err)
	}

	gone := again(t, s, anchor, RegisterOptions{Uses: 1})
	if err := s.Unregister(gone); err != nil {
		t.Fatal(err)
	}
	if _, err := hit(gone); CodeOf(err) != ENOENT {
		t.Fatalf("a hit on an unregistered grant: %v, want ENOENT", err)
	}

	short := again(t, s, anchor, RegisterOptions{Uses: 1, TTL: 20 * time.Millisecond})
	time.Sleep(60 * time.Millisecond)
	if _, err := hit(short); CodeOf(err) != ENOENT {
		t.Fatalf("a hit on a grant past its ttl: %v, want ENOENT", err)
	}

	live := again(t, s, anchor, RegisterOptions{Uses: 1})
	for _, c := range []struct {
		what   string
		change func(*Ticket)
	}{
		{"a secret byte", func(k *Ticket) { k.Secret[7] ^= 0x40 }},
		{"the registration id", func(k *Ticket) { k.RegID ^= 1 << 20 }},
		{"the holds flag", func(k *Ticket) { k.Holds = true }},
	} {
		changed := *live
		c.change(&changed)
		if _, err := hit(&changed); err == nil {
			t.Fatalf("a ticket with %s changed was accepted", c.what)
		}
	}
	if n := tableHits(); n != 1 {
		t.Fatalf("%d table hits after the refusals, want 1", n)
	}
	r, err = hit(live) // the changed copies spent nothing
	if err != nil {
		t.Fatalf("the unchanged ticket after its changed copies were refused: %v", err)
	}
	unmapRef(t, r)
	if err := s.Wait(live, 5*time.Second); err != nil {
		t.Fatal(err)
	}
}

// mappedGrant starts a sender helper with a buffer of 4 pages (seed), maps
// it here, and returns the helper, the buffer's ticket, the mapping and a
// grant of one use of it: its table hit is a test's to make.
func mappedGrant(t *testing.T, seed byte) (sender *helper, anchor *Ticket, r Ref, grant *Ticket) {
	t.Helper()
	sender = startHelper(t, partSender, helperOpts{})
	anchor = sender.register(4, 4096, 0, -1, seed)
	r = importHost(t, anchor, ImportOptions{})
	return sender, anchor, r, sender.grant(anchor)
}

// TestTableHitOnAStoppedExporter: a hit the table vouches for needs no
// answer (a stopped exporter's live grant hits at once); its use is spent
// once the exporter runs again. A held hit never takes this path.
func TestTableHitOnAStoppedExporter(t *testing.T) {
	cacheTest(t)
	sender, _, r, grant := mappedGrant(t, 22)
	defer Unmap(r.ID, r.Base)
	live := sender.live()
	if err := unix.Kill(sender.pid(), unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer unix.Kill(sender.pid(), unix.SIGCONT)
	if !waitUntil(5*time.Second, func() bool { return stoppedProcess(sender.pid()) }) {
		t.Fatal("the sender did not stop")
	}
	start := time.Now()
	hr, err := Import(grant, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: 300 * time.Millisecond}}, nil)
	if err != nil {
		t.Fatalf("a table hit on a stopped exporter: %v", err)
	}
	if took := time.Since(start); took > 100*time.Millisecond {
		t.Fatalf("a table hit took %v", took)
	}
	if err := verifyRef(hr, 22); err != nil {
		t.Fatal(err)
	}
	Unmap(hr.ID, hr.Base)
	if err := unix.Kill(sender.pid(), unix.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(5*time.Second, func() bool { return sender.live() == live-1 }) {
		t.Fatalf("the grant's use was not spent after the exporter ran again: %d live, want %d", sender.live(), live-1)
	}
}

// TestTableOfAnExporterThatDied: a killed exporter's grants are no hits,
// though its table is still mapped here; the table goes with the mapping.
func TestTableOfAnExporterThatDied(t *testing.T) {
	cacheTest(t)
	sender, anchor, r, grant := mappedGrant(t, 23)
	if !tableMapped(anchor) {
		t.Fatal("no table")
	}
	sender.kill()
	if _, err := Import(grant, DeviceHost, ImportOptions{}, nil); CodeOf(err) != EIO {
		t.Fatalf("a hit on a dead exporter's grant: %v, want EIO", err)
	}
	Unmap(r.ID, r.Base)
	if tableMapped(anchor) {
		t.Fatal("the dead exporter's table is still mapped")
	}
}

// TestTableHitRightAfterTheExporterDied: a hit or first import once the
// exporter died is refused, with the table's lifeline (lifeline.go) and
// without one (its word taken as 0 here), where the holder check refuses:
// the exit closed the table's descriptor, which every holder check reads,
// while the last start-time check is trusted for aliveRecheck (here an
// hour).
func TestTableHitRightAfterTheExporterDied(t *testing.T) {
	for _, mode := range []string{"lifeline", "proc"} {
		t.Run(mode, func(t *testing.T) { tableHitRightAfterTheExporterDied(t, mode == "lifeline") })
	}
}

func tableHitRightAfterTheExporterDied(t *testing.T, lifeline bool) {
	cacheTest(t)
	defer func(d time.Duration) { aliveRecheck = d }(aliveRecheck)
	aliveRecheck = time.Hour
	sender := startHelper(t, partSender, helperOpts{})
	anchor := sender.register(4, 4096, 0, -1, 24)
	r := importHost(t, anchor, ImportOptions{})
	defer Unmap(r.ID, r.Base)
	tables.mu.Lock()
	if v := tables.m[anchor.exporterKey()]; v != nil && !lifeline {
		v.life = 0
	}
	tables.mu.Unlock()
	grants := make([]*Ticket, 3)
	for i := range grants {
		grants[i] = sender.grant(anchor)
	}
	before := GetCacheInfo()
	for _, g := range grants[:2] { // without a lifeline, the first checks /proc, the second trusts it
		hr, err := Import(g, DeviceHost, ImportOptions{}, nil)
		if err != nil {
			t.Fatalf("a table hit: %v", err)
		}
		if err := verifyRef(hr, 24); err != nil {
			t.Fatal(err)
		}
		Unmap(hr.ID, hr.Base)
	}
	if got := GetCacheInfo().TableHits - before.TableHits; got != 2 {
		t.Fatalf("%d table hits, want 2", got)
	}
	sender.send(fmt.Sprintf("file %d 25", cacheSize)) // a buffer new here: a table import's
	fresh := decodeTicketHex(t, sender.expect("ticket ", 10*time.Second))
	sender.kill()
	if _, err := Import(grants[2], DeviceHost, ImportOptions{}, nil); CodeOf(err) != EIO {
		t.Fatalf("a hit on the grant of an exporter that died since the last liveness check: %v, want EIO", err)
	}
	if _, err := Import(fresh, DeviceHost, ImportOptions{}, nil); CodeOf(err) != EIO {
		t.Fatalf("a first import of a buffer of an exporter that died since the last liveness check: %v, want EIO", err)
	}
	if got := GetCacheInfo(); got.TableHits-before.TableHits != 2 || got.TableImports != before.TableImports {
		t.Fatalf("%d table hits and %d table imports after the exporter died, want still 2 and 0", got.TableHits-before.TableHits, got.TableImports-before.TableImports)
	}
}

// TestHeldGrantsAreNotPublished: a held grant never enters the table, so
// its hits keep asking the exporter (holder.go).
func TestHeldGrantsAreNotPublished(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 4096, pattern(4096, 1))
	defer unix.Close(fd)
	held := registerFile(t, s, fd, 4096, 4096, RegisterOptions{Hold: true})
	plain := registerFile(t, s, fd, 4096, 4096, RegisterOptions{})
	for _, c := range []struct {
		tk   *Ticket
		want bool
	}{{held, false}, {plain, true}} {
		off := slotIndex(c.tk.RegID) * tableSlotSize
		published := s.reg.table.mem[off+slotState] == slotPublished
		if published != c.want {
			t.Fatalf("holds %v: published %v", c.tk.Holds, published)
		}
	}
}

// TestTableCannotBeWrittenByReceivers: what a receiver is sent is read
// only, and the memfd is sealed so that no description of it, read-write
// ones reopened through /proc included, can write or resize it.
func TestTableCannotBeWrittenByReceivers(t *testing.T) {
	s := newTestServer(t)
	fd, own, err := s.reg.table.readOnly()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if own != s.reg.table.fd {
		t.Fatalf("told %d, the table is %d", own, s.reg.table.fd)
	}
	if _, err := unix.Mmap(fd, 0, tableSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
		t.Fatal("a receiver mapped the table writable")
	}
	if _, err := unix.Pwrite(fd, []byte{1}, 64); err == nil {
		t.Fatal("a receiver wrote the table")
	}
	rw, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", fd), unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(rw)
	if _, err := unix.Mmap(rw, 0, tableSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); !errors.Is(err, unix.EPERM) {
		t.Fatalf("mapping a read-write reopening writable: %v, want EPERM", err)
	}
	if _, err := unix.Pwrite(rw, []byte{1}, 64); !errors.Is(err, unix.EPERM) {
		t.Fatalf("writing a read-write reopening: %v, want EPERM", err)
	}
	if err := unix.Ftruncate(rw, 0); !errors.Is(err, unix.EPERM) {
		t.Fatalf("shrinking it: %v, want EPERM", err)
	}
	if err := unix.Fallocate(rw, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, 4096); !errors.Is(err, unix.EPERM) {
		t.Fatalf("punching a hole: %v, want EPERM", err)
	}
}

// TestTableTakenOnlyWhenSafe: a receiver maps only a file of the table's
// size, sealed against resizing and writing, with the table's header; it
// closes the descriptor and leaves no mapping of what it refuses.
func TestTableTakenOnlyWhenSafe(t *testing.T) {
	good := func(seals int, size int64, magic uint32) int {
		fd, err := unix.MemfdCreate("fake-table", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.Ftruncate(fd, size); err != nil {
			t.Fatal(err)
		}
		var hdr [16]byte
		copy(hdr[:], []byte{byte(magic), byte(magic >> 8), byte(magic >> 16), byte(magic >> 24), tableVersion, 0, 0, 0, tableSlots & 0xff, tableSlots >> 8})
		if _, err := unix.Pwrite(fd, hdr[:], 0); err != nil {
			t.Fatal(err)
		}
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
			t.Fatal(err)
		}
		return fd
	}
	all := unix.F_SEAL_GROW | unix.F_SEAL_SHRINK | unix.F_SEAL_FUTURE_WRITE | unix.F_SEAL_SEAL
	fdsBefore := ourFDs().now(t)
	for i, c := range []struct {
		what string
		fd   int
		ok   bool
	}{
		{"a table", good(all, tableSize, tableMagic), true},
		{"no seals", good(0, tableSize, tableMagic), false},
		{"writable", good(unix.F_SEAL_GROW|unix.F_SEAL_SHRINK, tableSize, tableMagic), false},
		{"shrinkable", good(unix.F_SEAL_GROW|unix.F_SEAL_FUTURE_WRITE, tableSize, tableMagic), false},
		{"too small", good(all, tableSize-4096, tableMagic), false},
		{"another magic", good(all, tableSize, tableMagic+1), false},
	} {
		key := fmt.Sprintf("test-exporter-%d", i)
		err := takeTable(key, c.fd, 0, 0)
		unix.Close(c.fd)
		tables.mu.Lock()
		v := tables.m[key]
		tables.mu.Unlock()
		if (err == nil) != c.ok || (v != nil) != c.ok {
			t.Fatalf("%s: taken %v (%v), want %v", c.what, v != nil, err, c.ok)
		}
		dropTable(key)
	}
	ourFDs().waitFor(t, fdsBefore, "after tables taken and refused")
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(maps, []byte("fake-table")) {
		t.Fatal("a table refused or dropped is still mapped")
	}
}

// takeOwnTable maps s's grant table here as a receiver's, with a spend log,
// as a first session with s would (t's exporter key names it).
func takeOwnTable(f testing.TB, s *Server, tk *Ticket) {
	f.Helper()
	rfd, own, err := s.reg.table.readOnly()
	if err != nil {
		f.Fatal(err)
	}
	defer unix.Close(rfd)
	if err := takeTable(tk.exporterKey(), rfd, os.Getpid(), uint64(own)); err != nil {
		f.Fatal(err)
	}
	lfd, log, err := newSpendLog()
	if err != nil {
		f.Fatal(err)
	}
	unix.Close(lfd)
	tables.mu.Lock()
	tables.m[tk.exporterKey()].log = log
	tables.mu.Unlock()
	f.Cleanup(func() { dropTable(tk.exporterKey()) })
}

// TestUsesInFlightAreNotCountedTwice: the exporter counts a use in the
// table before its answer reaches this process, so a use of this process
// still in flight may be in the slot's spent count already. A hit then is
// neither refused as used up nor vouched for: the exporter judges it.
// Uses the exporter could not be asked about (kept) are never in that
// count, and do make a grant used up here. (Seen on Python 3.12: two
// imports of a two-use grant, the second refused as used up.)
func TestUsesInFlightAreNotCountedTwice(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 4096, pattern(4096, 1))
	defer unix.Close(fd)
	anchor := registerFile(t, s, fd, 4096, 4096, RegisterOptions{})
	takeOwnTable(t, s, anchor)
	tk := again(t, s, anchor, RegisterOptions{Uses: 2})
	defer s.Unregister(tk)
	answer, first := vouch(tk, false)
	if answer != tableVouched {
		t.Fatalf("the first use: %v, want vouched", answer)
	}
	s.reg.table.spent(tk.RegID, 2, 1) // the exporter counted it; its answer is on its way
	if answer, _ := vouch(tk, false); answer != tableAsk {
		t.Fatalf("with the first use counted and in flight: %v, want tableAsk (not used up: one use is left)", answer)
	}
	settle(tk, first.record, true) // asked, not answered: kept (and so not in the count)
	s.reg.table.spent(tk.RegID, 2, 0)
	answer, second := vouch(tk, false)
	if answer != tableVouched {
		t.Fatalf("the second use: %v, want vouched", answer)
	}
	settle(tk, second.record, true)
	if answer, _ := vouch(tk, false); answer != tableSpentHere {
		t.Fatalf("both uses kept here: %v, want tableSpentHere", answer)
	}
}

// FuzzGrantTableSlot writes fuzzed bytes over a grant's slot (and its
// file entry, and the table's lifeline word) and changes fuzzed bytes of
// its ticket: the table vouches only for a slot that is stable,
// published, of that very ticket (its id and tag), within its ttl and with
// a use left, of an exporter whose lifeline is as it was taken, and
// reading never fails otherwise.
func FuzzGrantTableSlot(f *testing.F) {
	f.Add(make([]byte, tableSlotSize), uint8(0), uint8(0), uint8(0))
	f.Add([]byte{2, 0, 0, 0, 1}, uint8(1), uint8(3), uint8(0x80))
	f.Add([]byte{}, uint8(2), uint8(200), uint8(1))
	f.Add(make([]byte, tableSlotSize+tableFileSize), uint8(4), uint8(0), uint8(0))
	f.Add([]byte{}, uint8(8), uint8(30), uint8(0x40))
	s := newTestServer(f)
	fd := newMemfd(f, 4096, pattern(4096, 1))
	defer unix.Close(fd)
	anchor := registerFile(f, s, fd, 4096, 4096, RegisterOptions{})
	takeOwnTable(f, s, anchor)
	f.Fuzz(func(t *testing.T, raw []byte, how, at, xor uint8) {
		tk, err := s.RegisterAgain(anchor, RegisterOptions{Uses: 1})
		if err != nil {
			t.Fatal(err)
		}
		i := slotIndex(tk.RegID)
		off := i * tableSlotSize
		gt := &s.reg.table
		defer func() {
			s.Unregister(tk)
			gt.mu.Lock()
			clear(gt.mem[off : off+tableSlotSize]) // as the exporter left it before the fuzzed bytes
			gt.mu.Unlock()
		}()
		fe := fileEntry(i)
		named := *(*[tableFileSize]byte)(gt.mem[fe : fe+tableFileSize])
		defer func() {
			gt.mu.Lock()
			copy(gt.mem[fe:fe+tableFileSize], named[:])
			gt.mu.Unlock()
		}()
		if how&1 != 0 { // fuzzed bytes over the slot, as a hostile writer would leave it
			gt.mu.Lock()
			copy(gt.mem[off:off+tableSlotSize], raw)
			gt.mu.Unlock()
		}
		if how&4 != 0 { // and over its file entry
			gt.mu.Lock()
			copy(gt.mem[fe:fe+tableFileSize], raw[min(len(raw), tableSlotSize):])
			gt.mu.Unlock()
		}
		if how&8 != 0 { // a lifeline word other than the one taken: an ended exporter's, or a hostile one's
			w := lifelineWord(gt.mem)
			was := atomic.LoadUint32(w)
			atomic.StoreUint32(w, was^(uint32(xor)|1)<<(at%24))
			defer atomic.StoreUint32(w, was)
		}
		b, err := tk.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if how&2 != 0 {
			b[int(at)%len(b)] ^= xor
		}
		changed, err := DecodeTicket(b[:])
		if err != nil {
			return // refused before any table is read
		}
		var slot slotRead
		tables.mu.Lock()
		v := tables.m[anchor.exporterKey()]
		slot, stable := v.read(i)
		alive := v.life == 0 || atomic.LoadUint32(lifelineWord(v.mem)) == v.life
		tables.mu.Unlock()
		got, u := vouch(changed, false)
		if got == tableVouched {
			settle(changed, u.record, false)
		}
		d, _ := changed.Digest()
		right := stable && slot.state == slotPublished && slot.regID == changed.RegID && slot.tag == grantTag(d) &&
			(slot.deadline == 0 || slot.deadline > monotonicNanos()) && (slot.uses == 0 || slot.spent < slot.uses) &&
			tableUsable(changed) && changed.exporterKey() == anchor.exporterKey() && alive
		if got == tableVouched && !right {
			t.Fatalf("vouched for slot %+v and ticket %s", slot, changed)
		}
		gt.mu.Lock()
		published := gt.owner[i] == tk.RegID // not when an older live grant has the slot (the anchor, every tableSlots)
		gt.mu.Unlock()
		if how&11 == 0 && published && got != tableVouched {
			t.Fatalf("a live grant's own ticket and slot: %v", got)
		}
		// A miss mapped from the file the table names (tablemiss.go) maps
		// the anchor's file or nothing.
		key := cacheKey{exporter: changed.exporterKey(), buffer: changed.BufferID, placement: hostPlacement}
		r, ok, err := importFromTable(changed, key, ImportOptions{OpenOptions: OpenOptions{Timeout: time.Second}}, false)
		if ok && err == nil {
			if !right {
				t.Fatalf("mapped from the table for slot %+v and ticket %s", slot, changed)
			}
			if err := verifyRef(r, 1); err != nil {
				t.Fatalf("the file mapped from the table: %v", err)
			}
			Unmap(r.ID, r.Base)
			// Its use is spent by the confirmer: wait, so that its record
			// is free again (a log of records waiting would send the next
			// iterations' hits to the exporter).
			confirmsAnswered(5 * time.Second)
		}
	})
}

// helperTableHit imports $VMMIPC_TEST_TICKET (the miss that brings the
// exporter's table and takes this process's spend log), then, per line on
// stdin: "vouch <ticket hex>" takes that grant's use on the table (the
// record written, as a table hit does before it returns) without the
// confirmation that would follow; "forge <ticket hex>" writes a record for
// it with a proof of another secret; "import <ticket hex> <seed>" imports
// it (bytes of pattern(seed)) and unmaps it. It answers each, then waits
// to be killed: what a receiver killed right after a table hit leaves.
func helperTableHit(t *testing.T, out *lineWriter) error {
	tk, err := ticketFromEnv()
	if err != nil {
		return err
	}
	if _, err := Import(tk, DeviceHost, ImportOptions{}, nil); err != nil {
		return err
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) < 2 {
			return fmt.Errorf("bad command %q", in.Text())
		}
		g := decodeTicketHex(t, f[1])
		switch f[0] {
		case "import":
			seed, _ := strconv.Atoi(f[len(f)-1])
			r, err := Import(g, DeviceHost, ImportOptions{}, nil)
			if err == nil {
				err = verifyAndUnmap(r, byte(seed))
			}
			info := GetCacheInfo()
			out.printf("imported code=%d table_hits=%d table_imports=%d %v", CodeOf(err), info.TableHits, info.TableImports, err)
		case "vouch":
			answer, _ := vouch(g, false)
			out.printf("vouched %d", answer)
		case "forge":
			tables.mu.Lock()
			v := tables.m[g.exporterKey()]
			if v == nil || v.log == nil {
				tables.mu.Unlock()
				return fmt.Errorf("no table or no log")
			}
			var other Secret
			other[0] = 1
			v.gen++
			writeRecord(v.log, spendRecords, g.RegID, spendProof(other, g.RegID), v.gen)
			tables.mu.Unlock()
			out.printf("forged")
		default:
			return fmt.Errorf("bad command %q", in.Text())
		}
	}
	select {}
}

// TestKilledAfterATableHitLeavesNothingPending: a receiver killed right
// after a table hit, before its confirmation, still spends the use: the
// exporter finds the record in the dead receiver's spend log. A record
// whose proof was not made with the grant's secret spends nothing.
func TestKilledAfterATableHitLeavesNothingPending(t *testing.T) {
	s := newTestServer(t)
	anchor := registerCounting(t, s, cacheSize, 24, RegisterOptions{Uses: 0}).tk
	hit := again(t, s, anchor, RegisterOptions{Uses: 1})
	forged := again(t, s, anchor, RegisterOptions{Uses: 1})
	r := startHelper(t, partTableHit, helperOpts{env: []string{envTicket + "=" + ticketHex(t, anchor)}})
	r.send("vouch " + ticketHex(t, hit))
	if got := r.expect("vouched ", 10*time.Second); got != fmt.Sprint(int(tableVouched)) {
		t.Fatalf("the receiver's table said %s, want %d (vouched)", got, tableVouched)
	}
	r.send("forge " + ticketHex(t, forged))
	r.expect("forged", 10*time.Second)
	s.reg.spends.mu.Lock()
	logs := len(s.reg.spends.logs)
	s.reg.spends.mu.Unlock()
	if logs != 1 {
		t.Fatalf("the exporter maps %d spend logs, want the receiver's 1", logs)
	}
	time.Sleep(2 * spendScanInterval)
	if err := s.Wait(hit, 0); err == nil {
		t.Fatal("the grant ended while its receiver lived: only its confirmation, or its death, spends it")
	}
	r.kill()
	if err := s.Wait(hit, 5*time.Second); err != nil {
		t.Fatalf("the dead receiver's table hit left its grant pending: %v", err)
	}
	time.Sleep(2 * spendScanInterval)
	if err := s.Wait(forged, 0); err == nil {
		t.Fatal("a record with a forged proof spent the grant")
	}
	s.reg.spends.mu.Lock()
	logs = len(s.reg.spends.logs)
	s.reg.spends.mu.Unlock()
	if logs != 0 {
		t.Fatalf("the dead receiver's log is still mapped (%d)", logs)
	}
}

// FuzzSpendLogDrain is a receiver's spend log in fuzzed bytes (records
// with fuzzed ids, proofs and claims, and some with real proofs of live
// grants, some of them opened to the exporter), read as a dead receiver's
// (drainExited) or harvested from a live one's (harvest): the exporter
// spends exactly the records whose id names a live grant that holds
// nothing and whose proof that grant's secret made, among those that
// nobody spent yet (dead) or that are open (live), marks each harvested
// record with what became of it, and reading the log never fails
// otherwise.
func FuzzSpendLogDrain(f *testing.F) {
	f.Add(make([]byte, spendLogSize), uint64(0))
	f.Add([]byte{1, 0, 0, 0, 0, 0, 0, 0}, uint64(0b101))
	f.Add([]byte("garbage everywhere"), uint64(1<<62-1))
	f.Add(make([]byte, spendLogSize), uint64(1<<63|0xffff_ffff))
	s := newTestServer(f)
	fd := newMemfd(f, 4096, pattern(4096, 1))
	defer unix.Close(fd)
	anchor := registerFile(f, s, fd, 4096, 4096, RegisterOptions{})
	f.Fuzz(func(t *testing.T, raw []byte, real uint64) {
		live := real>>63 != 0
		lfd, mem, err := newSpendLog()
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Munmap(mem)
		copy(mem[spendRecordSize:], raw) // the header stays; the records are fuzzed
		var grants []*Ticket
		want := map[uint64]bool{}
		for i := 1; i <= 8; i++ {
			opts := RegisterOptions{Uses: 1, Hold: real>>(32+i)&1 != 0}
			tk, err := s.RegisterAgain(anchor, opts)
			if err != nil {
				t.Fatal(err)
			}
			grants = append(grants, tk)
			if real>>i&1 != 0 { // a real record of it, at a fuzzed index
				at := 1 + int(real>>(8+3*i)&7)*7%spendRecords
				proof := spendProof(tk.Secret, tk.RegID)
				if real>>(16+i)&1 != 0 {
					proof[real%32] ^= 1 // not quite
				}
				writeRecord(mem, at, tk.RegID, proof, uint64(i))
				if real>>(40+i)&1 != 0 {
					openRecord(mem, at)
				}
			}
		}
		// What the log says once written: the records as they stand.
		before := map[int]uint64{}
		for i := 1; i <= spendRecords; i++ {
			id, proof, claim := readRecord(mem, i)
			before[i] = claim
			if id == 0 || (live && claimState(claim) != claimOpen) || (!live && !unspent(claim)) {
				continue
			}
			for _, tk := range grants {
				if p := spendProof(tk.Secret, tk.RegID); id == tk.RegID && proof == p && !tk.Holds {
					want[id] = true
				}
			}
		}
		var l spendLogs
		l.spend, l.published = s.reg.spendRecorded, func() bool { return true }
		start := uint64(1) // no process of ours, so "exited"
		if live {
			start = ourStartTime()
			atomic.AddUint64(word64(mem, logOpened), 1) // as a receiver that opened one
		}
		if !l.adopt(lfd, uint32(os.Getpid()), start) {
			t.Fatal("a well-made log was refused")
		}
		unix.Close(lfd)
		if live {
			l.harvest()
		} else {
			l.drainExited()
		}
		for _, tk := range grants {
			wait := time.Duration(0)
			if want[tk.RegID] {
				wait = 5 * time.Second // its release runs just after the spend
			}
			ended := s.Wait(tk, wait) == nil
			if ended != want[tk.RegID] {
				t.Fatalf("grant %d (holds %v, live %v): ended %v, want %v", tk.RegID, tk.Holds, live, ended, want[tk.RegID])
			}
			if !ended {
				s.Unregister(tk)
			}
		}
		for i := 1; live && i <= spendRecords; i++ { // what the receiver reads back
			id, _, claim := readRecord(mem, i)
			was := before[i]
			switch {
			case id == 0 || claimState(was) != claimOpen:
				if claim != was {
					t.Fatalf("record %d (not open) changed: %#x to %#x", i, was, claim)
				}
			case claim>>8 != was>>8 || claimState(claim) < claimLives:
				t.Fatalf("open record %d: claim %#x after the harvest (was %#x)", i, claim, was)
			}
		}
		l.close()
	})
}

// TestSpendLogsBoundedPerReceiver: an exporter takes at most
// maxSpendLogsPerPid logs of one receiver process (one that asks in a loop
// cannot take every other's room), and maxSpendLogs in all.
func TestSpendLogsBoundedPerReceiver(t *testing.T) {
	var l spendLogs
	l.spend, l.published = func(uint64, [32]byte, time.Duration) (bool, bool, *registration) { return false, false, nil }, func() bool { return false }
	defer l.close()
	take := func(pid uint32) bool {
		fd, mem, err := newSpendLog()
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		defer unix.Munmap(mem)
		return l.adopt(fd, pid, ourStartTime())
	}
	self := uint32(os.Getpid()) // alive, so never drained for room
	for i := range 10 {
		if got, want := take(self), i < maxSpendLogsPerPid; got != want {
			t.Fatalf("log %d of one receiver: taken %v, want %v", i, got, want)
		}
	}
	if take(0) {
		t.Fatal("a log whose owner cannot be told was taken")
	}
}

// TestGrantUsedUpByItsHits: a grant of two uses, hit twice in a row by
// this process, is used up for the third, every time: the second hit does
// not count the first one twice (TestUsesInFlightAreNotCountedTwice), and
// a hit the table cannot vouch for asks the exporter only after this
// process's table uses of the grant were answered.
func TestGrantUsedUpByItsHits(t *testing.T) {
	cacheTest(t)
	s := newTestServer(t)
	fd := newMemfd(t, 4096, pattern(4096, 3))
	defer unix.Close(fd)
	anchor := registerFile(t, s, fd, 4096, 4096, RegisterOptions{})
	r := importHost(t, anchor, ImportOptions{})
	defer Unmap(r.ID, r.Base)
	for i := range 200 {
		tk := again(t, s, anchor, RegisterOptions{Uses: 2})
		for use := 1; use <= 2; use++ {
			hr, err := Import(tk, DeviceHost, ImportOptions{}, nil)
			if err != nil {
				t.Fatalf("grant %d, use %d of 2: %v", i, use, err)
			}
			Unmap(hr.ID, hr.Base)
		}
		if _, err := Import(tk, DeviceHost, ImportOptions{}, nil); CodeOf(err) != ENOENT {
			t.Fatalf("grant %d, a third use of 2: %v, want ENOENT", i, err)
		}
	}
}

// TestConfirmKeepsOneDeadlineBehindItsTableHits: a confirmation, and a hit
// the table cannot vouch for, wait for this process's table hits of their
// ticket to be answered (a stopped exporter answers none), and that wait
// comes out of the call's one timeout, never on top of it.
func TestConfirmKeepsOneDeadlineBehindItsTableHits(t *testing.T) {
	cacheTest(t)
	sender, anchor, r, _ := mappedGrant(t, 28)
	defer Unmap(r.ID, r.Base)
	sender.send("again " + ticketHex(t, anchor) + " 2")
	grant := decodeTicketHex(t, sender.expect("ticket ", 10*time.Second))
	if err := unix.Kill(sender.pid(), unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer unix.Kill(sender.pid(), unix.SIGCONT)
	if !waitUntil(5*time.Second, func() bool { return stoppedProcess(sender.pid()) }) {
		t.Fatal("the sender did not stop")
	}
	for use := 1; use <= 2; use++ { // table hits: their spends wait
		hr, err := Import(grant, DeviceHost, ImportOptions{}, nil)
		if err != nil {
			t.Fatalf("table hit %d on a stopped exporter: %v", use, err)
		}
		Unmap(hr.ID, hr.Base)
	}
	const timeout = 400 * time.Millisecond
	opts := ImportOptions{OpenOptions: OpenOptions{Timeout: timeout}}
	for _, c := range []struct {
		what string
		call func() error
	}{
		{"a hit the table cannot vouch for (both uses in flight)", func() error {
			hr, err := Import(grant, DeviceHost, opts, nil)
			if err == nil {
				Unmap(hr.ID, hr.Base)
			}
			return err
		}},
		{"a confirmation", func() error { return Confirm(grant, opts) }},
	} {
		start := time.Now()
		err := c.call()
		if took := time.Since(start); err == nil || took > timeout+200*time.Millisecond {
			t.Fatalf("%s behind table hits that are not answered: %v after %v, want an error within %v", c.what, err, took, timeout)
		}
	}
}
