package core

import (
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The exporter's lifeline: a word in the header of its grant table that
// the kernel marks when the exporter's image ends, so that a table hit
// tells a live exporter from a dead one with one load, where it read
// /proc/<pid>/fd/<n> on every hit. (The pid's start time and state are
// still read every 50 ms: a killed exporter is a zombie a moment before
// this thread, still ending, marks the word.)
//
// How: one thread of ours, which never returns, registers a robust futex
// list (set_robust_list) whose entries are the words of our tables, each
// holding that thread's tid. When a thread ends, the kernel walks its
// robust list and sets FUTEX_OWNER_DIED in each word that holds its tid:
// at exit and on SIGKILL (before the process is a zombie), and at an exec,
// which ends every other thread first. This is what robust futexes exist
// for (a lock held by a process that died), and it needs nothing of the
// exporter's /proc/<pid>/fd, which a non-dumpable exporter hides (a
// receiver reads /proc/<pid>/task once, when it takes the table).
// Nothing else writes the word: the
// table is sealed against writing but for the exporter's own mapping,
// which a forked child does not inherit (MADV_DONTFORK), and a forked
// child's thread runs no list of ours. The server's Close marks it too.
//
// Every entry sits at the same distance before its word (the kernel knows
// one futex offset per list): on a private page mapped just before the
// table (mapTable), so that no address of ours is in what receivers read.
// A word of 0 means no lifeline (set_robust_list refused, as a seccomp
// filter might): receivers then look in /proc as before.

const (
	tableLifeline  = 16         // u32 in the header slot: the lifeline thread's tid; futexOwnerDied once it ended
	futexOwnerDied = 0x40000000 // FUTEX_OWNER_DIED, as the kernel sets it
)

// maxLifelines bounds the tables on the list at once: the kernel walks at
// most 2048 entries (ROBUST_LIST_LIMIT). A process has one server; tests,
// a few at once. A variable for tests.
var maxLifelines = 1024

// robustListHead is the kernel's struct robust_list_head.
type robustListHead struct {
	next          uintptr // the first entry; the head's own address when empty
	futexOffset   int     // from an entry to its word
	listOpPending uintptr
}

var lifeline struct {
	once sync.Once
	tid  uint32 // the thread's; 0 when it could not register its list

	mu      sync.Mutex
	head    robustListHead // a global: it never moves
	entries []*uintptr     // in list order: entries[0] follows the head
}

// lifelineTID starts the lifeline thread once and returns its tid (0: none).
func lifelineTID() uint32 {
	lifeline.once.Do(func() {
		h := &lifeline.head
		h.next = uintptr(unsafe.Pointer(h))
		h.futexOffset = os.Getpagesize() + tableLifeline
		tid := make(chan uint32)
		go func() {
			// Never unlocked, and the goroutine never returns while the
			// list is registered: the thread ends only with the process.
			runtime.LockOSThread()
			_, _, e := unix.RawSyscall(unix.SYS_SET_ROBUST_LIST, uintptr(unsafe.Pointer(h)), unsafe.Sizeof(*h), 0)
			if e != 0 {
				tid <- 0
				return
			}
			tid <- uint32(unix.Gettid())
			select {}
		}()
		lifeline.tid = <-tid
	})
	return lifeline.tid
}

// mapTable maps size bytes of the table fd writable, just after a private
// page that holds its lifeline entry: region is both (for munmap), mem the
// table.
func mapTable(fd, size int) (region, mem []byte, err error) {
	page := os.Getpagesize()
	region, err = unix.Mmap(-1, 0, page+size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, nil, err
	}
	_, _, e := unix.Syscall6(unix.SYS_MMAP, uintptr(unsafe.Pointer(&region[page])), uintptr(size),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED, uintptr(fd), 0)
	if e != 0 {
		_ = unix.Munmap(region)
		return nil, nil, e
	}
	return region, region[page:], nil
}

// linkLifeline puts the word of a table mapped by mapTable under the
// lifeline, before the table is handed out: the word holds the thread's
// tid, and its entry is first in the list. Beyond maxLifelines the word
// stays 0 (no lifeline).
func linkLifeline(region []byte) {
	tid := lifelineTID()
	if tid == 0 {
		return
	}
	entry := (*uintptr)(unsafe.Pointer(&region[0]))
	lifeline.mu.Lock()
	defer lifeline.mu.Unlock()
	if len(lifeline.entries) >= maxLifelines {
		return
	}
	atomic.StoreUint32(lifelineWord(region[os.Getpagesize():]), tid)
	*entry = atomic.LoadUintptr(&lifeline.head.next)
	atomic.StoreUintptr(&lifeline.head.next, uintptr(unsafe.Pointer(entry)))
	lifeline.entries = append([]*uintptr{entry}, lifeline.entries...)
}

// unlinkLifeline marks the word ended (the server closed) and takes its
// entry off the list, before the region is unmapped: at the process's end
// the kernel reads only mapped entries.
func unlinkLifeline(region []byte) {
	atomic.StoreUint32(lifelineWord(region[os.Getpagesize():]), futexOwnerDied)
	entry := (*uintptr)(unsafe.Pointer(&region[0]))
	lifeline.mu.Lock()
	defer lifeline.mu.Unlock()
	for i, e := range lifeline.entries {
		if e != entry {
			continue
		}
		prev := &lifeline.head.next
		if i > 0 {
			prev = lifeline.entries[i-1]
		}
		atomic.StoreUintptr(prev, *entry)
		lifeline.entries = append(lifeline.entries[:i], lifeline.entries[i+1:]...)
		return
	}
}

// lifelineOf reads a receiver's view of the word when it takes the table:
// the tid to find there on every hit, 0 for none (look in /proc), or
// ok false when the exporter has ended already.
func lifelineOf(mem []byte) (life uint32, ok bool) {
	w := atomic.LoadUint32(lifelineWord(mem))
	return w, w&futexOwnerDied == 0
}

// lifelineWord is the word in a mapping of a table.
func lifelineWord(mem []byte) *uint32 { return (*uint32)(unsafe.Pointer(&mem[tableLifeline])) }
