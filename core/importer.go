package core

import (
	"sync"

	"golang.org/x/sys/unix"
)

// Importer maps the chunks of one import into a single reserved range. The
// CUDA backend (package cuda) and the host backend (HostImporter) implement
// it; ImportStream drives it.
type Importer interface {
	// Reserve reserves total bytes of address space and returns its start.
	Reserve(total uint64) (base uint64, err error)
	// Map imports the chunk's descriptor and maps it at base+c.Offset. The
	// descriptor stays the caller's, who closes it right after.
	Map(c Chunk) error
	// Finish runs once after every chunk is mapped (CUDA: set access).
	Finish() error
	// Unmap undoes everything done so far, whatever state the import is in:
	// mapped chunks are unmapped and the reservation is freed.
	Unmap() error
}

// Mapping is a finished import.
type Mapping struct {
	ID     uint64
	Base   uint64
	Size   uint64
	Kind   uint8
	Device int32
	imp    Importer
}

// ImportStream reserves the ticket's whole range, then receives, maps and
// closes one chunk at a time. On any failure everything is undone and the
// error names the chunk. The use is consumed only after the last chunk is
// mapped and Finish succeeded.
func ImportStream(t *Ticket, imp Importer, device int32, opts OpenOptions) (*Mapping, error) {
	base, err := imp.Reserve(t.Total)
	if err != nil {
		return nil, wrapErr(EIO, err, "import: reserving %d bytes", t.Total)
	}
	m, err := importInto(t, imp, opts)
	if err != nil {
		if uerr := imp.Unmap(); uerr != nil {
			err = wrapErr(CodeOf(err), err, "import failed (and undoing it failed too: %v)", uerr)
		}
		return nil, err
	}
	m.Base, m.Device, m.imp = base, device, imp
	mappings.add(m)
	return m, nil
}

func importInto(t *Ticket, imp Importer, opts OpenOptions) (*Mapping, error) {
	s, err := Open(t, opts)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	for i := uint64(0); i < t.Count; i++ {
		ch, err := s.Next()
		if err != nil {
			if IsEnd(err) {
				err = Errorf(EINVAL, "protocol: stream ended after %d of %d chunks", i, t.Count)
			}
			return nil, err
		}
		err = imp.Map(ch)
		closeFD(&ch.FD)
		if err != nil {
			return nil, wrapErr(EIO, err, "chunk %d of %d", ch.Index, t.Count)
		}
	}
	if err := imp.Finish(); err != nil {
		return nil, err
	}
	if _, err := s.Next(); !IsEnd(err) {
		if err == nil {
			err = Errorf(EINVAL, "protocol: more chunks than the ticket's %d", t.Count)
		}
		return nil, err
	}
	return &Mapping{Size: t.Total, Kind: t.Kind}, nil
}

// mappingTable keeps the live mappings so that vmmipc_unmap acts only on
// something this library mapped, exactly once.
type mappingTable struct {
	mu   sync.Mutex
	next uint64
	live map[uint64]*Mapping
}

var mappings = mappingTable{next: 1, live: map[uint64]*Mapping{}}

func (mt *mappingTable) add(m *Mapping) {
	mt.mu.Lock()
	defer mt.mu.Unlock()
	m.ID = mt.next
	mt.next++
	mt.live[m.ID] = m
}

// Unmap undoes the live mapping with this id and base address.
func Unmap(id, base uint64) error {
	mappings.mu.Lock()
	m := mappings.live[id]
	if m == nil || m.Base != base {
		mappings.mu.Unlock()
		return Errorf(EINVAL, "unmap: %#x is not a live mapping of this process (already unmapped, or not from vmmipc_import_stream)", base)
	}
	delete(mappings.live, id)
	mappings.mu.Unlock()
	if err := m.imp.Unmap(); err != nil {
		return wrapErr(EIO, err, "unmap %#x", base)
	}
	return nil
}

// LiveMappings returns the number of mappings not yet unmapped.
func LiveMappings() int {
	mappings.mu.Lock()
	defer mappings.mu.Unlock()
	return len(mappings.live)
}

// pageSize is the host page size; host chunks must be multiples of it.
var pageSize = uint64(unix.Getpagesize())

// PageSize returns the host page size.
func PageSize() uint64 { return pageSize }
