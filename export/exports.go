//go:debug containermaxprocs=0
//go:debug updatemaxprocs=0

// Command export builds libvmmipc.so (go build -buildmode=c-shared). It is the
// only package with //export: thin functions that translate C arguments,
// call core or cuda, and turn errors into status codes. The public vmmipc_*
// symbols are the C wrappers in abi.c, which refuse calls after fork()
// before entering Go; the vmmipcgo_* exports below stay hidden (see
// vmmipc.map).
package main

/*
#include "abi.h"
*/
import "C"

import (
	"syscall"
	"unsafe"

	"github.com/libvmmipc/libvmmipc/core"
	"github.com/libvmmipc/libvmmipc/cuda"
)

func main() {}

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
	C.vmmipc_abi_go_init_done()
}

//export vmmipcgo_options_init
func vmmipcgo_options_init(opts *C.vmmipc_options, size C.size_t) (rc C.int) {
	defer guard(&rc, "vmmipc_options_init")
	if opts == nil || uintptr(size) < unsafe.Offsetof(opts.ttl_ms) {
		return status(core.Errorf(core.EINVAL, "vmmipc_options_init: opts is NULL or size %d is too small; pass sizeof *opts", uint64(size)))
	}
	// Fill a full struct of ours, then copy only what the caller's holds.
	d := C.vmmipc_options{uses: 1, timeout_ms: C.uint32_t(core.DefaultTimeout.Milliseconds()), memory_kind: C.VMMIPC_MEMORY_HOST}
	n := min(uintptr(size), unsafe.Sizeof(d))
	d.struct_size = C.uint32_t(n)
	copy(unsafe.Slice((*byte)(unsafe.Pointer(opts)), n), unsafe.Slice((*byte)(unsafe.Pointer(&d)), n))
	return C.VMMIPC_OK
}

// exportCallback calls a C export_fn/release_fn pair.
type exportCallback struct {
	export  C.vmmipc_export_fn
	release C.vmmipc_release_fn
	user    unsafe.Pointer
}

func (e *exportCallback) ExportChunk(index uint64) (int, uint64, error) {
	fd := C.int(-1)
	if rc := C.vmmipc_abi_call_export(e.export, e.user, C.uint64_t(index), &fd); rc != 0 {
		return -1, 0, core.Errorf(core.EEXPORT, "export_fn returned %d", int(rc))
	}
	return int(fd), 0, nil
}

func (e *exportCallback) Release() {
	if e.release != nil {
		C.vmmipc_abi_call_release(e.release, e.user)
	}
}

func register(sizes []uint64, exp core.Exporter, o core.RegisterOptions, out *C.vmmipc_ticket) error {
	srv, err := core.DefaultServer()
	if err != nil {
		return err
	}
	t, err := srv.Register(sizes, exp, o)
	if err != nil {
		return err
	}
	if err := writeTicket(t, out); err != nil {
		_ = srv.Unregister(t)
		return err
	}
	return nil
}

//export vmmipcgo_register
func vmmipcgo_register(sizes *C.uint64_t, count C.uint64_t, exportFn C.vmmipc_export_fn, releaseFn C.vmmipc_release_fn, user unsafe.Pointer, opts *C.vmmipc_options, ticketOut *C.vmmipc_ticket) (rc C.int) {
	defer guard(&rc, "vmmipc_register")
	if exportFn == nil || ticketOut == nil {
		return status(core.Errorf(core.EINVAL, "vmmipc_register: export_fn and ticket_out must not be NULL"))
	}
	o, err := readOptions(opts)
	if err != nil {
		return status(err)
	}
	sz, err := u64s(sizes, count, "vmmipc_register: sizes")
	if err != nil {
		return status(err)
	}
	if o.reg.Kind == core.MemoryHost {
		for i, s := range sz[:len(sz)-1] {
			if s%core.PageSize() != 0 {
				return status(core.Errorf(core.EINVAL, "vmmipc_register: host chunk %d has size %d, not a multiple of the page size %d", i, s, core.PageSize()))
			}
		}
	}
	exp := &exportCallback{export: exportFn, release: releaseFn, user: user}
	return status(register(sz, exp, o.reg, ticketOut))
}

//export vmmipcgo_register_host_file
func vmmipcgo_register_host_file(fd C.int, size, chunkSize C.uint64_t, releaseFn C.vmmipc_release_fn, user unsafe.Pointer, opts *C.vmmipc_options, ticketOut *C.vmmipc_ticket) (rc C.int) {
	defer guard(&rc, "vmmipc_register_host_file")
	if ticketOut == nil {
		return status(core.Errorf(core.EINVAL, "vmmipc_register_host_file: ticket_out is NULL"))
	}
	o, err := readOptions(opts)
	if err != nil {
		return status(err)
	}
	sizes, err := core.FileChunks(int(fd), uint64(size), uint64(chunkSize))
	if err != nil {
		return status(err)
	}
	cb := &exportCallback{release: releaseFn, user: user}
	exp := &core.FileExporter{FD: int(fd), ChunkSize: uint64(chunkSize), OnRelease: cb.Release}
	o.reg.Kind = core.MemoryHost
	return status(register(sizes, exp, o.reg, ticketOut))
}

//export vmmipcgo_register_cuda
func vmmipcgo_register_cuda(dptr, size C.uint64_t, opts *C.vmmipc_options, ticketOut *C.vmmipc_ticket) (rc C.int) {
	defer guard(&rc, "vmmipc_register_cuda")
	if ticketOut == nil || size == 0 {
		return status(core.Errorf(core.EINVAL, "vmmipc_register_cuda: ticket_out is NULL or size is 0"))
	}
	o, err := readOptions(opts)
	if err != nil {
		return status(err)
	}
	r, err := cuda.RegisterRange(uint64(dptr), uint64(size))
	if err != nil {
		return status(err)
	}
	o.reg.Kind, o.reg.DeviceUUID = core.MemoryCUDA, r.DeviceUUID
	if err := register(r.Sizes, r.Exporter, o.reg, ticketOut); err != nil {
		r.Exporter.Release() // drop the references taken above
		return status(err)
	}
	return C.VMMIPC_OK
}

//export vmmipcgo_register_cuda_handles
func vmmipcgo_register_cuda_handles(handles, sizes *C.uint64_t, count C.uint64_t, releaseFn C.vmmipc_release_fn, user unsafe.Pointer, opts *C.vmmipc_options, ticketOut *C.vmmipc_ticket) (rc C.int) {
	defer guard(&rc, "vmmipc_register_cuda_handles")
	if ticketOut == nil {
		return status(core.Errorf(core.EINVAL, "vmmipc_register_cuda_handles: ticket_out is NULL"))
	}
	o, err := readOptions(opts)
	if err != nil {
		return status(err)
	}
	hs, err := u64s(handles, count, "vmmipc_register_cuda_handles: handles")
	if err != nil {
		return status(err)
	}
	sz, err := u64s(sizes, count, "vmmipc_register_cuda_handles: sizes")
	if err != nil {
		return status(err)
	}
	cb := &exportCallback{release: releaseFn, user: user}
	r, err := cuda.RegisterHandles(hs, sz, cb.Release)
	if err != nil {
		return status(err)
	}
	o.reg.Kind, o.reg.DeviceUUID = core.MemoryCUDA, r.DeviceUUID
	if err := register(r.Sizes, r.Exporter, o.reg, ticketOut); err != nil {
		return status(err) // release_fn is not called when registering fails
	}
	return C.VMMIPC_OK
}

//export vmmipcgo_unregister
func vmmipcgo_unregister(ticket *C.vmmipc_ticket) (rc C.int) {
	defer guard(&rc, "vmmipc_unregister")
	t, err := readTicket(ticket)
	if err != nil {
		return status(err)
	}
	srv := core.StartedServer()
	if srv == nil {
		return status(core.Errorf(core.ENOENT, "vmmipc_unregister: this process has registered nothing; the ticket belongs to pid %d", t.Pid))
	}
	return status(srv.Unregister(t))
}

//export vmmipcgo_live_registrations
func vmmipcgo_live_registrations(out *C.uint64_t) (rc C.int) {
	defer guard(&rc, "vmmipc_live_registrations")
	if out == nil {
		return status(core.Errorf(core.EINVAL, "vmmipc_live_registrations: count_out is NULL"))
	}
	*out = C.uint64_t(core.DefaultRegistryLive())
	return C.VMMIPC_OK
}

//export vmmipcgo_ticket_decode
func vmmipcgo_ticket_decode(ticket *C.vmmipc_ticket, info *C.vmmipc_ticket_info) (rc C.int) {
	defer guard(&rc, "vmmipc_ticket_decode")
	if info == nil {
		return status(core.Errorf(core.EINVAL, "vmmipc_ticket_decode: info_out is NULL"))
	}
	t, err := readTicket(ticket)
	if err != nil {
		return status(err)
	}
	*info = C.vmmipc_ticket_info{
		memory_kind: C.uint32_t(t.Kind), exporter_pid: C.uint32_t(t.Pid),
		chunk_count: C.uint64_t(t.Count), total_size: C.uint64_t(t.Total),
	}
	for i, b := range t.DeviceUUID {
		info.device_uuid[i] = C.uchar(b)
	}
	return C.VMMIPC_OK
}

//export vmmipcgo_open
func vmmipcgo_open(ticket *C.vmmipc_ticket, opts *C.vmmipc_options, out **C.vmmipc_stream) (rc C.int) {
	defer guard(&rc, "vmmipc_open")
	if out == nil {
		return status(core.Errorf(core.EINVAL, "vmmipc_open: stream_out is NULL"))
	}
	t, err := readTicket(ticket)
	if err != nil {
		return status(err)
	}
	o, err := readOptions(opts)
	if err != nil {
		return status(err)
	}
	s, err := core.Open(t, o.open)
	if err != nil {
		return status(err)
	}
	*out = (*C.vmmipc_stream)(saveHandle(s))
	return C.VMMIPC_OK
}

func streamOf(p unsafe.Pointer) (*core.Stream, error) {
	s, _ := lookupHandle(p).(*core.Stream)
	if s == nil {
		return nil, core.Errorf(core.EBADF, "stream handle %p is NULL, stale or closed", p)
	}
	return s, nil
}

//export vmmipcgo_stream_info
func vmmipcgo_stream_info(stream *C.vmmipc_stream, count, total *C.uint64_t) (rc C.int) {
	defer guard(&rc, "vmmipc_stream_info")
	s, err := streamOf(unsafe.Pointer(stream))
	if err != nil {
		return status(err)
	}
	if count != nil {
		*count = C.uint64_t(s.Ticket().Count)
	}
	if total != nil {
		*total = C.uint64_t(s.Ticket().Total)
	}
	return C.VMMIPC_OK
}

//export vmmipcgo_pull_next
func vmmipcgo_pull_next(stream *C.vmmipc_stream, out *C.vmmipc_chunk) (rc C.int) {
	defer guard(&rc, "vmmipc_pull_next")
	s, err := streamOf(unsafe.Pointer(stream))
	if err != nil {
		return status(err)
	}
	if out == nil {
		return status(core.Errorf(core.EINVAL, "vmmipc_pull_next: chunk_out is NULL"))
	}
	ch, err := s.Next()
	if err != nil {
		return status(err)
	}
	*out = C.vmmipc_chunk{index: C.uint64_t(ch.Index), offset: C.uint64_t(ch.Offset),
		size: C.uint64_t(ch.Size), fd: C.int(ch.FD), file_offset: C.uint64_t(ch.FileOffset)}
	return C.VMMIPC_OK
}

//export vmmipcgo_close
func vmmipcgo_close(stream *C.vmmipc_stream) (rc C.int) {
	defer guard(&rc, "vmmipc_close")
	s, _ := takeHandle(unsafe.Pointer(stream)).(*core.Stream)
	if s == nil {
		return status(core.Errorf(core.EBADF, "vmmipc_close: stream handle %p is NULL, stale or already closed", unsafe.Pointer(stream)))
	}
	_ = s.Close()
	return C.VMMIPC_OK
}

//export vmmipcgo_import_stream
func vmmipcgo_import_stream(ticket *C.vmmipc_ticket, device C.int, opts *C.vmmipc_options, out *C.vmmipc_mapping) (rc C.int) {
	defer guard(&rc, "vmmipc_import_stream")
	if out == nil {
		return status(core.Errorf(core.EINVAL, "vmmipc_import_stream: mapping_out is NULL"))
	}
	t, err := readTicket(ticket)
	if err != nil {
		return status(err)
	}
	o, err := readOptions(opts)
	if err != nil {
		return status(err)
	}
	var imp core.Importer
	dev := int32(device)
	switch {
	case t.Kind == core.MemoryHost && device == C.VMMIPC_DEVICE_HOST:
		imp = &core.HostImporter{}
	case t.Kind == core.MemoryHost:
		return status(core.Errorf(core.EINVAL, "vmmipc_import_stream: the ticket holds host memory; pass VMMIPC_DEVICE_HOST, not device %d", dev))
	case device == C.VMMIPC_DEVICE_HOST:
		return status(core.Errorf(core.EINVAL, "vmmipc_import_stream: the ticket holds CUDA memory; pass a device ordinal or VMMIPC_DEVICE_SAME, not VMMIPC_DEVICE_HOST"))
	case device < C.VMMIPC_DEVICE_SAME:
		return status(core.Errorf(core.EINVAL, "vmmipc_import_stream: device %d is neither an ordinal nor VMMIPC_DEVICE_SAME", dev))
	default:
		ci, err := cuda.NewImporter(dev, t.DeviceUUID, o.access)
		if err != nil {
			return status(err)
		}
		imp, dev = ci, ci.Device()
	}
	m, err := core.ImportStream(t, imp, dev, o.open)
	if err != nil {
		return status(err)
	}
	*out = C.vmmipc_mapping{addr: C.uint64_t(m.Base), size: C.uint64_t(m.Size),
		device: C.int32_t(m.Device), memory_kind: C.uint32_t(m.Kind)}
	out.private_[0] = C.uint64_t(m.ID)
	return C.VMMIPC_OK
}

//export vmmipcgo_unmap
func vmmipcgo_unmap(m *C.vmmipc_mapping) (rc C.int) {
	defer guard(&rc, "vmmipc_unmap")
	if m == nil {
		return status(core.Errorf(core.EINVAL, "vmmipc_unmap: mapping is NULL"))
	}
	if err := core.Unmap(uint64(m.private_[0]), uint64(m.addr)); err != nil {
		return status(err)
	}
	*m = C.vmmipc_mapping{}
	return C.VMMIPC_OK
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
	for c := core.EINTERNAL; c <= core.End; c++ {
		strerrors[c] = C.CString(c.String()) // static for the process's life
	}
}
