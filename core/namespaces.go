package core

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// A pid, a process start time and an abstract socket name mean something
// only inside one namespace: pids inside a PID namespace, start times
// inside a time namespace (the kernel shifts them by its boot-time offset),
// abstract names inside a network namespace. A ticket therefore records
// the exporter's namespaces, and a receiver uses each of those values only
// where it shares the namespace that gives it its meaning.

// Namespaces identifies the namespaces of a process: the device and inode
// numbers of its /proc/self/ns files (all live on one nsfs device). A zero
// field is unknown (/proc not mounted, or a kernel without time
// namespaces).
type Namespaces struct {
	Dev  uint64 // st_dev shared by every namespace file; 0 = all unknown
	PID  uint64 // inode of the PID namespace
	Net  uint64 // inode of the network namespace
	Time uint64 // inode of the time namespace
}

// nsRelation is how a ticket's namespace relates to ours.
type nsRelation int

const (
	nsUnknown nsRelation = iota // one side could not tell
	nsSame
	nsOther
)

// relate compares one namespace of the exporter's (ino, on device dev)
// with ours.
func relate(dev, ino, ourDev, ourIno uint64) nsRelation {
	switch {
	case dev == 0 || ino == 0 || ourDev == 0 || ourIno == 0:
		return nsUnknown
	case dev == ourDev && ino == ourIno:
		return nsSame
	}
	return nsOther
}

// pidNS, netNS and timeNS relate the exporter's namespaces n to ours.
func (n Namespaces) pidNS() nsRelation {
	us := selfNamespaces()
	return relate(n.Dev, n.PID, us.Dev, us.PID)
}

func (n Namespaces) netNS() nsRelation {
	us := selfNamespaces()
	return relate(n.Dev, n.Net, us.Dev, us.Net)
}

func (n Namespaces) timeNS() nsRelation {
	us := selfNamespaces()
	return relate(n.Dev, n.Time, us.Dev, us.Time)
}

// selfNamespaces returns this process's namespaces, read once. Its PID and
// time namespaces cannot change (setns and unshare of those kinds apply to
// the children it makes); a host that moves a thread into another network
// namespace after loading the library is not supported.
var selfNamespaces = sync.OnceValue(readNamespaces)

// readNamespaces stats /proc/self/ns/{pid,net,time}. A namespace file that
// lives on another device than the PID namespace's is not trusted.
func readNamespaces() Namespaces {
	stat := func(kind string) (dev, ino uint64) {
		var st unix.Stat_t
		if unix.Stat("/proc/self/ns/"+kind, &st) != nil {
			return 0, 0
		}
		return st.Dev, st.Ino
	}
	var n Namespaces
	n.Dev, n.PID = stat("pid")
	if n.Dev == 0 || n.PID == 0 {
		return Namespaces{}
	}
	for _, f := range []struct {
		kind string
		ino  *uint64
	}{{"net", &n.Net}, {"time", &n.Time}} {
		if dev, ino := stat(f.kind); dev == n.Dev {
			*f.ino = ino
		}
	}
	return n
}

// procShowsOurPIDs reports whether the /proc mounted here belongs to our
// PID namespace: /proc/self names us by the pid getpid returns. A /proc
// of another namespace (unshare --pid without --mount-proc) would answer
// for whatever process has a ticket's pid there.
func procShowsOurPIDs() bool {
	link, err := os.Readlink("/proc/self")
	return err == nil && link == strconv.Itoa(os.Getpid())
}

// overflowUIDNote explains a peer uid that is the kernel's overflow uid:
// the peer's uid has no mapping in our user namespace.
func overflowUIDNote(uid uint32) string {
	overflow := uint32(65534)
	if b, err := os.ReadFile("/proc/sys/kernel/overflowuid"); err == nil {
		if n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 32); err == nil {
			overflow = uint32(n)
		}
	}
	if uid != overflow {
		return ""
	}
	return fmt.Sprintf(" (uid %d is the kernel's overflow uid: the peer's uid does not map into this user namespace; run both sides with uids that map to the same user)", uid)
}
