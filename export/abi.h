/* Internal glue between the public C wrappers (abi.c) and the Go exports
 * (exports.go). Not installed; the public contract is include/vmmipc.h. */
#ifndef VMMIPC_ABI_H
#define VMMIPC_ABI_H
#include <stddef.h>
#include <stdint.h>
#include "../include/vmmipc.h"

/* Internal: never in the dynamic symbol table (only vmmipc_* of vmmipc.h). */
#define VMMIPC_INTERNAL __attribute__((visibility("hidden")))

/* Stores this thread's last-error detail (copied, truncated to fit). */
VMMIPC_INTERNAL void vmmipc_abi_set_error(const char *msg, size_t len);

/* Trampolines: cgo cannot call C function pointers directly. The caller's
 * opaque user pointer crosses into Go as an integer (uintptr_t): it may be
 * any value, and Go must never hold a non-pointer in a pointer type. */
VMMIPC_INTERNAL int vmmipc_abi_call_export(vmmipc_export_fn fn, uintptr_t user, uint64_t index, int *fd_out);
VMMIPC_INTERNAL void vmmipc_abi_call_release(vmmipc_release_fn fn, uintptr_t user);

/* The host's RLIMIT_NOFILE as it was before the library loaded. */
VMMIPC_INTERNAL void vmmipc_abi_saved_nofile(unsigned long long *cur, unsigned long long *max, int *ok);

/* Go's package init hands over core.RuntimeHeadroom, which
 * vmmipc_import_stream keeps free under RLIMIT_AS before entering Go. */
VMMIPC_INTERNAL void vmmipc_abi_set_runtime_headroom(unsigned long long bytes);

/* Called last in Go's package init: puts the signals back and lets the
 * loading constructor return. */
VMMIPC_INTERNAL void vmmipc_abi_go_init_done(void);

/* Records the files of the server in VMMIPC_SOCKET_DIR for removal when
 * the process calls exit(): their names (copied) in the directory dirfd
 * (duplicated), the descriptor of the directory the server checked. The
 * first call counts. */
VMMIPC_INTERNAL void vmmipc_abi_remove_at_exit(int dirfd, const char *socket_name, const char *lock_name);
#endif
