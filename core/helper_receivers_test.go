package core

import (
	"os"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Helpers on the receiver's side: processes that pull or import a ticket
// under what the test process cannot take on itself (a tight limit, an
// environment variable read once) and report what they got.

// helperReceiver opens VMMIPC_TEST_TICKET, pulls VMMIPC_TEST_STOP_AT chunks
// (closing each descriptor), says "at <n>" and waits to be killed; with a
// negative stop it pulls everything and says "ok".
func helperReceiver(out *lineWriter) error {
	tk, err := ticketFromEnv()
	if err != nil {
		return err
	}
	stopAt, _ := strconv.Atoi(os.Getenv(envStopAt))
	s, err := Open(tk, OpenOptions{Timeout: 10 * time.Second})
	if err != nil {
		return err
	}
	for n := 0; ; n++ {
		if n == stopAt {
			out.printf("at %d", n)
			select {}
		}
		ch, err := s.Next()
		if IsEnd(err) {
			out.printf("ok")
			return nil
		}
		if err != nil {
			return err
		}
		unix.Close(ch.FD)
	}
}

// helperOpener tries VMMIPC_TEST_TICKET twice: with Open, reporting
// "open code=<status>", and with a raw socket sending a well-formed hello,
// reporting "raw code=<status of the error message, 0 if none> fds=<n>".
func helperOpener(out *lineWriter) error {
	tk, err := ticketFromEnv()
	if err != nil {
		return err
	}
	s, err := Open(tk, OpenOptions{Timeout: 5 * time.Second})
	if err == nil {
		s.Close()
	}
	out.printf("open code=%d", CodeOf(err))
	fd, err := rawDial(tk.Address)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	nr, _ := newNonce()
	_ = rawWrite(fd, helloMsg{RegID: tk.RegID, Nonce: nr}.encode())
	r := rawReadAll(fd, 5*time.Second)
	msgs, _ := splitMessages(r.Data)
	code := 0
	if m, ok := lastError(msgs); ok {
		code = int(m.Code)
	}
	out.printf("raw code=%d fds=%d", code, len(r.FDAt))
	return nil
}

// helperCacheEnv registers a memfd of 16 pages with a server of its own,
// imports it once with VMMIPC_CACHE_BYTES as the test set it, and reports
// "import code=<status> <message>" and, after unmapping, "cache limit=<n>
// entries=<n>".
func helperCacheEnv(t *testing.T, out *lineWriter) error {
	s, err := NewServer("")
	if err != nil {
		return err
	}
	fd := newMemfd(t, 16*4096, pattern(16*4096, 4))
	tk := registerFile(t, s, fd, 16*4096, 4096, RegisterOptions{})
	unix.Close(fd)
	r, err := Import(tk, DeviceHost, ImportOptions{}, nil)
	out.printf("import code=%d %v", CodeOf(err), err)
	if err == nil {
		if err := verifyAndUnmap(r, 4); err != nil {
			return err
		}
	}
	info := GetCacheInfo()
	out.printf("cache limit=%d entries=%d", info.LimitBytes, info.Entries)
	return nil
}

// helperAddrSpace lowers its own soft RLIMIT_AS to 1 GiB above what it uses
// and reports what checkAddressSpace and Import say for sizes that fit and
// that do not: "check <bytes> code=<status> <message>", then for a 2 GiB
// import "import code=<status> fds=<before>/<after> maps=<n> <message>",
// and "retry code=<status>" for the same import once the limit is back.
func helperAddrSpace(t *testing.T, out *lineWriter) error {
	s, err := NewServer("")
	if err != nil {
		return err
	}
	const big = 2 << 30
	fd := newMemfd(t, big, nil) // sparse: takes no memory
	tk := registerFile(t, s, fd, big, 64<<20, RegisterOptions{Uses: 1})
	unix.Close(fd)

	var saved unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_AS, &saved); err != nil {
		return err
	}
	used, err := addressSpaceInUse()
	if err != nil {
		return err
	}
	tight := saved
	tight.Cur = used + 1<<30
	if err := unix.Setrlimit(unix.RLIMIT_AS, &tight); err != nil {
		return err
	}
	for _, need := range []uint64{64 << 20, big} {
		err := checkAddressSpace(need, "import", " or import less at a time")
		out.printf("check %d code=%d %v", need, CodeOf(err), err)
	}
	before := ourFDs().settled(t)
	_, err = Import(tk, DeviceHost, ImportOptions{}, nil)
	after := ourFDs().settled(t) // the server's end of the session closes asynchronously
	maps, _ := memfdMappings(t)
	out.printf("import code=%d fds=%d/%d maps=%d %v", CodeOf(err), before, after, maps, err)
	if err := unix.Setrlimit(unix.RLIMIT_AS, &saved); err != nil {
		return err
	}
	r, err := Import(tk, DeviceHost, ImportOptions{}, nil)
	if err == nil {
		err = Unmap(r.ID, r.Base)
	}
	out.printf("retry code=%d %v", CodeOf(err), err)
	return nil
}
