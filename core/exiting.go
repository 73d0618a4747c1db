package core

import (
	"fmt"
	"os"
	"sync/atomic"
)

// exiting is set once the host says it is on its way out (vmmipc_exiting):
// registrations it ends from then on tell receivers that their exporter is
// exiting, not that its owner unregistered them, which a host ending its
// registrations at exit (Python's vmmipc does) would otherwise say.
var exiting atomic.Bool

// SetExiting records that this process is exiting.
func SetExiting() { exiting.Store(true) }

// unregisteredWhy is why a registration ended at Unregister.
func unregisteredWhy() string {
	if exiting.Load() {
		return fmt.Sprintf("has ended: its exporter (pid %d) is exiting (an exporter must stay until its receivers have imported: wait for them, e.g. vmmipc_wait or HostBuffer.wait())", os.Getpid())
	}
	return "was unregistered by its owner"
}
