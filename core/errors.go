// Package core is the pure-Go heart of libvmmipc: the ticket format, the wire
// protocol, the per-process server with its registry, the receiver stream and
// the import orchestration. It knows nothing of CUDA or cgo; memory backends
// plug in through the Exporter and Importer interfaces.
package core

import (
	"errors"
	"fmt"
	"syscall"
)

// Code is a libvmmipc status code. The values are the ones in vmmipc.h.
type Code int32

// Status codes, mirroring include/vmmipc.h: OK and End, then the errors
// from -1 down, in the header's order (tests check the values).
const (
	OK  Code = 0
	End Code = 1
)

const (
	EINVAL    Code = -1 - iota // -1
	EBADF                      // -2
	EAUTH                      // -3
	ENOENT                     // -4
	EIO                        // -5
	EEXPORT                    // -6
	ECUDA                      // -7
	ENFILE                     // -8
	EFORK                      // -9
	EINTERNAL                  // -10
	ENOMEM                     // -11
	ETIMEDOUT                  // -12
	ECONFIG                    // -13
)

// firstCode is the most negative status; codes run from it to End.
const firstCode = ECONFIG

var codeNames = map[Code]string{
	OK:        "VMMIPC_OK: success",
	End:       "VMMIPC_END: stream finished",
	EINVAL:    "VMMIPC_EINVAL: invalid argument or malformed data",
	EBADF:     "VMMIPC_EBADF: bad, stale or closed handle",
	EAUTH:     "VMMIPC_EAUTH: authentication failed",
	ENOENT:    "VMMIPC_ENOENT: no such registration (unknown, used up, unregistered or expired)",
	EIO:       "VMMIPC_EIO: I/O error, peer gone or timed out",
	EEXPORT:   "VMMIPC_EEXPORT: the sender could not export a chunk",
	ECUDA:     "VMMIPC_ECUDA: CUDA driver unavailable or a driver call failed",
	ENFILE:    "VMMIPC_ENFILE: out of file descriptors",
	EFORK:     "VMMIPC_EFORK: called in a child after fork()",
	EINTERNAL: "VMMIPC_EINTERNAL: internal error in libvmmipc",
	ENOMEM:    "VMMIPC_ENOMEM: no address space for the reservation",
	ETIMEDOUT: "VMMIPC_ETIMEDOUT: timed out; the registration is still live",
	ECONFIG:   "VMMIPC_ECONFIG: bad configuration (VMMIPC_SOCKET_DIR or another VMMIPC_* variable)",
}

// Codes lists every status code, most negative first.
func Codes() []Code {
	var cs []Code
	for c := firstCode; c <= End; c++ {
		cs = append(cs, c)
	}
	return cs
}

// IsError reports whether c is one of the negative status codes.
func (c Code) IsError() bool { return c < 0 && c >= firstCode }

// String returns the status name and a short description.
func (c Code) String() string {
	if s, ok := codeNames[c]; ok {
		return s
	}
	return fmt.Sprintf("VMMIPC_UNKNOWN(%d): unknown status", int32(c))
}

// Error is an error with a status code. Callers branch on Code with CodeOf.
type Error struct {
	Code Code
	Msg  string // what failed and, where useful, what to do
	Err  error  // the underlying cause, if any; Error() appends its text

	inMsg error // a cause whose text Msg already holds (Errorf's %w)
}

func (e *Error) Error() string {
	if e.Err != nil {
		return e.Msg + ": " + e.Err.Error()
	}
	return e.Msg
}

func (e *Error) Unwrap() error {
	if e.Err != nil {
		return e.Err
	}
	return e.inMsg
}

// Errorf returns an *Error with the given code and formatted message. A %w
// verb wraps its operand as the cause (reachable with errors.Is/As; its text
// appears once, where the verb put it).
func Errorf(code Code, format string, args ...any) error {
	err := fmt.Errorf(format, args...)
	return &Error{Code: code, Msg: err.Error(), inMsg: errors.Unwrap(err)}
}

// WrapErr tags err with code unless it already carries one, putting the
// formatted context in front of its message; the cause stays reachable with
// errors.Is/As. The one way every package prefixes an error.
func WrapErr(code Code, err error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	var e *Error
	if errors.As(err, &e) {
		return &Error{Code: e.Code, Msg: msg + ": " + e.Msg, Err: e.Err, inMsg: e.inMsg}
	}
	return &Error{Code: code, Msg: msg, Err: err}
}

// CodeOf returns the status code carried by err: OK for nil, ENFILE for
// descriptor exhaustion, EIO for other system errors, EINTERNAL otherwise.
func CodeOf(err error) Code {
	if err == nil {
		return OK
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
		return ENFILE
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return EIO
	}
	return EINTERNAL
}

// ioCode classifies a socket or system error: ENFILE when out of
// descriptors, EIO otherwise.
func ioCode(err error) Code {
	if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
		return ENFILE
	}
	return EIO
}
