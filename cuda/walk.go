package cuda

import "github.com/libvmmipc/libvmmipc/core"

// Walking a registered range needs no driver of its own: rangeAt stands in
// for cuMemGetAddressRange, so this is unit tested without a GPU.

// span is one allocation inside a registered range.
type span struct{ addr, size uint64 }

// checkRange refuses an empty range and one that runs past 2^64 (EINVAL,
// op naming the call), before any driver is looked for.
func checkRange(op string, dptr, size uint64) error {
	if size == 0 {
		return core.Errorf(core.EINVAL, "%s: size is 0", op)
	}
	if dptr+size < dptr {
		return core.Errorf(core.EINVAL, "%s: range %#x + %d overflows 64 bits", op, dptr, size)
	}
	return nil
}

// walkRange splits [dptr, dptr+size) into the allocations mapped there, as
// reported by rangeAt(p) = the bounds of the allocation containing p
// (cuMemGetAddressRange). The range must start and end on allocation
// boundaries.
func walkRange(dptr, size uint64, rangeAt func(p uint64) (base, n uint64, err error)) ([]span, error) {
	if err := checkRange("register", dptr, size); err != nil {
		return nil, err
	}
	end := dptr + size
	var spans []span
	for p := dptr; p < end; {
		base, n, err := rangeAt(p)
		if err != nil {
			return nil, core.WrapErr(core.ECUDA, err, "register: at %#x (offset %d)", p, p-dptr)
		}
		if n == 0 || base+n < base {
			return nil, core.Errorf(core.ECUDA, "register: cuMemGetAddressRange at %#x returned the bad range [%#x, +%d)", p, base, n)
		}
		if base != p {
			return nil, core.Errorf(core.EINVAL, "register: %#x is inside the allocation mapped at [%#x, %#x): the range must start on an allocation boundary", p, base, base+n)
		}
		if n > end-p {
			return nil, core.Errorf(core.EINVAL, "register: the range ends at %#x, inside the allocation mapped at [%#x, %#x): it must end on an allocation boundary", end, base, base+n)
		}
		if uint64(len(spans)) >= core.MaxChunks {
			return nil, core.Errorf(core.EINVAL, "register: the range holds more than %d allocations", core.MaxChunks)
		}
		spans = append(spans, span{addr: p, size: n})
		p += n
	}
	return spans, nil
}
