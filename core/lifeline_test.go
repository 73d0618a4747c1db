package core

import (
	"fmt"
	"os"
	"slices"
	"sync/atomic"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// lifelineOfExporter is the lifeline word of tk's exporter's table as this
// process has it mapped (it must be).
func lifelineOfExporter(t *testing.T, tk *Ticket) (now, life uint32) {
	t.Helper()
	tables.mu.Lock()
	defer tables.mu.Unlock()
	v := tables.m[tk.exporterKey()]
	if v == nil {
		t.Fatal("no table of that exporter is mapped here")
	}
	return atomic.LoadUint32(lifelineWord(v.mem)), v.life
}

// TestLifelineOfAServer: a server's table holds the lifeline thread's tid,
// under an entry of its robust list on the private page before the table;
// Close marks the word (as the kernel would at the exporter's end) and
// takes the entry off the list before the page goes.
func TestLifelineOfAServer(t *testing.T) {
	s := newTestServer(t)
	fd, _, err := s.reg.table.readOnly() // what a receiver gets
	if err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(fd, 0, tableSize, unix.PROT_READ, unix.MAP_SHARED)
	unix.Close(fd)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	tid := lifelineTID()
	if tid == 0 {
		t.Skip("set_robust_list is refused here: tables have no lifeline")
	}
	if life, ok := lifelineOf(mem); !ok || life != tid {
		t.Fatalf("the lifeline word: %#x (ok %v), want the thread's tid %d", life, ok, tid)
	}
	entry := (*uintptr)(unsafe.Pointer(&s.reg.table.region[0]))
	if uintptr(unsafe.Pointer(&s.reg.table.mem[tableLifeline]))-uintptr(unsafe.Pointer(entry)) != uintptr(lifeline.head.futexOffset) {
		t.Fatal("the entry is not at the list's futex offset before its word")
	}
	if !linked(t, entry) {
		t.Fatal("the table's entry is not on the robust list")
	}
	s.Close()
	if _, ok := lifelineOf(mem); ok {
		t.Fatalf("after Close the lifeline word is %#x, want FUTEX_OWNER_DIED", atomic.LoadUint32(lifelineWord(mem)))
	}
	if linked(t, entry) {
		t.Fatal("a closed table's entry is still on the robust list")
	}
}

// linked walks the robust list as the kernel would (from the head, by each
// entry's next, to the head again) and reports whether it meets entry; it
// fails t where the list and its Go record disagree.
func linked(t *testing.T, entry *uintptr) bool {
	t.Helper()
	lifeline.mu.Lock()
	defer lifeline.mu.Unlock()
	head := uintptr(unsafe.Pointer(&lifeline.head))
	next := lifeline.head.next
	for _, e := range lifeline.entries {
		if next != uintptr(unsafe.Pointer(e)) {
			t.Fatal("the robust list and lifeline.entries disagree")
		}
		next = *e
	}
	if next != head {
		t.Fatal("the robust list does not end at its head")
	}
	return slices.Contains(lifeline.entries, entry)
}

// TestLifelineMarkedByTheKernel: the kernel marks the lifeline word of an
// exporter that is killed (SIGKILL: nothing of ours runs) and of one that
// execs (same pid and start time: only its image ended), and a table hit
// on its grant is refused then, without /proc.
func TestLifelineMarkedByTheKernel(t *testing.T) {
	for _, end := range []string{"kill", "exec"} {
		t.Run(end, func(t *testing.T) {
			cacheTest(t)
			sender, anchor, r, grant := mappedGrant(t, 27)
			defer Unmap(r.ID, r.Base)
			now, life := lifelineOfExporter(t, anchor)
			if life == 0 || now != life {
				t.Skipf("the exporter's table has no lifeline (word %#x)", now)
			}
			if end == "kill" {
				sender.kill()
			} else {
				sender.send("exec sender")
				sender.expect("serving ", faultTimeout)
			}
			if now, _ := lifelineOfExporter(t, anchor); now&futexOwnerDied == 0 {
				t.Fatalf("after %s the lifeline word is %#x, want FUTEX_OWNER_DIED", end, now)
			}
			before := GetCacheInfo()
			if _, err := Import(grant, DeviceHost, ImportOptions{}, nil); CodeOf(err) != EIO {
				t.Fatalf("a hit on the grant of an exporter that ended (%s): %v, want EIO", end, err)
			}
			if GetCacheInfo().TableHits != before.TableHits {
				t.Fatal("the table vouched for a hit after the exporter ended")
			}
		})
	}
}

// TestLifelineTakenOnlyFromTheExporter: a receiver believes a table's
// lifeline only when its word names a thread of the exporter's process
// (/proc/<pid>/task, read once, when it takes the table); else it looks in
// /proc on each hit, as without one. A table whose lifeline is marked
// already is not taken.
func TestLifelineTakenOnlyFromTheExporter(t *testing.T) {
	s := newTestServer(t)
	tid := lifelineTID()
	if tid == 0 {
		t.Skip("set_robust_list is refused here: tables have no lifeline")
	}
	take := func(pid int) (life uint32, err error) {
		t.Helper()
		rfd, own, err := s.reg.table.readOnly()
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(rfd)
		key := fmt.Sprintf("lifeline-test-%d", pid)
		if err = takeTable(key, rfd, pid, uint64(own)); err != nil {
			return 0, err
		}
		tables.mu.Lock()
		defer tables.mu.Unlock()
		v := tables.m[key]
		life = v.life
		v.unmap()
		delete(tables.m, key)
		return life, nil
	}
	if life, err := take(os.Getpid()); err != nil || life != tid {
		t.Fatalf("the exporter's own table: life %d (%v), want its lifeline's tid %d", life, err, tid)
	}
	if life, err := take(os.Getppid()); err != nil || life != 0 {
		t.Fatalf("a table said to be another process's: life %d (%v), want 0 (/proc tells)", life, err)
	}
	rfd, own, err := s.reg.table.readOnly()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(rfd)
	s.Close() // marks the word
	if err := takeTable("lifeline-test-closed", rfd, os.Getpid(), uint64(own)); CodeOf(err) != EIO {
		t.Fatalf("a table whose lifeline is marked: %v, want EIO (not taken)", err)
	}
	if tableMappedAt("lifeline-test-closed") {
		t.Fatal("a table whose lifeline is marked was taken")
	}
}

func tableMappedAt(key string) bool {
	tables.mu.Lock()
	defer tables.mu.Unlock()
	return tables.m[key] != nil
}

// TestLifelinesBounded: beyond maxLifelines tables on the robust list, a
// new table's word stays 0 (no lifeline: its receivers look in /proc), and
// nothing is linked for it.
func TestLifelinesBounded(t *testing.T) {
	if lifelineTID() == 0 {
		t.Skip("set_robust_list is refused here: tables have no lifeline")
	}
	lifeline.mu.Lock()
	n := len(lifeline.entries)
	lifeline.mu.Unlock()
	defer func(m int) { maxLifelines = m }(maxLifelines)
	maxLifelines = n
	s := newTestServer(t)
	if !s.reg.table.ready() {
		t.Fatal(s.reg.table.err)
	}
	if life, ok := lifelineOf(s.reg.table.mem); life != 0 || !ok {
		t.Fatalf("a table beyond the bound: lifeline word %#x, want 0", life)
	}
	if linked(t, (*uintptr)(unsafe.Pointer(&s.reg.table.region[0]))) {
		t.Fatal("a table beyond the bound is on the robust list")
	}
}
