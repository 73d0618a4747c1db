/*
 * vmmipc.h — share CUDA virtual-memory (VMM) allocations, or chunked host
 * shared memory, between processes one file descriptor at a time.
 *
 * This header is the contract of libvmmipc.so. Read it before the code.
 *
 * How it works
 *   The sender registers a buffer made of N chunks. Registering opens no file
 *   descriptor: it records the chunk sizes with a per-process server and
 *   fills in a ticket, 256 bytes of plain data that can be copied, pickled and
 *   sent anywhere. A receiver that holds the ticket connects to the server and
 *   pulls the chunks in order; for each one the server exports exactly that
 *   chunk, sends its single descriptor together with a header in one message,
 *   and closes it. The high-level importer reserves the whole address range
 *   first, then maps the chunks one at a time and closes each descriptor as
 *   soon as it is mapped. Either side holds about one descriptor at a time,
 *   for any number of chunks.
 *
 * Conventions
 *   - Every function returns an int status: VMMIPC_OK (0), VMMIPC_END (1, a
 *     stream is finished; not an error) or a negative VMMIPC_E* error.
 *   - After a negative status, vmmipc_last_error() gives this thread's detail
 *     of what failed and what to do. Successful calls leave it unchanged.
 *   - Every descriptor the library hands out is O_CLOEXEC and belongs to the
 *     caller; every descriptor the caller hands in stays the caller's unless
 *     the function says otherwise.
 *   - All functions are thread-safe. No function blocks forever: receivers
 *     give up after vmmipc_options.timeout_ms.
 *   - Loading the library changes nothing in the host process: RLIMIT_NOFILE
 *     and every signal disposition stay as they were, except that handlers
 *     the host installed gain SA_ONSTACK (Go requires it: such a handler may
 *     run on a thread the library created). No handler of the library's
 *     stays installed, so a fault inside the library is a crash rather than
 *     a recovered panic. The library must not be unloaded (dlclose).
 *   - After fork(), every function returns VMMIPC_EFORK in the child (the Go
 *     runtime inside does not survive fork). Start helpers with exec or
 *     posix_spawn, or with Python's "spawn"/"forkserver" start methods.
 */
#ifndef VMMIPC_H
#define VMMIPC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define VMMIPC_VERSION_MAJOR 0
#define VMMIPC_VERSION_MINOR 1
#define VMMIPC_VERSION_PATCH 0

/* Size of a ticket in bytes. The layout is versioned; tickets are only
 * meaningful to the same library major version. */
#define VMMIPC_TICKET_SIZE 256

/* Device arguments of vmmipc_import_stream. Values >= 0 are CUDA device
 * ordinals as the receiving process sees them. */
#define VMMIPC_DEVICE_HOST (-1) /* host memory (memfd chunks) */
#define VMMIPC_DEVICE_SAME (-2) /* the exporter's GPU, found by UUID (tickets
                                   from vmmipc_register_cuda*; those of
                                   vmmipc_register name no GPU) */

/* Status codes. */
#define VMMIPC_OK 0
#define VMMIPC_END 1           /* stream finished: every chunk was pulled */
#define VMMIPC_EINVAL (-1)     /* bad argument, malformed ticket or message */
#define VMMIPC_EBADF (-2)      /* NULL, stale or closed handle */
#define VMMIPC_EAUTH (-3)      /* wrong secret, wrong uid or wrong peer pid */
#define VMMIPC_ENOENT (-4)     /* unknown, used-up, unregistered or expired */
#define VMMIPC_EIO (-5)        /* socket error, peer gone or timed out */
#define VMMIPC_EEXPORT (-6)    /* the sender could not export a chunk */
#define VMMIPC_ECUDA (-7)      /* CUDA driver missing or a driver call failed */
#define VMMIPC_ENFILE (-8)     /* out of file descriptors */
#define VMMIPC_EFORK (-9)      /* called in a child after fork() */
#define VMMIPC_EINTERNAL (-10) /* a bug in libvmmipc (a recovered panic) */

/* Memory kinds recorded in a ticket. */
#define VMMIPC_MEMORY_HOST 1 /* descriptors are mmap-able files (memfd) */
#define VMMIPC_MEMORY_CUDA 2 /* descriptors are CUDA POSIX-fd shareable handles */

/* A ticket: plain data naming one registration. Copy it freely. It holds the
 * server's socket address, the exporter's pid, the registration id, a 256-bit
 * secret, the chunk count, the total size, the memory kind and (CUDA) the
 * exporting GPU's UUID. Whoever holds a ticket can map the memory: treat it
 * like a password. */
typedef struct vmmipc_ticket {
  unsigned char bytes[VMMIPC_TICKET_SIZE];
} vmmipc_ticket;

/* Options. Always fill with vmmipc_options_init() first, then change fields
 * (a struct with only struct_size set would mean uses = 0, "unlimited").
 * Pass NULL for all defaults.
 * struct_size lets the struct grow: the library reads only the fields that
 * fit in struct_size. Fields marked "sender" matter to register calls,
 * "receiver" to open and import calls; the others are ignored. */
typedef struct vmmipc_options {
  uint32_t struct_size; /* sizeof(vmmipc_options) */
  uint32_t uses;        /* sender: receivers allowed to finish (default 1;
                           0 = until unregistered or expired) */
  uint64_t ttl_ms;      /* sender: the registration ends after this many
                           milliseconds (default 0 = never) */
  uint32_t timeout_ms;  /* receiver: give up when the peer is silent this long
                           (default 30000) */
  uint32_t window;      /* receiver: chunk requests kept in flight
                           (default 0 = the library's choice; 1 = lockstep) */
  uint32_t memory_kind; /* sender, vmmipc_register only: VMMIPC_MEMORY_HOST
                           (default) or VMMIPC_MEMORY_CUDA */
  uint32_t access_device_count; /* receiver, CUDA: entries in access_devices */
  const int32_t *access_devices; /* receiver, CUDA: extra device ordinals that
                           get read-write access to the mapping (borrowed for
                           the duration of the call) */
} vmmipc_options;

/* ------------------------------------------------------------------ */
/* Sender                                                             */
/* ------------------------------------------------------------------ */

/* Called by the library's server thread when a receiver asks for chunk
 * `index`. Store a NEW descriptor for that chunk in *fd_out and return 0; the
 * library sends it and closes it. The chunk's bytes must start at offset 0
 * of the descriptor. Return non-zero to fail this chunk: the receiver gets
 * VMMIPC_EEXPORT naming the chunk and the value returned. Called from any
 * thread, one call at a time per receiver (several receivers may call
 * concurrently). Never called after release_fn has started. */
typedef int (*vmmipc_export_fn)(void *user, uint64_t index, int *fd_out);

/* Called exactly once when a registration ends (uses consumed, ttl expired,
 * vmmipc_unregister), after the last export_fn call has returned, from any
 * thread. Use it to drop whatever the registration pinned. Must not call
 * back into libvmmipc. */
typedef void (*vmmipc_release_fn)(void *user);

/* vmmipc_options_init fills the first `size` bytes of *opts with the
 * defaults and sets struct_size; pass sizeof *opts, so that a program built
 * against this header keeps working with a later library whose struct is
 * larger (the library never writes past `size`).
 * Returns:
 *   VMMIPC_OK
 *   VMMIPC_EINVAL  opts is NULL, or size is smaller than struct_size and uses */
int vmmipc_options_init(vmmipc_options *opts, size_t size);

/* vmmipc_register records a buffer of `count` chunks of sizes[0..count) with
 * this process's server (started on first use) and fills *ticket_out. Opens
 * no descriptor. Each chunk is exported only when a receiver asks for it, by
 * calling export_fn(user, index, &fd). `sizes` is copied; `user` is borrowed
 * until release_fn(user) runs (release_fn may be NULL). The ticket's memory
 * kind is opts->memory_kind. For VMMIPC_MEMORY_HOST every size except the
 * last must be a multiple of the page size.
 * Returns:
 *   VMMIPC_OK      *ticket_out is filled; release_fn will run exactly once
 *   VMMIPC_EINVAL  NULL argument, count 0, a zero size, sizes that overflow
 *                  or host sizes not page aligned (release_fn is not called)
 *   VMMIPC_EIO     the server could not start (socket, bind, listen)
 *   VMMIPC_ENFILE  no descriptor free to start the server
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_register(const uint64_t *sizes, uint64_t count,
                    vmmipc_export_fn export_fn, vmmipc_release_fn release_fn,
                    void *user, const vmmipc_options *opts,
                    vmmipc_ticket *ticket_out);

/* vmmipc_register_host_file registers bytes [0, size) of an mmap-able file
 * (a memfd, a /dev/shm file) as ceil(size / chunk_size) chunks of
 * host memory. `fd` is borrowed: keep it open until release_fn(user) runs.
 * For each chunk a receiver asks for, the library sends a new descriptor of
 * the same file (F_DUPFD_CLOEXEC) with the chunk's file offset, and closes
 * it. chunk_size must be a multiple of the page size. Seal the file against
 * shrinking (F_SEAL_SHRINK) if receivers must never see SIGBUS.
 * Returns:
 *   VMMIPC_OK      *ticket_out is filled; release_fn will run exactly once
 *   VMMIPC_EINVAL  bad fd, size 0, size larger than the file, chunk_size 0
 *                  or not page aligned
 *   VMMIPC_EIO     the server could not start
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_register_host_file(int fd, uint64_t size, uint64_t chunk_size,
                              vmmipc_release_fn release_fn, void *user,
                              const vmmipc_options *opts,
                              vmmipc_ticket *ticket_out);

/* vmmipc_register_cuda registers the CUDA VMM range [dptr, dptr + size).
 * The range must be mapped with cuMemMap from allocations created with
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among their requested handle
 * types, and must start and end on allocation boundaries. The library takes
 * its own reference to every allocation (cuMemRetainAllocationHandle): the
 * caller may unmap and release its buffer right after this returns; the
 * memory stays valid for receivers and is released when the registration
 * ends. Opens no descriptor. Needs no current context.
 * Returns:
 *   VMMIPC_OK      *ticket_out is filled
 *   VMMIPC_EINVAL  NULL ticket_out, size 0, range not on allocation
 *                  boundaries, or an allocation not exportable as a POSIX fd
 *                  (the message names the handle types it allows)
 *   VMMIPC_ECUDA   libcuda.so.1 not found or a driver call failed
 *   VMMIPC_EIO     the server could not start
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_register_cuda(uint64_t dptr, uint64_t size,
                         const vmmipc_options *opts,
                         vmmipc_ticket *ticket_out);

/* vmmipc_register_cuda_handles registers `count` CUmemGenericAllocationHandle
 * values handles[i] of sizes[i] bytes, in that order, as one buffer. The
 * handles are BORROWED: they must stay valid (not cuMemRelease'd) until
 * release_fn(user) runs. All must live on one GPU and allow POSIX-fd export.
 * `handles` and `sizes` are copied.
 * Returns: as vmmipc_register_cuda, and VMMIPC_EINVAL for NULL arrays,
 * count 0 or a size that does not match the handle's allocation. */
int vmmipc_register_cuda_handles(const uint64_t *handles,
                                 const uint64_t *sizes, uint64_t count,
                                 vmmipc_release_fn release_fn, void *user,
                                 const vmmipc_options *opts,
                                 vmmipc_ticket *ticket_out);

/* vmmipc_unregister ends a registration early. Receivers that have not
 * started are refused with VMMIPC_ENOENT; streams in progress are cut and
 * their receivers get VMMIPC_ENOENT or VMMIPC_EIO. Memory already imported
 * by receivers stays valid. release_fn runs once the last in-flight
 * export_fn has returned: before this returns if none is in flight,
 * otherwise shortly after, on a library thread.
 * Returns:
 *   VMMIPC_OK
 *   VMMIPC_EINVAL  NULL or malformed ticket
 *   VMMIPC_EAUTH   the ticket's secret does not match (forged or corrupted)
 *   VMMIPC_ENOENT  not registered in this process, or already ended
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_unregister(const vmmipc_ticket *ticket);

/* vmmipc_live_registrations stores the number of registrations of this
 * process that have not ended yet.
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL), VMMIPC_EFORK */
int vmmipc_live_registrations(uint64_t *count_out);

/* ------------------------------------------------------------------ */
/* Tickets                                                            */
/* ------------------------------------------------------------------ */

typedef struct vmmipc_ticket_info {
  uint32_t memory_kind;  /* VMMIPC_MEMORY_HOST or VMMIPC_MEMORY_CUDA */
  uint32_t exporter_pid; /* pid of the registering process */
  uint64_t chunk_count;
  uint64_t total_size;   /* bytes, the sum of all chunk sizes */
  unsigned char device_uuid[16]; /* CUDA: exporting GPU; host: zeros */
} vmmipc_ticket_info;

/* vmmipc_ticket_decode decodes a ticket without contacting anyone.
 * Returns:
 *   VMMIPC_OK
 *   VMMIPC_EINVAL  NULL argument, or a malformed ticket (wrong magic, another
 *                  format version, bad field); the message says which */
int vmmipc_ticket_decode(const vmmipc_ticket *ticket, vmmipc_ticket_info *info_out);

/* ------------------------------------------------------------------ */
/* Receiver, low level: one descriptor at a time                      */
/* ------------------------------------------------------------------ */

typedef struct vmmipc_stream vmmipc_stream; /* opaque */

typedef struct vmmipc_chunk {
  uint64_t index;       /* 0 .. count-1, in order */
  uint64_t offset;      /* byte offset of this chunk in the whole buffer */
  uint64_t size;        /* bytes */
  int fd;               /* a new O_CLOEXEC descriptor: the caller closes it */
  uint32_t reserved_;
  uint64_t file_offset; /* where the chunk starts inside fd (host files;
                           0 for CUDA handles) */
} vmmipc_chunk;

/* vmmipc_open connects to the ticket's server, checks that the socket
 * belongs to the ticket's pid (SO_PEERCRED), presents the secret and claims
 * one use of the registration. The use is spent once the exporter has sent
 * every chunk to this stream; a stream that is closed, or whose process
 * dies, before that gives it back.
 * *stream_out belongs to the caller: release it with vmmipc_close.
 * Returns:
 *   VMMIPC_OK      *stream_out is a new stream
 *   VMMIPC_EINVAL  NULL argument or malformed ticket
 *   VMMIPC_EAUTH   wrong secret, our uid refused, or the socket belongs to
 *                  another process than the ticket's pid
 *   VMMIPC_ENOENT  unknown, unregistered, used-up or expired registration
 *   VMMIPC_EIO     cannot connect (exporter gone?), or timed out
 *   VMMIPC_ENFILE  out of descriptors
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_open(const vmmipc_ticket *ticket, const vmmipc_options *opts,
                vmmipc_stream **stream_out);

/* vmmipc_stream_info stores the chunk count and total size (either pointer
 * may be NULL).
 * Returns: VMMIPC_OK, VMMIPC_EBADF (NULL, stale or closed stream) */
int vmmipc_stream_info(const vmmipc_stream *stream, uint64_t *count_out,
                       uint64_t *total_size_out);

/* vmmipc_pull_next receives the next chunk. On VMMIPC_OK chunk_out->fd is a
 * new O_CLOEXEC descriptor that the caller must close. After the last chunk
 * it returns VMMIPC_END (the exporter confirms the use). After an error the stream
 * is broken: every later call returns the same error; close it.
 * Returns:
 *   VMMIPC_OK      *chunk_out filled, chunk_out->fd is yours
 *   VMMIPC_END     all chunks were pulled; chunk_out untouched
 *   VMMIPC_EBADF   NULL, stale or closed stream
 *   VMMIPC_EINVAL  NULL chunk_out, or the peer broke the protocol
 *   VMMIPC_EEXPORT the sender failed to export this chunk
 *   VMMIPC_ENOENT  the registration ended while streaming
 *   VMMIPC_EIO     peer gone or silent for timeout_ms
 *   VMMIPC_ENFILE  no descriptor free to receive the chunk
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_pull_next(vmmipc_stream *stream, vmmipc_chunk *chunk_out);

/* vmmipc_close closes a stream and frees it; the handle becomes stale.
 * Returns: VMMIPC_OK, VMMIPC_EBADF (NULL, stale or already closed) */
int vmmipc_close(vmmipc_stream *stream);

/* ------------------------------------------------------------------ */
/* Receiver, high level: reserve, then import/map one chunk at a time  */
/* ------------------------------------------------------------------ */

typedef struct vmmipc_mapping {
  uint64_t addr;        /* start of the mapping: a host pointer, or a CUDA
                           device pointer (CUdeviceptr) */
  uint64_t size;        /* bytes mapped (the ticket's total size) */
  int32_t device;       /* VMMIPC_DEVICE_HOST or the CUDA ordinal used */
  uint32_t memory_kind; /* VMMIPC_MEMORY_HOST or VMMIPC_MEMORY_CUDA */
  uint64_t private_[4]; /* the library's; do not touch */
} vmmipc_mapping;

/* vmmipc_import_stream maps the whole buffer named by the ticket into this
 * process. It reserves the full address range first, then for each chunk:
 * receives its descriptor, imports and maps it at its offset, closes the
 * descriptor. All or nothing: on any failure everything mapped so far is
 * unmapped, the reservation is released, the descriptor in hand is closed,
 * and the message names the chunk and the call that failed.
 *   device = VMMIPC_DEVICE_HOST for host tickets (read-write shared mapping);
 *   device >= 0 or VMMIPC_DEVICE_SAME for CUDA tickets: the mapping gets
 *   read-write access for that device (and opts->access_devices). Works with
 *   or without a current context on the calling thread and leaves it as it
 *   was.
 * *mapping_out belongs to the caller; undo it with vmmipc_unmap.
 * Returns:
 *   VMMIPC_OK      *mapping_out describes the new mapping
 *   VMMIPC_EINVAL  NULL argument, malformed ticket, device that does not fit
 *                  the ticket's memory kind, or a protocol violation
 *   VMMIPC_EAUTH, VMMIPC_ENOENT, VMMIPC_EIO, VMMIPC_ENFILE  as vmmipc_open
 *   VMMIPC_EEXPORT the sender failed to export chunk k (named)
 *   VMMIPC_ECUDA   a driver call failed for chunk k (named), or no driver
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_import_stream(const vmmipc_ticket *ticket, int device,
                         const vmmipc_options *opts,
                         vmmipc_mapping *mapping_out);

/* vmmipc_unmap undoes a mapping made by vmmipc_import_stream completely
 * (unmap, release, free the address range) and zeroes *mapping.
 * Returns:
 *   VMMIPC_OK
 *   VMMIPC_EINVAL  NULL, or not a live mapping of this process (already
 *                  unmapped, or never mapped); nothing is touched
 *   VMMIPC_ECUDA   a driver call failed while unmapping; the mapping is
 *                  forgotten all the same (a retry gives VMMIPC_EINVAL)
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_unmap(vmmipc_mapping *mapping);

/* ------------------------------------------------------------------ */
/* Errors and version                                                 */
/* ------------------------------------------------------------------ */

/* vmmipc_strerror names a status ("VMMIPC_EAUTH: authentication failed").
 * Returns: a static string, never NULL; never free it. */
const char *vmmipc_strerror(int status);

/* vmmipc_last_error gives this thread's detail of its last failed call,
 * e.g. "chunk 17 of 4096: cuMemImportFromShareableHandle:
 * CUDA_ERROR_OUT_OF_MEMORY". Valid until this thread's next libvmmipc call.
 * Returns: a thread-local string, "" if nothing failed yet; never free it. */
const char *vmmipc_last_error(void);

/* vmmipc_version returns the library version, e.g. "0.1.0".
 * Returns: a static string; never free it. */
const char *vmmipc_version(void);

#ifdef __cplusplus
}
#endif

#endif /* VMMIPC_H */
