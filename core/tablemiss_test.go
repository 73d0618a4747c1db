package core

import (
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A miss that the grant table vouches for (tablemiss.go): host memory new
// to this process, mapped from the file the exporter's table names.

// registerPattern registers a memfd of pattern(seed) as a plain host file
// (its exporter FileBacked: the table names its file) with opts.
func registerPattern(t *testing.T, s *Server, size int, seed byte, opts RegisterOptions) *Ticket {
	t.Helper()
	fd := newMemfd(t, size, pattern(size, seed))
	defer unix.Close(fd)
	return registerFile(t, s, fd, uint64(size), 4096, opts)
}

// newBufferOfATable starts a test server whose table this process has (an
// anchor of pattern(seed) imported, unmapped when the test ends) and
// registers a new buffer of pattern(seed+1) there for one use: what a
// table import takes. before is the cache's counts from the start.
func newBufferOfATable(t *testing.T, seed byte) (before CacheInfo, s *Server, anchor, tk *Ticket) {
	t.Helper()
	before = cacheTest(t)
	s = newTestServer(t)
	anchor, first := tableGrant(t, s, seed)
	t.Cleanup(func() { unmapRef(t, first) })
	return before, s, anchor, registerPattern(t, s, cacheSize, seed+1, RegisterOptions{Uses: 1})
}

func tableImports(before CacheInfo) uint64 { return GetCacheInfo().TableImports - before.TableImports }

// importPattern imports tk, checks its bytes (pattern(seed)) and that
// tableImports(before) is then want, and unmaps it.
func importPattern(t *testing.T, tk *Ticket, seed byte, before CacheInfo, want uint64, what string) {
	t.Helper()
	r, err := Import(tk, DeviceHost, ImportOptions{}, nil)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if n := tableImports(before); n != want {
		t.Fatalf("%s: %d misses mapped from the table's file, want %d", what, n, want)
	}
	if err := verifyRef(r, seed); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	unmapRef(t, r)
}

// TestMissFromTheTable: once this process has the exporter's table, a new
// buffer of it is mapped from the file the table names: its bytes, no
// descriptor left open, its use spent just after; a held registration's,
// and one that ended, are not (they stream, and the exporter answers).
func TestMissFromTheTable(t *testing.T) {
	before, s, _, tk := newBufferOfATable(t, 51)
	fds := ourFDs().now(t) // the exporter's duplicate of the file included, until the buffer ends
	r, err := Import(tk, DeviceHost, ImportOptions{}, nil)
	if err != nil {
		t.Fatalf("a new buffer of an exporter whose table is here: %v", err)
	}
	if n := tableImports(before); n != 1 {
		t.Fatalf("%d misses mapped from the table's file, want 1", n)
	}
	if err := verifyRef(r, 52); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(tk, 5*time.Second); err != nil {
		t.Fatalf("its use was not spent: %v", err)
	}
	unmapRef(t, r)
	if n := ourFDs().now(t); n > fds {
		t.Fatalf("%d descriptors after the import, %d before", n, fds)
	}

	held := registerPattern(t, s, cacheSize, 53, RegisterOptions{Uses: 1, Hold: true})
	importPattern(t, held, 53, before, 1, "a held grant (it streams)")
	ended := registerPattern(t, s, cacheSize, 54, RegisterOptions{Uses: 1})
	if err := s.Unregister(ended); err != nil {
		t.Fatal(err)
	}
	if _, err := Import(ended, DeviceHost, ImportOptions{}, nil); CodeOf(err) != ENOENT {
		t.Fatalf("an ended grant: %v, want ENOENT", err)
	}
	if n := tableImports(before); n != 1 {
		t.Fatalf("%d misses mapped from the table's file, want still 1 (an ended grant streams)", n)
	}
}

// TestMissFromTheTableChecksTheFile: a file entry that names another file
// than the one opened (a descriptor number handed out again, here a
// changed inode) is no table import: the buffer streams, with its own
// bytes, and nothing is left mapped or taken.
func TestMissFromTheTableChecksTheFile(t *testing.T) {
	before, s, _, tk := newBufferOfATable(t, 55)
	gt := &s.reg.table
	ino := word64(gt.mem, fileEntry(slotIndex(tk.RegID))+fileIno)
	atomic.AddUint64(ino, 1)
	importPattern(t, tk, 56, before, 0, "a buffer whose table entry names another file (it streams)")
	if err := s.Wait(tk, 5*time.Second); err != nil {
		t.Fatalf("the streamed use was not spent: %v", err)
	}
}

// TestMissFromTheTableOfAnotherProcess: the file of another process's
// buffer is opened through /proc as well (the kernel allows it to a
// process that may read that exporter's memory: its uid, or root; a
// non-dumpable exporter's only to root); an entry naming a descriptor the
// exporter has not open is no table import: the buffer streams.
func TestMissFromTheTableOfAnotherProcess(t *testing.T) {
	before := cacheTest(t)
	sender, _, first := mappedSender(t, 57)
	defer unmapRef(t, first)
	sender.send("file 65536 58")
	tk := decodeTicketHex(t, sender.expect("ticket ", 10*time.Second))
	importPattern(t, tk, 58, before, 1, "another process's file")

	s := newTestServer(t)
	_, mine := tableGrant(t, s, 59)
	defer unmapRef(t, mine)
	closed := registerPattern(t, s, cacheSize, 60, RegisterOptions{Uses: 1})
	fd := word32(s.reg.table.mem, fileEntry(slotIndex(closed.RegID))+fileFD)
	atomic.StoreUint32(fd, 1<<20) // a descriptor nobody has open
	importPattern(t, closed, 60, before, 1, "a buffer whose table entry names no open descriptor (it streams)")
}

// TestMissFromTheTableRefusesWhatAStreamWould: a file entry that names,
// with its true identity, a file a stream's descriptor would be refused
// for (as a hostile exporter could name one: an unsealed memfd that could
// shrink under the mapping, one too small for the buffer) is no table
// import: the buffer streams, with its own bytes, and nothing of the named
// file stays mapped.
func TestMissFromTheTableRefusesWhatAStreamWould(t *testing.T) {
	before := cacheTest(t)
	s := newTestServer(t)
	_, first := tableGrant(t, s, 61)
	defer unmapRef(t, first)
	unsealed, err := unix.MemfdCreate(testMemfdName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(unsealed)
	if err := unix.Ftruncate(unsealed, cacheSize); err != nil {
		t.Fatal(err)
	}
	small := newMemfd(t, 4096, pattern(4096, 63)) // sealed against shrinking
	defer unix.Close(small)
	for i, c := range []struct {
		what string
		fd   int
	}{{"an unsealed memfd", unsealed}, {"a memfd smaller than the buffer", small}} {
		seed := byte(64 + i)
		tk := registerPattern(t, s, cacheSize, seed, RegisterOptions{Uses: 1})
		var st unix.Stat_t
		if err := unix.Fstat(c.fd, &st); err != nil {
			t.Fatal(err)
		}
		fe := fileEntry(slotIndex(tk.RegID))
		mem := s.reg.table.mem
		atomic.StoreUint32(word32(mem, fe+fileFD), uint32(c.fd+1))
		atomic.StoreUint64(word64(mem, fe+fileDev), st.Dev)
		atomic.StoreUint64(word64(mem, fe+fileIno), st.Ino)
		importPattern(t, tk, seed, before, 0, "a table entry naming "+c.what+" (it streams)")
	}
	expectMapped(t, "after the refused files", cacheSize) // the first mapping alone
}

// TestTwoProcessesTakeTheLastUseOfANewBuffer: TestTwoProcessesHitTheLastUse
// for a buffer new to this process. Another receiver took the grant's only
// use on the table (not spent yet); this process maps the buffer from the
// table's file all the same (the header says so: each could read the
// exporter's memory anyway), its spend comes first, its confirmation does
// not fail, and the exporter spends the use once.
func TestTwoProcessesTakeTheLastUseOfANewBuffer(t *testing.T) {
	before, s, anchor, tk := newBufferOfATable(t, 55)
	other, ours := otherTookTheUse(t, s, anchor, tk)
	importPattern(t, tk, 56, before, 1, "this process's import of a use another process took")
	spentOnce(t, s, tk, other, ours)
	if got := cacheDelta(before); got.ConfirmsFailed != 0 {
		t.Fatalf("%d failed confirmations, want 0", got.ConfirmsFailed)
	}
}

// TestNonDumpableExporterIsAskedForNewBuffers: an exporter that made itself
// non-dumpable (PR_SET_DUMPABLE 0, as setuid programs are) hides
// /proc/<pid>/fd from receivers without CAP_SYS_PTRACE, its own uid
// included: no file can be opened through it, so first imports stream,
// with the right bytes; hits need no /proc (the table's lifeline tells
// that the exporter lives) and the table vouches for them all the same.
// Dumpable again, it gets table imports again. Both run as root without
// CAP_SYS_PTRACE (setpriv: the kernel also refuses a receiver whose
// capabilities are not a superset of the exporter's).
func TestNonDumpableExporterIsAskedForNewBuffers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: both helpers run as this uid without CAP_SYS_PTRACE, which setpriv drops")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Skip("needs setpriv (util-linux) to start the helpers without CAP_SYS_PTRACE")
	}
	noPtrace := []string{setpriv, "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace", "--"}
	sender := startHelper(t, partSender, helperOpts{wrap: noPtrace})
	newBuffer := func(seed byte) *Ticket {
		sender.send(fmt.Sprintf("file %d %d", cacheSize, seed))
		return decodeTicketHex(t, sender.expect("ticket ", 10*time.Second))
	}
	dumpable := func(on int) {
		sender.send("dumpable " + strconv.Itoa(on))
		sender.expect("dumpable ", 10*time.Second)
	}
	anchor := newBuffer(57)
	r := startHelper(t, partTableHit, helperOpts{env: []string{envTicket + "=" + ticketHex(t, anchor)}, wrap: noPtrace})
	defer r.kill()
	imported := func(tk *Ticket, seed byte) (hits, imports int) {
		t.Helper()
		r.send("import " + ticketHex(t, tk) + " " + strconv.Itoa(int(seed)))
		got := r.expect("imported ", 10*time.Second)
		if _, err := fmt.Sscanf(got, "code=0 table_hits=%d table_imports=%d", &hits, &imports); err != nil {
			t.Fatalf("the receiver's import: %s", got)
		}
		return hits, imports
	}
	dumpable(0)
	if hits, imports := imported(sender.grant(anchor), 57); hits != 1 || imports != 0 {
		t.Fatalf("a hit on a non-dumpable exporter: %d table hits, %d table imports; want 1 and 0", hits, imports)
	}
	if hits, imports := imported(newBuffer(58), 58); hits != 1 || imports != 0 {
		t.Fatalf("a new buffer of a non-dumpable exporter: %d table hits, %d table imports; want still 1 and 0 (streamed)", hits, imports)
	}
	dumpable(1)
	if _, imports := imported(newBuffer(59), 59); imports != 1 {
		t.Fatalf("dumpable again: %d table imports, want 1", imports)
	}
}
