//go:debug containermaxprocs=0
//go:debug updatemaxprocs=0

// Command export builds libvmmipc.so (go build -buildmode=c-shared). It is the
// only package with //export: shims that translate C arguments, call core or
// cuda, and turn errors into status codes. Every rule (bounds, validation,
// device choice) lives in core or cuda. The public vmmipc_* symbols are the
// C wrappers in abi.c, which refuse calls after fork() before entering Go;
// the vmmipcgo_* exports below stay hidden (see vmmipc.map).
package main

/*
#include <stdlib.h>
#include "abi.h"
*/
import "C"

import (
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/libvmmipc/libvmmipc/core"
	"github.com/libvmmipc/libvmmipc/cuda"
)

func main() {}

// removeAtExit hands the default server's files to abi.c once.
var removeAtExit sync.Once

// init runs after the syscall package's init, which raised the host's soft
// RLIMIT_NOFILE; it puts the limit back (through syscall.Setrlimit, which
// also drops Go's record of the "original" limit) and lets abi.c's loading
// constructor return. See abi.c for the whole story.
func init() {
	var cur, max C.ulonglong
	var ok C.int
	C.vmmipc_abi_saved_nofile(&cur, &max, &ok)
	if ok != 0 {
		_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: uint64(cur), Max: uint64(max)})
	}
	C.vmmipc_abi_set_runtime_headroom(C.ulonglong(core.RuntimeHeadroom))
	C.vmmipc_abi_go_init_done()
}

//export vmmipcgo_options_init
func vmmipcgo_options_init(opts *C.vmmipc_options, size C.size_t) C.int {
	return call("vmmipc_options_init", func() error {
		if opts == nil {
			return core.Errorf(core.EINVAL, "vmmipc_options_init: opts is NULL: pass the address of a vmmipc_options (vmmipc_options o; vmmipc_options_init(&o, sizeof o))")
		}
		// The least we fill is struct_size and uses: a struct without uses
		// would read as uses = 0, "unlimited" (see vmmipc.h).
		if least := unsafe.Offsetof(opts.ttl_ms); uintptr(size) < least {
			return core.Errorf(core.EINVAL, "vmmipc_options_init: size is %d, smaller than the %d bytes of struct_size and uses, the least this library fills: pass sizeof *opts", uint64(size), least)
		}
		// Fill a full struct of ours, then copy only what the caller's holds.
		o := defaultOptions()
		d := C.vmmipc_options{uses: C.uint32_t(o.uses), timeout_ms: C.uint32_t(core.DefaultTimeout.Milliseconds()), memory_kind: C.uint32_t(o.kind)}
		opts.struct_size = C.uint32_t(copyOut(opts, &d, size)) // within size: checked above
		return nil
	})
}

// exportCallback calls a C export_fn.
type exportCallback struct {
	export C.vmmipc_export_fn
	user   C.uintptr_t // see releaseCallback
}

func (e *exportCallback) ExportChunk(index uint64) (int, uint64, error) {
	fd := C.int(-1)
	if rc := C.vmmipc_abi_call_export(e.export, e.user, C.uint64_t(index), &fd); rc != 0 {
		return -1, 0, core.Errorf(core.EEXPORT, "export_fn returned %d", int(rc))
	}
	return int(fd), 0, nil
}

func (e *exportCallback) Release() {}

// releaseCallback makes a C release_fn a Go func (nil for NULL). user is
// the caller's opaque void *, carried as an integer: callers pass any value
// there (Python passes a small key), and a Go pointer-typed variable
// holding a value that is not a valid pointer makes the runtime abort
// ("invalid pointer found on stack") when it moves the goroutine's stack.
// abi.c converts it on the way in and the trampolines on the way out.
func releaseCallback(fn C.vmmipc_release_fn, user C.uintptr_t) func() {
	if fn == nil {
		return nil
	}
	return func() { C.vmmipc_abi_call_release(fn, user) }
}

// registerArgs reads the options of a register call, checks ticket_out and
// copies its arrays of count uint64s (vmmipc_register: sizes;
// vmmipc_register_cuda_handles: handles, sizes), named in messages by names.
func registerArgs(fn string, opts *C.vmmipc_options, out *C.vmmipc_ticket, count C.uint64_t, names []string, arrays ...*C.uint64_t) (options, [][]uint64, error) {
	o, err := readOptions(opts)
	if err == nil && out == nil {
		err = core.Errorf(core.EINVAL, "%s: ticket_out is NULL", fn)
	}
	if err == nil && len(arrays) > 0 {
		err = core.CheckCount(uint64(count), fn) // before any array is read: count 0 may come with NULL arrays
	}
	copies := make([][]uint64, len(arrays))
	for i, p := range arrays {
		if err == nil {
			copies[i], err = u64s(p, count, fn+": "+names[i])
		}
	}
	return o, copies, err
}

// startServer returns this process's server, started on first use, with
// its socket directory's files removed at exit.
func startServer() (*core.Server, error) {
	srv, err := core.DefaultServer()
	if err != nil {
		return nil, err
	}
	removeAtExit.Do(func() {
		if dirfd, names := srv.DirFiles(); dirfd >= 0 && len(names) == 2 {
			sock, lock := C.CString(names[0]), C.CString(names[1])
			C.vmmipc_abi_remove_at_exit(C.int(dirfd), sock, lock)
			C.free(unsafe.Pointer(sock))
			C.free(unsafe.Pointer(lock))
		}
	})
	return srv, nil
}

// register registers spec with this process's server and writes the ticket.
func register(spec core.BufferSpec, o core.RegisterOptions, out *C.vmmipc_ticket) error {
	srv, err := startServer()
	if err != nil {
		return err
	}
	t, err := srv.Register(spec, o)
	if err != nil {
		return err
	}
	return writeTicket(t, out)
}

//export vmmipcgo_register
func vmmipcgo_register(sizes *C.uint64_t, count C.uint64_t, exportFn C.vmmipc_export_fn, releaseFn C.vmmipc_release_fn, user C.uintptr_t, opts *C.vmmipc_options, ticketOut *C.vmmipc_ticket) C.int {
	return call("vmmipc_register", func() error {
		if exportFn == nil {
			return core.Errorf(core.EINVAL, "vmmipc_register: export_fn is NULL")
		}
		o, a, err := registerArgs("vmmipc_register", opts, ticketOut, count, []string{"sizes"}, sizes)
		if err != nil {
			return err
		}
		ro := o.register()
		ro.OnRelease, ro.LendsExporter = releaseCallback(releaseFn, user), true
		spec := core.BufferSpec{Sizes: a[0], Kind: o.kind, Exporter: &exportCallback{export: exportFn, user: user}}
		return register(spec, ro, ticketOut)
	})
}

//export vmmipcgo_register_host_file
func vmmipcgo_register_host_file(fd C.int, size, chunkSize C.uint64_t, releaseFn C.vmmipc_release_fn, user C.uintptr_t, opts *C.vmmipc_options, ticketOut *C.vmmipc_ticket) C.int {
	return call("vmmipc_register_host_file", func() error {
		o, _, err := registerArgs("vmmipc_register_host_file", opts, ticketOut, 0, nil)
		if err != nil {
			return err
		}
		// The server first: a file it cannot start for keeps its seals
		// (core.Server.RegisterHostFile seals last).
		srv, err := startServer()
		if err != nil {
			return err
		}
		ro := o.register()
		ro.OnRelease = releaseCallback(releaseFn, user)
		t, err := srv.RegisterHostFile(int(fd), uint64(size), uint64(chunkSize), ro)
		if err != nil {
			return err
		}
		return writeTicket(t, ticketOut) // cannot fail: the registry marshalled t for its digest
	})
}

//export vmmipcgo_register_cuda
func vmmipcgo_register_cuda(dptr, size C.uint64_t, opts *C.vmmipc_options, ticketOut *C.vmmipc_ticket) C.int {
	return call("vmmipc_register_cuda", func() error {
		o, _, err := registerArgs("vmmipc_register_cuda", opts, ticketOut, 0, nil)
		if err != nil {
			return err
		}
		spec, err := cuda.RegisterRange(uint64(dptr), uint64(size))
		if err != nil {
			return err
		}
		if err := register(spec, o.register(), ticketOut); err != nil {
			spec.Exporter.Release() // drop the references taken above
			return err
		}
		return nil
	})
}

//export vmmipcgo_register_cuda_handles
func vmmipcgo_register_cuda_handles(handles, sizes *C.uint64_t, count C.uint64_t, releaseFn C.vmmipc_release_fn, user C.uintptr_t, opts *C.vmmipc_options, ticketOut *C.vmmipc_ticket) C.int {
	return call("vmmipc_register_cuda_handles", func() error {
		o, a, err := registerArgs("vmmipc_register_cuda_handles", opts, ticketOut, count, []string{"handles", "sizes"}, handles, sizes)
		if err != nil {
			return err
		}
		spec, err := cuda.RegisterHandles(a[0], a[1])
		if err != nil {
			return err
		}
		ro := o.register()
		ro.OnRelease, ro.LendsExporter = releaseCallback(releaseFn, user), true
		return register(spec, ro, ticketOut) // release_fn is not called when registering fails
	})
}

// callOwn is call for an export of a ticket of this process's own: body
// gets the ticket and the server that registered it.
func callOwn(fn string, ticket *C.vmmipc_ticket, body func(*core.Server, *core.Ticket) error) C.int {
	return call(fn, func() error {
		t, err := readTicket(fn, ticket)
		if err != nil {
			return err
		}
		srv := core.StartedServer()
		if srv == nil {
			return core.Errorf(core.ENOENT, "%s: this process has registered nothing; the ticket belongs to pid %d", fn, t.Pid)
		}
		return body(srv, t)
	})
}

//export vmmipcgo_register_again
func vmmipcgo_register_again(ticket *C.vmmipc_ticket, releaseFn C.vmmipc_release_fn, user C.uintptr_t, opts *C.vmmipc_options, ticketOut *C.vmmipc_ticket) C.int {
	return callOwn("vmmipc_register_again", ticket, func(srv *core.Server, t *core.Ticket) error {
		o, _, err := registerArgs("vmmipc_register_again", opts, ticketOut, 0, nil)
		if err != nil {
			return err
		}
		ro := o.register()
		ro.OnRelease = releaseCallback(releaseFn, user)
		nt, err := srv.RegisterAgain(t, ro)
		if err != nil {
			return err
		}
		return writeTicket(nt, ticketOut)
	})
}

//export vmmipcgo_unregister
func vmmipcgo_unregister(ticket *C.vmmipc_ticket) C.int {
	return callOwn("vmmipc_unregister", ticket, func(srv *core.Server, t *core.Ticket) error {
		return srv.Unregister(t)
	})
}

//export vmmipcgo_wait
func vmmipcgo_wait(ticket *C.vmmipc_ticket, timeoutMs C.uint32_t) C.int {
	return callOwn("vmmipc_wait", ticket, func(srv *core.Server, t *core.Ticket) error {
		return srv.Wait(t, time.Duration(timeoutMs)*time.Millisecond)
	})
}

//export vmmipcgo_exiting
func vmmipcgo_exiting() C.int {
	return call("vmmipc_exiting", func() error {
		core.SetExiting()
		return nil
	})
}

//export vmmipcgo_live_registrations
func vmmipcgo_live_registrations(out *C.uint64_t) C.int {
	return call("vmmipc_live_registrations", func() error {
		if out == nil {
			return core.Errorf(core.EINVAL, "vmmipc_live_registrations: count_out is NULL")
		}
		*out = C.uint64_t(core.DefaultLive())
		return nil
	})
}

//export vmmipcgo_live_many
func vmmipcgo_live_many(tickets *C.vmmipc_ticket, count C.size_t, liveOut *C.uint8_t) C.int {
	const fn = "vmmipc_live_many"
	return call(fn, func() error {
		switch {
		case count == 0:
			return nil
		case tickets == nil:
			return core.Errorf(core.EINVAL, "%s: tickets is NULL", fn)
		case liveOut == nil:
			return core.Errorf(core.EINVAL, "%s: live_out is NULL", fn)
		case count > maxMany:
			return core.Errorf(core.EINVAL, "%s: %d tickets, more than the %d of one call: split them", fn, count, maxMany)
		}
		n := int(count)
		ts := make([]*core.Ticket, n)
		for i, ct := range unsafe.Slice(tickets, n) {
			ts[i], _ = readTicket(fn, &ct) // a malformed ticket names nothing live
		}
		var live []bool
		if srv := core.StartedServer(); srv != nil {
			live = srv.LiveMany(ts)
		}
		out := unsafe.Slice(liveOut, n)
		for i := range out {
			out[i] = 0
			if live != nil && live[i] {
				out[i] = 1
			}
		}
		return nil
	})
}

//export vmmipcgo_cuda_query_range
func vmmipcgo_cuda_query_range(dptr, size C.uint64_t, info *C.vmmipc_cuda_range_info) C.int {
	return call("vmmipc_cuda_query_range", func() error {
		if info == nil {
			return core.Errorf(core.EINVAL, "vmmipc_cuda_query_range: info_out is NULL")
		}
		base, n, types, dev, err := cuda.QueryRange(uint64(dptr), uint64(size))
		if err != nil {
			return err
		}
		*info = C.vmmipc_cuda_range_info{base: C.uint64_t(base), size: C.uint64_t(n),
			handle_types: C.uint32_t(types), device: C.int32_t(dev)}
		return nil
	})
}

//export vmmipcgo_ticket_decode
func vmmipcgo_ticket_decode(ticket *C.vmmipc_ticket, info *C.vmmipc_ticket_info) C.int {
	return call("vmmipc_ticket_decode", func() error {
		if info == nil {
			return core.Errorf(core.EINVAL, "vmmipc_ticket_decode: info_out is NULL")
		}
		t, err := readTicket("vmmipc_ticket_decode", ticket)
		if err != nil {
			return err
		}
		*info = C.vmmipc_ticket_info{
			memory_kind: C.uint32_t(t.Kind), exporter_pid: C.uint32_t(t.Pid),
			chunk_count: C.uint64_t(t.Count), total_size: C.uint64_t(t.Total),
		}
		for i, b := range t.DeviceUUID {
			info.device_uuid[i] = C.uchar(b)
		}
		return nil
	})
}

//export vmmipcgo_open
func vmmipcgo_open(ticket *C.vmmipc_ticket, opts *C.vmmipc_options, out **C.vmmipc_stream) C.int {
	return call("vmmipc_open", func() error {
		t, o, err := receiveArgs("vmmipc_open", "stream_out", ticket, opts, out == nil)
		if err != nil {
			return err
		}
		s, err := core.Open(t, o.open)
		if err != nil {
			return err
		}
		*out = (*C.vmmipc_stream)(saveHandle(s))
		return nil
	})
}

// receiveArgs reads the ticket and options of receiver call fn, after
// checking its output pointer (out names it; isNil says it is NULL).
func receiveArgs(fn, out string, ticket *C.vmmipc_ticket, opts *C.vmmipc_options, isNil bool) (*core.Ticket, options, error) {
	if isNil {
		return nil, options{}, core.Errorf(core.EINVAL, "%s: %s is NULL", fn, out)
	}
	t, err := readTicket(fn, ticket)
	if err != nil {
		return nil, options{}, err
	}
	o, err := readOptions(opts)
	return t, o, err
}

// streamOf finds the live stream behind handle h of call fn.
func streamOf(fn string, h C.uintptr_t) (*core.Stream, error) {
	s, _ := lookupHandle(uintptr(h)).(*core.Stream)
	if s == nil {
		return nil, badStream(fn, uintptr(h))
	}
	return s, nil
}

// badStream says which of NULL, closed or unknown handle h is.
func badStream(fn string, h uintptr) error {
	switch {
	case h == 0:
		return core.Errorf(core.EBADF, "%s: stream is NULL: pass a stream from vmmipc_open", fn)
	case handleClosed(h):
		return core.Errorf(core.EBADF, "%s: stream %#x is closed (vmmipc_close was called on it): open another with vmmipc_open", fn, h)
	}
	return core.Errorf(core.EBADF, "%s: %#x is not a stream of this process: not from vmmipc_open, or closed long ago", fn, h)
}

//export vmmipcgo_stream_info
func vmmipcgo_stream_info(stream C.uintptr_t, count, total *C.uint64_t) C.int {
	return callOn("vmmipc_stream_info", stream, streamOf, func(s *core.Stream) error {
		if count != nil {
			*count = C.uint64_t(s.Ticket().Count)
		}
		if total != nil {
			*total = C.uint64_t(s.Ticket().Total)
		}
		return nil
	})
}

//export vmmipcgo_pull_next
func vmmipcgo_pull_next(stream C.uintptr_t, out *C.vmmipc_chunk) C.int {
	return callOn("vmmipc_pull_next", stream, streamOf, func(s *core.Stream) error {
		if out == nil {
			return core.Errorf(core.EINVAL, "vmmipc_pull_next: chunk_out is NULL")
		}
		ch, err := s.Next()
		if err != nil {
			return err
		}
		*out = C.vmmipc_chunk{index: C.uint64_t(ch.Index), offset: C.uint64_t(ch.Offset),
			size: C.uint64_t(ch.Size), fd: C.int(ch.FD), file_offset: C.uint64_t(ch.FileOffset)}
		return nil
	})
}

//export vmmipcgo_close
func vmmipcgo_close(stream C.uintptr_t) C.int {
	return call("vmmipc_close", func() error {
		s, _ := takeHandle(uintptr(stream)).(*core.Stream)
		if s == nil {
			return badStream("vmmipc_close", uintptr(stream))
		}
		_ = s.Close()
		return nil
	})
}

//export vmmipcgo_import_stream
func vmmipcgo_import_stream(ticket *C.vmmipc_ticket, device C.int, opts *C.vmmipc_options, out *C.vmmipc_mapping) C.int {
	return call("vmmipc_import_stream", func() error {
		t, o, err := receiveArgs("vmmipc_import_stream", "mapping_out", ticket, opts, out == nil)
		if err != nil {
			return err
		}
		io, err := o.importOptions()
		if err != nil {
			return err
		}
		r, err := core.Import(t, int32(device), io, cuda.GPU{})
		if err != nil {
			return err
		}
		*out = C.vmmipc_mapping{addr: C.uint64_t(r.Base), size: C.uint64_t(r.Size),
			device: C.int32_t(r.Device), memory_kind: C.uint32_t(r.Kind)}
		out.private_[0] = C.uint64_t(r.ID)
		return nil
	})
}

//export vmmipcgo_confirm
func vmmipcgo_confirm(ticket *C.vmmipc_ticket, opts *C.vmmipc_options) C.int {
	return call("vmmipc_confirm", func() error {
		t, o, err := receiveArgs("vmmipc_confirm", "", ticket, opts, false)
		if err != nil {
			return err
		}
		io, err := o.importOptions()
		if err != nil {
			return err
		}
		return core.Confirm(t, io)
	})
}

// maxMany bounds the tickets of one vmmipc_confirm_many or vmmipc_live_many.
const maxMany = 1 << 20

//export vmmipcgo_confirm_many
func vmmipcgo_confirm_many(tickets *C.vmmipc_ticket, count C.size_t, opts *C.vmmipc_options, statusOut *C.int) C.int {
	const fn = "vmmipc_confirm_many"
	return call(fn, func() error {
		switch {
		case tickets == nil && count > 0:
			return core.Errorf(core.EINVAL, "%s: tickets is NULL", fn)
		case count > maxMany:
			return core.Errorf(core.EINVAL, "%s: %d tickets, more than the %d of one call: split them", fn, count, maxMany)
		}
		o, err := readOptions(opts)
		if err != nil {
			return err
		}
		io, err := o.importOptions()
		if err != nil {
			return err
		}
		if io.ConfirmLater {
			return core.Errorf(core.EINVAL, "%s: VMMIPC_IMPORT_CONFIRM_LATER is for one ticket at a time (vmmipc_confirm)", fn)
		}
		n := int(count)
		errs := make([]error, n)
		var ts []*core.Ticket
		var at []int
		for i, ct := range unsafe.Slice(tickets, n) {
			t, err := readTicket(fn, &ct)
			if err != nil {
				errs[i] = err
				continue
			}
			ts, at = append(ts, t), append(at, i)
		}
		for j, err := range core.ConfirmMany(ts, io) {
			errs[at[j]] = err
		}
		var status []C.int
		if statusOut != nil {
			status = unsafe.Slice(statusOut, n)
		}
		var first error
		for i, err := range errs {
			if status != nil {
				status[i] = C.int(core.CodeOf(err))
			}
			if err != nil && first == nil {
				first = core.WrapErr(core.CodeOf(err), err, "%s: ticket %d of %d", fn, i, n)
			}
		}
		return first
	})
}

//export vmmipcgo_release
func vmmipcgo_release(ticket *C.vmmipc_ticket) C.int {
	return call("vmmipc_release", func() error {
		t, err := readTicket("vmmipc_release", ticket)
		if err != nil {
			return err
		}
		return core.Release(t)
	})
}

//export vmmipcgo_holds
func vmmipcgo_holds(out *C.uint64_t) C.int {
	return call("vmmipc_holds", func() error {
		if out == nil {
			return core.Errorf(core.EINVAL, "vmmipc_holds: count_out is NULL")
		}
		*out = C.uint64_t(core.DefaultHolds())
		return nil
	})
}

//export vmmipcgo_unmap
func vmmipcgo_unmap(m *C.vmmipc_mapping) C.int {
	return call("vmmipc_unmap", func() error {
		if m == nil {
			return core.Errorf(core.EINVAL, "vmmipc_unmap: mapping is NULL")
		}
		err := core.Unmap(uint64(m.private_[0]), uint64(m.addr))
		if core.CodeOf(err) != core.EINVAL {
			*m = C.vmmipc_mapping{} // the reference is gone, even when undoing failed
		}
		return err
	})
}

//export vmmipcgo_cache_set_limit
func vmmipcgo_cache_set_limit(n C.uint64_t) C.int {
	return call("vmmipc_cache_set_limit", func() error { return core.SetCacheLimit(uint64(n)) })
}

//export vmmipcgo_cache_get_info
func vmmipcgo_cache_get_info(out *C.vmmipc_cache_info, size C.size_t) C.int {
	return call("vmmipc_cache_get_info", func() error {
		if out == nil {
			return core.Errorf(core.EINVAL, "vmmipc_cache_get_info: info_out is NULL")
		}
		i := core.GetCacheInfo()
		full := C.vmmipc_cache_info{
			limit_bytes:        C.uint64_t(i.LimitBytes),
			entries:            C.uint64_t(i.Entries),
			referenced_bytes:   C.uint64_t(i.ReferencedBytes),
			unreferenced_bytes: C.uint64_t(i.UnreferencedBytes),
			hits:               C.uint64_t(i.Hits),
			misses:             C.uint64_t(i.Misses),
			evictions:          C.uint64_t(i.Evictions),
			invalidations:      C.uint64_t(i.Invalidations),
			confirms_pending:   C.uint64_t(i.ConfirmsPending),
			confirms_failed:    C.uint64_t(i.ConfirmsFailed),
			holds:              C.uint64_t(i.Holds),
			holder_sessions:    C.uint64_t(i.HolderSessions),
			table_hits:         C.uint64_t(i.TableHits),
			table_imports:      C.uint64_t(i.TableImports),
		}
		copyOut(out, &full, size)
		return nil
	})
}

var strerrors = map[core.Code]*C.char{}

//export vmmipcgo_strerror
func vmmipcgo_strerror(code C.int) (s *C.char) {
	defer func() {
		if recover() != nil {
			s = nil
		}
	}()
	return strerrors[core.Code(code)]
}

func init() {
	for _, c := range core.Codes() {
		strerrors[c] = C.CString(c.String()) // static for the process's life
	}
}
