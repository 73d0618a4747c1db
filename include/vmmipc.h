/*
 * vmmipc.h — share CUDA virtual-memory (VMM) allocations, or chunked host
 * shared memory, between processes one file descriptor at a time.
 *
 * This header is the contract of libvmmipc.so. Read it before the code.
 *
 * How it works
 *   The sender registers a buffer made of N chunks. Registering opens no file
 *   descriptor for the chunks: it records their sizes with a per-process
 *   server and fills in a ticket, 256 bytes of plain data that can be copied,
 *   pickled and sent anywhere. A receiver that holds the ticket connects to
 *   the server, and the two prove to each other that they know the ticket's
 *   secret (the secret itself never crosses the socket). The receiver then
 *   pulls the chunks in order; for each one the server exports exactly that
 *   chunk, sends its single descriptor together with a header in one
 *   message, and closes it. The high-level importer reserves the whole
 *   address range first, then maps the chunks one at a time and closes each
 *   descriptor as soon as it is mapped. Either side holds about one
 *   descriptor at a time, for any number of chunks. Chunks that share one
 *   descriptor (a host file registered with vmmipc_register_host_file: one
 *   memfd) reach the high-level importer as one descriptor for all of them,
 *   mapped with one mmap; the low-level stream still yields them one by
 *   one.
 *
 * Conventions
 *   - Every function returns an int status: VMMIPC_OK (0), VMMIPC_END (1, a
 *     stream is finished; not an error) or a negative VMMIPC_E* error.
 *   - After a negative status, vmmipc_last_error() gives this thread's detail
 *     of what failed and what to do, until this thread's next failed call
 *     replaces it: calls that return VMMIPC_OK or VMMIPC_END leave it as it
 *     was, and other threads' calls never touch it.
 *   - Any function may also return VMMIPC_EINTERNAL: a bug inside libvmmipc,
 *     recovered (a Go panic never reaches the host). The Returns lists below
 *     do not repeat it.
 *   - Every descriptor the library hands out is O_CLOEXEC and belongs to the
 *     caller; every descriptor the caller hands in stays the caller's unless
 *     the function says otherwise.
 *   - All functions are thread-safe. No function blocks forever: receivers
 *     give up after vmmipc_options.timeout_ms, vmmipc_wait after its own
 *     timeout.
 *   - Loading the library changes nothing in the host process: RLIMIT_NOFILE
 *     and every signal disposition stay as they were, except that handlers
 *     the host installed gain SA_ONSTACK (Go requires it: such a handler may
 *     run on a thread the library created). No handler of the library's
 *     stays installed, so a fault inside the library is a crash rather than
 *     a recovered panic. The library must not be unloaded (dlclose).
 *   - The library runs the Go runtime, which cannot survive running out of
 *     address space or memory for itself: such a failure ends the process
 *     ("fatal error: runtime: cannot allocate memory"), it is not a status.
 *     An import first checks that RLIMIT_AS leaves free what it reserves
 *     plus 128 MiB kept for the Go runtime (the process's size read from
 *     /proc/self/statm at the call) and fails cleanly with VMMIPC_ENOMEM,
 *     giving the figures, where it does not. The runtime's own growth
 *     (64 MiB heap arenas, thread stacks) changes that size between calls,
 *     so an import that just fits may be refused the next time: keep a few
 *     hundred MiB of headroom above what you map.
 *   - After fork(), every function returns VMMIPC_EFORK in the child (the Go
 *     runtime inside does not survive fork), except the arena calls, which
 *     are plain C made for forked children ("Arenas"), vmmipc_last_error,
 *     vmmipc_version and vmmipc_strerror (which there names VMMIPC_EFORK
 *     and calls every other status unknown). Start helpers with exec or
 *     posix_spawn, or with Python's "spawn"/"forkserver" start methods.
 *
 * Trust
 *   Tickets hold a 256-bit secret: whoever holds a ticket can map the memory,
 *   so treat it like a password. A receiver accepts a descriptor only from a
 *   server that proved, over a fresh random nonce of the receiver's, that it
 *   knows the ticket's secret (HMAC-SHA256, bound to the registration, to
 *   this very connection, by the kernel's cookie of the exporter's socket of
 *   it, and to a digest of the whole ticket); a server exports nothing
 *   before the receiver proved the same, over a fresh nonce of the server's
 *   or, in the exporter's PID and time namespaces (one round trip), bound
 *   to the receiver's pid and start time, which the server reads from the
 *   kernel. A process that takes the
 *   exporter's address after it exited or exec'd, that reuses its pid, that
 *   inherited its listening socket, or that relays between the two (in any
 *   namespace), learns nothing and is refused (VMMIPC_EAUTH, or VMMIPC_EIO
 *   "has exited" at once where the exporter is known to be gone). Before
 *   that, both sides filter peers by uid (SO_PEERCRED): only the same uid,
 *   or root, is served. Any single-byte change of a ticket is refused.
 *   Receivers name the exporter's socket through the kernel's sock_diag for
 *   unix sockets (CONFIG_UNIX_DIAG, the unix_diag module, loaded on demand;
 *   a seccomp profile must allow netlink sockets, as container runtimes'
 *   default ones do). A receiver without it binds the proofs to its own pid
 *   instead, as SO_PEERCRED shows it to the exporter, which works in the
 *   exporter's PID namespace only; in another, vmmipc_open fails with
 *   VMMIPC_EIO saying what is missing.
 *
 * Across containers (other namespaces on the same host)
 *   A receiver in another PID, network, IPC, mount or user namespace than
 *   the exporter (another container, another pod on the node) imports
 *   through a filesystem socket: set VMMIPC_SOCKET_DIR, for the exporter, to
 *   a directory that both sides mount at the same path. Both sides need the
 *   same kernel (host), that directory, uids that are the same user on both
 *   sides (or root), and for CUDA memory the same GPU's device nodes.
 *   The directory: the exporter's first register call fails (VMMIPC_ECONFIG,
 *   saying why) if the directory is missing, or if a uid other than its own
 *   and root could change where the path leads: a directory or symlink on
 *   the path (as named, and where its symlinks lead) belongs to another uid
 *   (but root), or a directory on it is writable by others without the
 *   sticky bit. So a symlink of another user in /tmp is refused: its owner
 *   may replace it there. The exporter checks the path when it starts and
 *   keeps a descriptor of the directory it led to; through it, it creates
 *   its socket there with mode 0600 under a name that cannot collide across
 *   namespaces (vmmipc-<PID namespace>-<pid>-<64 random bits>.sock), and a
 *   .lock file next to it, on which it holds a POSIX lock for its whole
 *   life; at start it removes those of its uid whose lock is free (left by
 *   a crashed exporter), and at exit() its own, through a duplicate of
 *   that descriptor, kept for the purpose: in that directory, wherever the
 *   path leads by then. A receiver checks the ticket's socket directory the
 *   same way (its own uid and root) before it trusts the lock or dials, and
 *   refuses a path another uid could re-point (VMMIPC_ECONFIG, at once,
 *   naming the entry and its owner).
 *   Promised in every namespace: all of "Trust"; a receiver is told at once
 *   (VMMIPC_EIO "has exited") that the exporter of a socket in the
 *   directory is gone when its lock is free (it exited, crashed or exec'd;
 *   also while a forked child still holds its socket, or when only a stale
 *   file is left); the ticket's pid and start time are checked (/proc,
 *   SO_PEERCRED) only in the exporter's PID (and time) namespace, where
 *   they mean something. A ticket naming an abstract socket is refused at
 *   once (VMMIPC_EIO, saying to set VMMIPC_SOCKET_DIR) by a receiver in
 *   another network or PID namespace.
 *   Not promised: a process of the same uid that can write the directory
 *   can deny service (remove or replace the socket file; or take a dead
 *   exporter's lock and address and answer nothing, so that receivers wait
 *   timeout_ms); the path must be the same on both sides; _exit() and fatal
 *   signals leave the socket and lock files (the next exporter removes
 *   them).
 *
 * Limits of a sender
 *   A sender serves at most C receivers at once, C = its soft RLIMIT_NOFILE
 *   / 4 (read at each connection), clamped to [16, 1024], and never more
 *   than its free descriptors allow: a connection takes a socket and, while
 *   a chunk is sent, that chunk's descriptor, so another is accepted only
 *   while two descriptors are free for it beside one for each connection
 *   held (at a soft limit up to 4096, the process's open descriptors are
 *   counted at each connection, without opening one: at a small limit, such
 *   as 16, that allows fewer than C; above 4096, C connections take at most
 *   half the limit). Receivers beyond that
 *   wait in the listen backlog (the system's maximum, net.core.somaxconn)
 *   and are served in turn as others finish or descriptors free (counted
 *   again with back-off, up to every 200 ms); a sender with no descriptor
 *   free serves nobody until one frees, and its receivers wait within their
 *   timeout_ms. Descriptors that other threads of the host take after the
 *   count can still make a chunk's export fail (VMMIPC_EEXPORT, saying so). A
 *   receiver whose connect finds the backlog full retries with back-off
 *   until its timeout_ms. Connections that have not yet authenticated have
 *   a bound of their own, max(4, C/4), and must authenticate within 2
 *   seconds; when that bound is full, the
 *   oldest of them (if older than 100 ms) is dropped. A connection dropped
 *   either way is told "busy" first, and a libvmmipc receiver told so
 *   retries within its timeout_ms. So idle connections cannot lock
 *   authenticated receivers out. Peers of a foreign uid are told why and
 *   dropped at once (at most 64 at a time; beyond that, without a word).
 *   Holds cost a sender one descriptor in all, its lease file, whatever the
 *   number of receivers holding from it, and its grant table one more (see
 *   vmmipc_import_stream), whatever the number of grants and receivers; no
 *   connection stays open for
 *   them (see "Holds"): a held use or a release is a short connection,
 *   counted as any other while it runs. A receiver process may have at
 *   most 4 leases at one sender (a fifth is refused with VMMIPC_EIO), so
 *   one that asks for leases in a loop cannot lock others out.
 *
 * Host memory
 *   Host chunks travel as descriptors of memfds, which every receiver maps
 *   read-write and shared into its reserved range. A descriptor is input:
 *   the registration (vmmipc_register_host_file) and every receiver check
 *   it, and refuse with VMMIPC_EINVAL, saying why and what to do, anything
 *   but a memfd of ordinary shared memory (tmpfs, not MFD_HUGETLB) that is
 *   sealed with F_SEAL_SHRINK, open O_RDWR, not sealed with F_SEAL_WRITE or
 *   F_SEAL_FUTURE_WRITE, and holds the bytes mapped. Then nothing another
 *   holder of the file does can crash a receiver: the file cannot shrink
 *   under a mapping (which is SIGBUS); a hole punched in it (fallocate
 *   FALLOC_FL_PUNCH_HOLE, which F_SEAL_SHRINK allows) reads back as zeros,
 *   its pages allocated afresh when touched as in any sparse file; a mapping
 *   covers the chunk's own pages (a last chunk's length rounded up to a
 *   page) and never more; and seals added later leave a mapping made as it
 *   is (the kernel refuses F_SEAL_WRITE while it exists). Huge pages
 *   (hugetlbfs) are refused, since that cannot be promised for them: their
 *   mappings cover whole huge pages, past a chunk that is not a multiple of
 *   one, and a holder that punches a hole and takes the free huge pages
 *   makes the receiver's next touch of the hole SIGBUS. Transparent huge
 *   pages that the kernel gives a memfd are fine.
 *   Seals: every receiver gets a read-write descriptor of the file. Were
 *   the file without F_SEAL_SEAL, one could seal it against writing, and
 *   every later receiver would be refused. So registering seals the file:
 *   vmmipc_register_host_file adds F_SEAL_SEAL to it (if it lacks it) once
 *   the file passed the checks, after which no one can add or change a
 *   seal; add any seal you want (F_SEAL_GROW) before registering. That seal
 *   is the call's last step: a call that fails, for whatever reason, leaves
 *   the file's seals as they were. An export_fn (vmmipc_register)
 *   makes its own descriptors: seal a file you hand out more than once with
 *   F_SEAL_SEAL yourself.
 */
#ifndef VMMIPC_H
#define VMMIPC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define VMMIPC_VERSION_MAJOR 0
#define VMMIPC_VERSION_MINOR 2
#define VMMIPC_VERSION_PATCH 0

/* Size of a ticket in bytes. The layout carries a format version (4: it
 * records the exporter's namespaces and whether the registration holds);
 * a ticket of another version is refused with VMMIPC_EINVAL naming both
 * versions. */
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
#define VMMIPC_EAUTH (-3)      /* a peer failed to prove it knows the secret,
                                  or has the wrong uid or pid */
#define VMMIPC_ENOENT (-4)     /* unknown, used-up, unregistered or expired;
                                  or not what was asked for (see each call) */
#define VMMIPC_EIO (-5)        /* socket error, peer gone or timed out */
#define VMMIPC_EEXPORT (-6)    /* the sender could not export a chunk */
#define VMMIPC_ECUDA (-7)      /* CUDA driver missing or a driver call failed */
#define VMMIPC_ENFILE (-8)     /* out of file descriptors */
#define VMMIPC_EFORK (-9)      /* called in a child after fork() */
#define VMMIPC_EINTERNAL (-10) /* a bug in libvmmipc (a recovered panic) */
#define VMMIPC_ENOMEM (-11)    /* no address space for a reservation
                                  (RLIMIT_AS, or the driver's VA space);
                                  pools: no GPU memory for a chunk */
#define VMMIPC_ETIMEDOUT (-12) /* vmmipc_wait: the registration is still live */
#define VMMIPC_ECONFIG (-13)   /* this process's configuration is wrong, not
                                  the I/O: VMMIPC_SOCKET_DIR missing, not a
                                  directory, too long or unsafe (here or as
                                  a ticket names it), or a bad value of a
                                  VMMIPC_* variable; fix it and try again */

/* Memory kinds recorded in a ticket. */
#define VMMIPC_MEMORY_HOST 1 /* descriptors are sealed memfds (mmap-able) */
#define VMMIPC_MEMORY_CUDA 2 /* descriptors are CUDA POSIX-fd shareable handles */

/* Bounds of vmmipc_options fields (larger values give VMMIPC_EINVAL). */
#define VMMIPC_MAX_WINDOW 1024u             /* window */
#define VMMIPC_MAX_ACCESS_DEVICES 64u       /* access_device_count */
#define VMMIPC_MAX_TTL_MS (1ull << 40)      /* ttl_ms (about 35 years) */
#define VMMIPC_MAX_CHUNKS (1ull << 26)      /* chunks in one registration */

/* vmmipc_options.import_flags */
#define VMMIPC_IMPORT_NO_CACHE 0x1u      /* neither reuse nor keep a cached mapping */
#define VMMIPC_IMPORT_CONFIRM_LATER 0x2u /* a cache hit returns at once and its
                                            use is spent in the background
                                            (vmmipc_import_stream,
                                            vmmipc_confirm) */
#define VMMIPC_IMPORT_HOLD 0x4u /* hold the use until vmmipc_release or this
                                   process ends (see "Holds"); not with
                                   VMMIPC_IMPORT_CONFIRM_LATER */

/* vmmipc_options.register_flags */
#define VMMIPC_REGISTER_HOLD 0x1u /* a receiver's use that asks to hold keeps
                                     the registration's release_fn from
                                     running until it lets go (see "Holds") */

/* A ticket: plain data naming one registration. Copy it freely. It holds the
 * server's socket address, the exporter's pid and process start time and
 * the identity of its PID, network and time namespaces, the registration id, the buffer id (the identity of the memory, shared by
 * registrations of the same memory), a 256-bit secret, the chunk count, the
 * total size, the memory kind and (CUDA) the exporting GPU's UUID. Whoever
 * holds a ticket can map the memory: treat it like a password. */
typedef struct vmmipc_ticket {
  unsigned char bytes[VMMIPC_TICKET_SIZE];
} vmmipc_ticket;

/* Options. Always fill with vmmipc_options_init() first, then change fields
 * (a struct with only struct_size set would mean uses = 0, "unlimited").
 * Pass NULL for all defaults.
 * struct_size lets the struct grow: the library reads only the fields that
 * fit in struct_size. Fields marked "sender" matter to register calls,
 * "receiver" to open and import calls; the others are ignored, but checked:
 * every call that takes opts refuses with VMMIPC_EINVAL ("an option out of
 * bounds" in the Returns lists) a struct_size under 4, a ttl_ms, memory_kind
 * or access_device_count beyond its bound, access_devices NULL with
 * access_device_count above 0, and register_flags with unknown bits;
 * receiver calls (open, import, confirm) also a window beyond its bound. */
typedef struct vmmipc_options {
  uint32_t struct_size; /* sizeof(vmmipc_options) */
  uint32_t uses;        /* sender: receivers allowed to finish (default 1;
                           0 = until unregistered or expired) */
  uint64_t ttl_ms;      /* sender: the registration ends after this many
                           milliseconds (default 0 = never; at most
                           VMMIPC_MAX_TTL_MS) */
  uint32_t timeout_ms;  /* receiver: give up when the peer is silent this long
                           (default 30000; 0 = the default) */
  uint32_t window;      /* receiver: chunk requests kept in flight
                           (default 0 = the library's choice, 16; 1 =
                           lockstep; at most VMMIPC_MAX_WINDOW); unused
                           when vmmipc_import_stream receives a host file
                           in one descriptor */
  uint32_t memory_kind; /* sender, vmmipc_register only: VMMIPC_MEMORY_HOST
                           (default) or VMMIPC_MEMORY_CUDA */
  uint32_t access_device_count; /* receiver, CUDA: entries in access_devices
                           (at most VMMIPC_MAX_ACCESS_DEVICES) */
  const int32_t *access_devices; /* receiver, CUDA: extra device ordinals that
                           get read-write access to the mapping (borrowed for
                           the duration of the call) */
  uint32_t import_flags; /* receiver, vmmipc_import_stream, vmmipc_confirm:
                            VMMIPC_IMPORT_* bits (default 0: use the import
                            cache) */
  uint32_t register_flags; /* sender: VMMIPC_REGISTER_* bits (default 0) */
} vmmipc_options;

/* ------------------------------------------------------------------ */
/* Sender                                                             */
/* ------------------------------------------------------------------ */

/* Lifetime, for every register call:
 *   - A registration ends when its uses are consumed (a use is consumed
 *     once every chunk has been sent to a receiver, or once a receiver with
 *     a cached mapping has been confirmed: see vmmipc_import_stream), when
 *     its ttl expires, or at vmmipc_unregister. Receivers that had started
 *     keep what they already imported: their mappings hold their own
 *     references to the memory, so the memory stays valid for them after
 *     the registration ends and after the sender frees its buffer.
 *   - "Sent" is not "done": release_fn runs when the library needs nothing
 *     lent to it any more, which can be before a receiver has finished
 *     reading or writing the memory. Use your own signal for "the receiver
 *     is done with the contents".
 *   - The sender's process must stay alive until every receiver has
 *     imported: the server lives in it. vmmipc_wait blocks until a
 *     registration has ended and its release_fn has returned.
 *   - Registrations of the same memory share one buffer identity (the
 *     ticket's buffer id); the library keeps what it exports from until the
 *     last of them has ended. */

/* Holds: memory a receiver holds is never handed out again.
 *   A sender that reuses its memory once a registration is used up (an
 *   allocator that gives a freed block out again: torch's) must not reuse
 *   it while a receiver still reads it. Register with VMMIPC_REGISTER_HOLD
 *   in opts->register_flags, and have receivers import (or confirm) with
 *   VMMIPC_IMPORT_HOLD: each such use is then a *hold*, and release_fn runs
 *   only once the registration has ended AND every receiver that holds one
 *   of its uses has let go, by vmmipc_release or by ending (exit, crash,
 *   SIGKILL: the kernel drops its lease's lock). Uses are counted as ever:
 *   a registration with uses = 1 still serves one receiver.
 *   - Holds live on *leases*, not connections. A receiver's first held use
 *     of an exporter gets a lease on its authenticated session: a slot of
 *     the exporter's one lease file (a sealed memfd of one page), sent as a
 *     descriptor that the receiver locks (an OFD lock on its slot), maps
 *     (one page, MADV_DONTFORK) and closes at once. The kernel drops the
 *     lock when the receiver ends (exit, crash, SIGKILL) and the exporter,
 *     which checks the locks of leases that hold something every 20 ms
 *     (or ten times as long as a pass took, with thousands), then lets go
 *     of every hold on the lease. Later held uses name the lease; each is an
 *     ordinary short session that returns only once the exporter answered
 *     (a hit on a registration that has ended gives VMMIPC_ENOENT, as a
 *     miss does); vmmipc_confirm_many spends many in one round trip per
 *     exporter. Releases wait up to 2 ms for the next held use to that
 *     exporter, which carries them in its first message (a loop of held
 *     uses and releases costs one connection per use); else a library
 *     thread sends them in batches, each on a short connection of its own
 *     proved by the lease's token. A receiver that holds nothing more from
 *     an exporter keeps its lease 250 ms for the next held use, then it
 *     ends (the mapping goes with it). No connection stays open on either side: an
 *     exporter keeps one descriptor (the lease file) for all its receivers,
 *     and a receiver none for its exporters (tests: 1100 holding receivers
 *     at RLIMIT_NOFILE 1024 and 100 at 64 all served with at most 4
 *     descriptors more than with none; a receiver holding from 100
 *     exporters at 64 with at most 4 more than from one).
 *   - A registration made without VMMIPC_REGISTER_HOLD says so in its
 *     tickets, and a receiver asks for no lease for it: the flag then costs
 *     nothing. Only such registrations enter the exporter's grant table, so
 *     a held hit is never believed from the table (see vmmipc_import_stream).
 *   - Bounds: at most 4 live leases per receiver process at one exporter
 *     (threads of one process share one; a fifth is refused with
 *     VMMIPC_EIO saying so), 4096 in all, 2^20 holds per lease. A lease
 *     that holds nothing for 30 s is ended by the exporter (its receiver
 *     just gets a new one).
 *   - A receiver can let go only of what it holds itself: a lease is named
 *     by its slot and a random 32-byte token sent only to the process it
 *     was granted to, and only that process (SO_PEERCRED) may name it.
 *   - Either side without its flag: the use is spent and nothing is held
 *     (release_fn runs as soon as the registration ends).
 *   - fork: a forked child inherits no lease (MADV_DONTFORK) and no
 *     connection, so nothing it does can end or prolong its parent's
 *     holds; an exporter's death is seen by its receivers' next call (pid
 *     and start time; a killed exporter its parent has not reaped yet, a
 *     zombie, has exited too), even while children it forked live on and
 *     hold its socket.
 *   vmmipc_holds counts the holds on this process's registrations;
 *   vmmipc_cache_info counts those this process holds as a receiver. */

/* Called by the library's server thread when a receiver asks for chunk
 * `index`. Store a NEW descriptor for that chunk in *fd_out and return 0; the
 * library sends it and closes it. The chunk's bytes must start at offset 0
 * of the descriptor. For VMMIPC_MEMORY_HOST the descriptor must be a memfd
 * sealed with F_SEAL_SHRINK, open O_RDWR, not of huge pages and not sealed
 * against writing: receivers refuse any other (VMMIPC_EINVAL; see "Host
 * memory"), because a file that can shrink could kill them with SIGBUS. If
 * receivers get the same file more than once, seal it with F_SEAL_SEAL too
 * (after F_SEAL_SHRINK), or one of them could seal it against writing and
 * so refuse the later ones. Return
 * non-zero to fail this chunk: the receiver gets VMMIPC_EEXPORT naming the
 * chunk and the value returned. Called from any thread, one call at a time
 * per receiver (several receivers may call concurrently). Never called after
 * release_fn has started. */
typedef int (*vmmipc_export_fn)(void *user, uint64_t index, int *fd_out);

/* Called exactly once, from any thread, when the library will use nothing
 * lent by this registration again: after the registration ended, after the
 * last export_fn call for it has returned, and (vmmipc_register and
 * vmmipc_register_cuda_handles) once every registration made from it with
 * vmmipc_register_again has ended too. Use it to drop whatever the
 * registration pinned. Must not call back into libvmmipc. */
typedef void (*vmmipc_release_fn)(void *user);

/* vmmipc_options_init fills the first `size` bytes of *opts with the
 * defaults and sets struct_size; pass sizeof *opts, so that a program built
 * against this header keeps working with a later library whose struct is
 * larger (the library never writes past `size`).
 * Returns:
 *   VMMIPC_OK
 *   VMMIPC_EINVAL  opts is NULL, or size is smaller than struct_size and uses
 *                  (8 bytes)
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_options_init(vmmipc_options *opts, size_t size);

/* vmmipc_register records a buffer of `count` chunks of sizes[0..count) with
 * this process's server (started on first use) and fills *ticket_out. Opens
 * no descriptor. Each chunk is exported only when a receiver asks for it, by
 * calling export_fn(user, index, &fd). `sizes` is copied; `user` is borrowed
 * until release_fn(user) runs (release_fn may be NULL); the library never
 * dereferences it, so any value will do (an index cast to void *). The
 * ticket's memory kind is opts->memory_kind. For VMMIPC_MEMORY_HOST every
 * size except the last must be a multiple of the page size, and each
 * descriptor must be a sealed memfd (see vmmipc_export_fn). Every call makes a new buffer
 * identity (the library cannot tell that two export_fns serve the same
 * memory); use vmmipc_register_again for another ticket of the same one.
 * Returns:
 *   VMMIPC_OK      *ticket_out is filled; release_fn will run exactly once
 *   VMMIPC_EINVAL  NULL export_fn, sizes or ticket_out, count 0 or above
 *                  VMMIPC_MAX_CHUNKS, a zero size, sizes that overflow, host
 *                  sizes not page aligned, an unknown memory_kind or an
 *                  option out of bounds (release_fn is not called)
 *   VMMIPC_EIO     the server could not start: socket, bind or listen
 *                  failed
 *   VMMIPC_ECONFIG VMMIPC_SOCKET_DIR is missing, not a directory, too long
 *                  or unsafe (see "Across containers"; the message says why)
 *   VMMIPC_ENFILE  no descriptor free to start the server
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_register(const uint64_t *sizes, uint64_t count,
                    vmmipc_export_fn export_fn, vmmipc_release_fn release_fn,
                    void *user, const vmmipc_options *opts,
                    vmmipc_ticket *ticket_out);

/* vmmipc_register_host_file registers bytes [0, size) of a memfd as
 * ceil(size / chunk_size) chunks of host memory. The memfd must be sealed
 * against shrinking (memfd_create with MFD_ALLOW_SEALING, then fcntl
 * F_ADD_SEALS F_SEAL_SHRINK), so that no receiver can ever see SIGBUS; a
 * file that cannot be sealed (a /dev/shm or disk file), a memfd of huge
 * pages (MFD_HUGETLB), a descriptor not open O_RDWR and a file sealed with
 * F_SEAL_WRITE or F_SEAL_FUTURE_WRITE are refused with a message that says
 * why (see "Host memory"). Registering seals the file: once it passed these
 * checks, the library adds F_SEAL_SEAL to it (if it lacks it), so that no
 * receiver can add a seal that would refuse later receivers; add any seal
 * you want before registering. A seal cannot be taken back, so adding it is
 * the call's last step: on every failure below (the checks, the server
 * that could not start, no descriptor free, an option out of bounds) the
 * file's seals are as they were before the call. (The one exception:
 * another holder of the file sealing it against writing during the call,
 * which is refused with VMMIPC_EINVAL and leaves the file unusable for
 * sharing anyway.) chunk_size must be a multiple of the page size.
 * Descriptors: the library keeps ONE duplicate of fd (F_DUPFD_CLOEXEC) per
 * registered file, whatever the chunk count, until the last registration of
 * that file has ended; the caller's fd stays the caller's and may be closed
 * right after this returns. For each chunk a vmmipc_pull_next asks for,
 * the library sends a new duplicate of its own with the chunk's file
 * offset, and closes it; vmmipc_import_stream gets one duplicate for all
 * the chunks (they lie back to back in the file) and maps it with one
 * mmap. Registering the same file (same inode) with the same size and
 * chunk_size as a live registration of this process gives a ticket of the
 * same buffer identity and takes no new descriptor. release_fn(user), if not
 * NULL, runs exactly once when this registration has ended.
 * Returns:
 *   VMMIPC_OK      *ticket_out is filled; release_fn will run exactly once
 *   VMMIPC_EINVAL  NULL ticket_out, fd not open or not a regular file, size
 *                  0, size larger than the file, chunk_size 0 or not page
 *                  aligned, more than VMMIPC_MAX_CHUNKS chunks, a file that
 *                  is not sealed against shrinking or cannot be sealed, a
 *                  file of huge pages, fd not open O_RDWR, a file sealed
 *                  against writing, or an option out of bounds
 *   VMMIPC_EIO     the server could not start (as vmmipc_register)
 *   VMMIPC_ECONFIG VMMIPC_SOCKET_DIR is unusable (as vmmipc_register)
 *   VMMIPC_ENFILE  no descriptor free for the duplicate or the server
 *   VMMIPC_EFORK   called after fork()
 *   On every error release_fn is not called and the file's seals are as
 *   they were. */
int vmmipc_register_host_file(int fd, uint64_t size, uint64_t chunk_size,
                              vmmipc_release_fn release_fn, void *user,
                              const vmmipc_options *opts,
                              vmmipc_ticket *ticket_out);

/* vmmipc_register_cuda registers the CUDA VMM range [dptr, dptr + size).
 * The range must be mapped with cuMemMap from allocations created with
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among their requested handle
 * types, and must start and end on allocation boundaries (see
 * vmmipc_cuda_query_range). The library takes its own reference to every
 * allocation (cuMemRetainAllocationHandle): the caller may unmap and release
 * its buffer right after this returns; the memory stays valid for receivers
 * and is released when the last registration of it ends. Registering
 * exactly the allocations of a live registration of this process (the same
 * ones, in the same order; compared while the library holds its references,
 * so a freed and reused handle can never match) gives a ticket of the same
 * buffer identity. Opens no descriptor. Needs no current context.
 * Returns:
 *   VMMIPC_OK      *ticket_out is filled
 *   VMMIPC_EINVAL  NULL ticket_out, dptr 0, size 0, a range that overflows,
 *                  range not on allocation boundaries, more than
 *                  VMMIPC_MAX_CHUNKS allocations, allocations on more than
 *                  one GPU or not on a GPU, an allocation not exportable as
 *                  a POSIX fd (the message names the handle types it
 *                  allows), or an option out of bounds
 *   VMMIPC_ECUDA   libcuda.so.1 not found, dptr is not VMM memory, or a
 *                  driver call failed
 *   VMMIPC_EIO     the server could not start (as vmmipc_register)
 *   VMMIPC_ECONFIG VMMIPC_SOCKET_DIR is unusable (as vmmipc_register)
 *   VMMIPC_ENFILE  no descriptor free to start the server
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_register_cuda(uint64_t dptr, uint64_t size,
                         const vmmipc_options *opts,
                         vmmipc_ticket *ticket_out);

/* vmmipc_register_cuda_handles registers `count` CUmemGenericAllocationHandle
 * values handles[i] of sizes[i] bytes, in that order, as one buffer. The
 * handles are BORROWED: they must stay valid (not cuMemRelease'd) until
 * release_fn(user) runs. All must live on one GPU and allow POSIX-fd export.
 * `handles` and `sizes` are copied. Every call makes a new buffer identity
 * (the library holds no reference of its own to compare by); use
 * vmmipc_register_again for another ticket of the same one.
 * Returns: as vmmipc_register_cuda, and VMMIPC_EINVAL for NULL arrays,
 * count 0 or above VMMIPC_MAX_CHUNKS, a handle that is not a live
 * allocation, or a size that does not match the handle's allocation
 * (release_fn is not called on any error). */
int vmmipc_register_cuda_handles(const uint64_t *handles,
                                 const uint64_t *sizes, uint64_t count,
                                 vmmipc_release_fn release_fn, void *user,
                                 const vmmipc_options *opts,
                                 vmmipc_ticket *ticket_out);

/* vmmipc_register_again makes a new registration of the memory named by
 * `ticket`, a live registration of this process: a new ticket with its own
 * uses, ttl (from opts) and secret, and the same buffer identity, so that a
 * receiver holding a cached mapping of it imports the new ticket in one
 * connection (see vmmipc_import_stream). Opens no descriptor and makes no
 * driver call. release_fn(user), if not NULL, runs exactly once when the new
 * registration has ended. The original registration's memory stays
 * exported for as long as any registration made from it lives.
 * Returns:
 *   VMMIPC_OK      *ticket_out is filled; release_fn will run exactly once
 *   VMMIPC_EINVAL  NULL ticket or ticket_out, malformed ticket, a ticket
 *                  that is not byte for byte the one issued, or an option
 *                  out of bounds (release_fn is not called)
 *   VMMIPC_EAUTH   the ticket's secret does not match (forged or corrupted)
 *   VMMIPC_ENOENT  not a registration of this process, or it has ended
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_register_again(const vmmipc_ticket *ticket,
                          vmmipc_release_fn release_fn, void *user,
                          const vmmipc_options *opts,
                          vmmipc_ticket *ticket_out);

/* vmmipc_unregister ends a registration early. Receivers that have not
 * started are refused with VMMIPC_ENOENT; streams in progress are cut and
 * their receivers get VMMIPC_ENOENT or VMMIPC_EIO. Memory already imported
 * by receivers stays valid. release_fn runs once the last in-flight
 * export_fn has returned: before this returns if none is in flight,
 * otherwise shortly after, on a library thread (vmmipc_wait tells when).
 * Returns:
 *   VMMIPC_OK
 *   VMMIPC_EINVAL  NULL or malformed ticket, or one that is not byte for
 *                  byte the one issued
 *   VMMIPC_EAUTH   the ticket's secret does not match (forged or corrupted)
 *   VMMIPC_ENOENT  not registered in this process, or already ended
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_unregister(const vmmipc_ticket *ticket);

/* vmmipc_exiting tells the library that this process is on its way out:
 * registrations that vmmipc_unregister ends from now on tell receivers that
 * their exporter is exiting (ENOENT "registration 2 has ended: its exporter
 * (pid 123) is exiting") rather than that its owner unregistered them. For
 * hosts that end their registrations as they exit (Python's vmmipc does,
 * from its exit hook); it ends nothing itself.
 * Returns: VMMIPC_OK, VMMIPC_EFORK */
int vmmipc_exiting(void);

/* vmmipc_wait blocks until the registration named by `ticket` (one of this
 * process's) has ended and its release_fn, if any, has returned, or until
 * timeout_ms milliseconds have passed (0: just check). After VMMIPC_OK the
 * library holds nothing that registration lent it.
 * Returns:
 *   VMMIPC_OK        it has ended (now or earlier) and been released
 *   VMMIPC_ETIMEDOUT it is still live (or its release_fn still running)
 *   VMMIPC_EINVAL    NULL or malformed ticket, or a live registration's
 *                    ticket with other bytes changed
 *   VMMIPC_EAUTH     the ticket's secret does not match a live registration
 *   VMMIPC_ENOENT    the ticket was not issued by this process
 *   VMMIPC_EFORK     called after fork() */
int vmmipc_wait(const vmmipc_ticket *ticket, uint32_t timeout_ms);

/* vmmipc_live_registrations stores the number of registrations of this
 * process that have not ended yet.
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL), VMMIPC_EFORK */
int vmmipc_live_registrations(uint64_t *count_out);

/* vmmipc_live_many tells which of `count` tickets name live registrations
 * of this process, in one call: live_out[i] is set to 1 if tickets[i] is
 * byte for byte a ticket this process issued and its registration has not
 * ended (used up, expired or unregistered; unlike vmmipc_wait, an ended
 * registration whose release_fn has not run yet counts as ended), else 0
 * (a malformed ticket, another process's, a wrong secret). For hosts that
 * keep the grants they made without a release_fn and forget the ended ones
 * now and then (Python's HostBuffer does). At most 1048576 tickets a call;
 * the tickets and live_out (room for `count` bytes) stay the caller's.
 * Returns:
 *   VMMIPC_OK      live_out is written (nothing is read with count 0)
 *   VMMIPC_EINVAL  tickets or live_out NULL with count > 0, or count above
 *                  1048576 (live_out untouched)
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_live_many(const vmmipc_ticket *tickets, size_t count, uint8_t *live_out);

/* ------------------------------------------------------------------ */
/* CUDA ranges                                                        */
/* ------------------------------------------------------------------ */

typedef struct vmmipc_cuda_range_info {
  uint64_t base;         /* start of the allocation that holds dptr */
  uint64_t size;         /* from base to the end of the allocation that holds
                            dptr + size - 1: the smallest range on allocation
                            boundaries that covers [dptr, dptr + size) */
  uint32_t handle_types; /* CU_MEM_HANDLE_TYPE_* bits the allocation holding
                            dptr allows (1 = POSIX file descriptor) */
  int32_t device;        /* ordinal of the GPU it lives on */
} vmmipc_cuda_range_info;

/* vmmipc_cuda_query_range tells whether dptr lies in CUDA VMM memory and,
 * if so, which range on allocation boundaries covers [dptr, dptr + size):
 * what vmmipc_register_cuda needs for a buffer that starts or ends inside
 * an allocation (a framework's tensor, say). Opens no descriptor, takes no
 * reference; needs no current context.
 * Returns:
 *   VMMIPC_OK      *info_out is filled
 *   VMMIPC_EINVAL  NULL info_out, size 0, or a range that overflows
 *   VMMIPC_ENOENT  dptr (or dptr + size - 1) is not mapped VMM memory, e.g.
 *                  cudaMalloc or host memory, or it is VMM memory that is
 *                  not on a GPU (the message says which)
 *   VMMIPC_ECUDA   libcuda.so.1 not found or a driver call failed
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_cuda_query_range(uint64_t dptr, uint64_t size,
                            vmmipc_cuda_range_info *info_out);

/* ------------------------------------------------------------------ */
/* Tickets                                                            */
/* ------------------------------------------------------------------ */

typedef struct vmmipc_ticket_info {
  uint32_t memory_kind;  /* VMMIPC_MEMORY_HOST or VMMIPC_MEMORY_CUDA */
  uint32_t exporter_pid; /* pid of the registering process, in its own PID
                            namespace */
  uint64_t chunk_count;
  uint64_t total_size;   /* bytes, the sum of all chunk sizes */
  unsigned char device_uuid[16]; /* CUDA: exporting GPU; host: zeros */
} vmmipc_ticket_info;

/* vmmipc_ticket_decode decodes a ticket without contacting anyone.
 * Returns:
 *   VMMIPC_OK
 *   VMMIPC_EINVAL  NULL argument, or a malformed ticket (wrong magic, another
 *                  format version, bad field); the message says which
 *   VMMIPC_EFORK   called after fork() */
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

/* vmmipc_open checks that the exporter can be reached from here (see
 * "Across containers") and is still the process that issued the ticket (in
 * its PID namespace: its pid exists and started at the ticket's time; with
 * a socket directory whose path no other uid but root could re-point: it
 * still holds its lock there), connects to its
 * server (retrying a full listen backlog within timeout_ms), checks that
 * the socket belongs to our uid or root and, in the exporter's PID
 * namespace, to its pid (SO_PEERCRED), runs the mutual proof of the secret
 * described under "Trust", and claims one use of the registration. The use is spent once
 * the exporter has sent every chunk to this stream; a stream that is
 * closed, or whose process dies, before that gives it back.
 * *stream_out belongs to the caller: release it with vmmipc_close.
 * Returns:
 *   VMMIPC_OK      *stream_out is a new stream
 *   VMMIPC_EINVAL  NULL argument, malformed ticket, option out of bounds, or
 *                  the peer broke the protocol
 *   VMMIPC_EAUTH   the server could not prove it knows the secret (another
 *                  process at the exporter's address, or a corrupted
 *                  ticket), our proof was refused, our uid was refused, or
 *                  the socket belongs to another pid or uid
 *   VMMIPC_ENOENT  unknown, unregistered, used-up or expired registration
 *   VMMIPC_EIO     the exporter has exited (its pid is gone or was reused,
 *                  or its lock is free: at once), cannot be reached from
 *                  here (an abstract socket of another network or PID
 *                  namespace: at once, saying what to set), cannot connect,
 *                  sock_diag is unavailable and the exporter is in another
 *                  PID namespace, or timed out (the message says
 *                  whether the exporter never answered, e.g. at its
 *                  connection cap, or went silent), or the exporter
 *                  reported a failure of its own (the message names the
 *                  status it sent: only EINVAL, EAUTH, ENOENT and EIO are
 *                  passed on as they are). Where the ticket's own fields
 *                  lead nowhere (no such pid, nobody listening, other
 *                  namespaces) the message also says that the ticket may be
 *                  damaged or come from another host or container
 *   VMMIPC_ECONFIG the ticket's socket directory, as this process sees it,
 *                  could be re-pointed by another uid (at once, naming the
 *                  entry and its owner)
 *   VMMIPC_ENFILE  out of descriptors
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_open(const vmmipc_ticket *ticket, const vmmipc_options *opts,
                vmmipc_stream **stream_out);

/* vmmipc_stream_info stores the chunk count and total size (either pointer
 * may be NULL).
 * Returns: VMMIPC_OK, VMMIPC_EBADF (NULL, stale or closed stream),
 * VMMIPC_EFORK */
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
 *   VMMIPC_EEXPORT the sender failed to export this chunk, whatever the
 *                  cause (its own descriptor limit, its driver): the
 *                  message names it
 *   VMMIPC_ENOENT  the registration ended while streaming
 *   VMMIPC_EIO     peer gone or silent for timeout_ms, or it reported a
 *                  failure of its own other than these (named)
 *   VMMIPC_ENFILE  no descriptor free to receive the chunk
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_pull_next(vmmipc_stream *stream, vmmipc_chunk *chunk_out);

/* vmmipc_close closes a stream and frees it; the handle becomes stale.
 * Returns: VMMIPC_OK, VMMIPC_EBADF (NULL, stale or already closed),
 * VMMIPC_EFORK */
int vmmipc_close(vmmipc_stream *stream);

/* ------------------------------------------------------------------ */
/* Receiver, high level: reserve, then import/map one chunk at a time  */
/* (a host file: all its chunks at once)                               */
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
 * process and gives the caller one reference to the mapping.
 *
 * A first import reserves the full address range (after checking that
 * RLIMIT_AS leaves room for it), then for each chunk: receives its
 * descriptor, imports and maps it at its offset, closes the descriptor.
 * Host chunks that one descriptor holds back to back (every chunk of a
 * vmmipc_register_host_file registration) arrive as that one descriptor
 * and are mapped with one mmap; in the exporter's PID namespace such an
 * import is one round trip after connecting (its hello, proof and request
 * for every chunk go in one write, bound to this process's pid and start
 * time, as vmmipc_confirm's), else two. All or nothing: on any failure everything mapped so far is unmapped, the
 * reservation is released, the descriptor in hand is closed, and the
 * message names the chunk and the call that failed.
 * A first import of host memory needs no round trip where the exporter's
 * grant table (below) is mapped here already and vouches for the ticket
 * as it would for a hit, and names the file that holds the buffer (a
 * vmmipc_register_host_file registration): the receiver opens that file
 * itself through /proc/<pid>/fd/<n> (the kernel allows it only to a
 * process that may read the exporter's memory anyway: its uid, unless the
 * exporter made itself non-dumpable, or CAP_SYS_PTRACE), checks that it is
 * the very file the table names (device and inode) and a memfd it would
 * accept from a stream, maps it whole with one mmap and closes it. The
 * exporter must be alive as for a table hit (below). Its use is recorded
 * and spent as a table hit's; vmmipc_cache_info counts
 * it among misses and in table_imports. Anything else (no table yet, a
 * held registration, /proc refusing the descriptor, another file) streams
 * as above, and the exporter judges the ticket. As with hits, two
 * processes that hold one ticket may both map it at once (the later spend
 * fails); each could read that exporter's memory anyway.
 *   device = VMMIPC_DEVICE_HOST for host tickets (read-write shared mapping;
 *   each chunk must be a memfd sealed with F_SEAL_SHRINK, as "Host memory"
 *   says);
 *   device >= 0 or VMMIPC_DEVICE_SAME for CUDA tickets: the mapping gets
 *   read-write access for that device (and opts->access_devices). Works with
 *   or without a current context on the calling thread and leaves it as it
 *   was.
 *
 * The import cache. A process keeps the mappings it imported, keyed by the
 * exporter (address, PID namespace, pid, start time), the buffer identity, the device and
 * the access devices, while the exporter says the buffer lives on after
 * this use. Importing a ticket of a buffer that is mapped here already (a
 * hit: the same ticket again, vmmipc_register_again, or the sender
 * registering the same memory again) returns another reference to the same
 * mapping, at the same address, with no descriptor and no driver call (the
 * device is resolved from a table read once per process), once the ticket
 * is vouched for in one of two ways:
 *   - The grant table, for a registration made without VMMIPC_REGISTER_HOLD
 *     whose exporter is in this process's PID and time namespaces. Each
 *     exporter publishes its live grants that hold nothing in a memfd that it
 *     alone can write (sealed F_SEAL_FUTURE_WRITE, against resizing and further
 *     seals): per grant its id, uses and uses spent, ttl deadline and a hash of
 *     the whole ticket. A receiver gets a read-only descriptor of it in its
 *     first session with that exporter, maps it (384 KiB of address space,
 *     MADV_DONTFORK) and closes the descriptor, and answers with a descriptor
 *     of its own spend log (one page of a memfd, sealed against resizing, which
 *     both map writable, the exporter read-only where the descriptor does not
 *     allow writing; one round trip more, once per exporter). A hit then makes
 *     no round trip: the grant must be published with this very ticket (a
 *     ticket changed in any byte is no table hit), within its ttl, with a use
 *     left that this process has not taken already (else VMMIPC_ENOENT, as the
 *     exporter would answer; where that depends on this process's uses still
 *     being spent, the hit asks the exporter once they are answered, within its
 *     timeout), and the exporter alive: a word of the table's header that the
 *     kernel marks when the exporter's image ends (its exit, SIGKILL included,
 *     before it is a zombie, or an exec; the word is a robust futex held by a
 *     thread the exporter keeps for its whole life, and the receiver checks
 *     once that it names a thread of the exporter's pid), read with one load on
 *     every hit; where the exporter could not set that up (set_robust_list
 *     refused), its own descriptor of the table still open instead
 *     (/proc/<pid>/fd/<n>; an exec or exit closes it; hidden from receivers
 *     without CAP_SYS_PTRACE where the exporter made itself non-dumpable, whose
 *     hits then ask it); and its pid's start time and state in /proc (a zombie
 *     has exited), read at most every 50 ms per exporter (within that time the
 *     word, or the descriptor, tells the same, but for an exporter killed so
 *     recently that its other threads are still ending). Before it returns, the
 *     hit writes a record of the use to its spend log (the grant's id and an
 *     HMAC that only the ticket's secret makes) and opens it to the exporter.
 *     The use is then spent by whichever comes first, each taking the record
 *     with an atomic compare-and-swap on it, so only one of them spends it: the
 *     exporter, which at its next grant (a sender registering again for each
 *     re-send of a buffer; at most
 *     one read a millisecond, on the granting thread, at most 126 records a
 *     read, starting where the last one stopped) reads the logs that opened
 *     records since it last looked, spends each open record with a valid HMAC
 *     and writes the outcome into it (spent, and whether the buffer lives on;
 *     or refused); or a library thread of this process, as with
 *     VMMIPC_IMPORT_CONFIRM_LATER, which answers the uses the exporter spent
 *     from their records and spends the rest (those it refused included, so
 *     that the refusal's reason is heard) on a session (vmmipc_cache_info
 *     counts table_hits, and confirms_pending and confirms_failed for these
 *     too). The record is cleared once answered. The exporter reads the logs of
 *     receivers that have exited (pid and start time, checked every 250 ms
 *     while it has logs) and spends each record with a valid HMAC, so a
 *     receiver killed right after a hit (SIGKILL included) leaves no grant
 *     pending. Bounds: 64 tables per receiver process (those of exporters gone
 *     are dropped for room), 63 uses in its log per exporter not yet answered
 *     (hits' and first imports'), 256 logs per exporter and 4 of one receiver
 *     process; beyond them hits ask the exporter, and first imports stream. Two
 *     processes that each map the buffer may both hit the last use of one
 *     ticket at the same instant (the later spend fails; neither gets memory it
 *     did not have).
 *   - Otherwise (a held registration, no table, another namespace, or
 *     anything the table cannot vouch for) the hit connects, proves the
 *     secret both ways, spends one use and has the exporter confirm that
 *     the registration lives (one round trip after connecting in the
 *     exporter's PID namespace: see vmmipc_confirm), and returns after that
 *     answer, an error included.
 * A stale hit cannot happen: a buffer id names one set of allocations (or
 * one memfd) that the exporter holds references to for as long as any
 * registration of it lives, ids are never reused within the exporter's
 * life, the exporter's identity includes its start time, the hit is vouched
 * for by the exporter's own table or an authenticated answer for this very
 * ticket, and the cached mapping holds its own references to that same
 * memory, so it is the memory the exporter would send again. The sender's
 * in-place writes are seen through it.
 * Mappings no longer referenced stay mapped, least recently used first out,
 * within a byte bound (VMMIPC_CACHE_BYTES, or vmmipc_cache_set_limit;
 * default 32 GiB; 0 turns the cache off) and are unmapped when the exporter
 * says the buffer ended (checked every 250 ms while any exist) or the
 * exporter exits. opts->import_flags VMMIPC_IMPORT_NO_CACHE bypasses it.
 *
 * opts->import_flags VMMIPC_IMPORT_CONFIRM_LATER takes the confirmation off
 * the caller's path: a hit returns at once (no connection, no handshake,
 * no driver call) and the use is spent by a library thread, in order per
 * exporter, each use proved with its own ticket's secret and answered on
 * its own; the uses queued together go on one session, as with
 * vmmipc_confirm_many, and hits that come as a stream (one within 20 ms of
 * the last session) wait up to 10 ms for others to join them, or until 31
 * wait, half a spend log (a table hit's use may meanwhile be spent by the
 * exporter from the spend log, above) (vmmipc_cache_info counts those
 * pending and failed). The reference is
 * valid whatever that answer is, since the mapping holds its own references
 * to the memory; but until it comes, the hit has trusted the ticket's
 * exporter and buffer fields without proof, so use the flag only for
 * tickets from the channel you trust for the data itself (a ticket whose
 * secret is wrong gets the mapping this process already has of that buffer,
 * and a failed confirmation). A miss streams as without the flag. Whoever
 * waits on the sender (vmmipc_wait) sees the registration end only once the
 * confirmation ran (a hit that came alone: within a few milliseconds; one
 * of a stream: within about 10 ms); confirmations still
 * queued when this process exits are lost (the sender's registration then
 * lives until its ttl or its process's end), so a program that may exit
 * soon after a hit waits first until vmmipc_cache_info reports
 * confirms_pending == 0 (the Python package does so at exit).
 *
 * opts->import_flags VMMIPC_IMPORT_HOLD holds the use (see "Holds") if the
 * registration was made with VMMIPC_REGISTER_HOLD: a miss streams as
 * without it, and a hit is one short session that proves the ticket with
 * the exporter; either names this process's lease at the exporter (or gets
 * one: one round trip more, once) and returns only once the exporter
 * answered, so the registration is held until vmmipc_release or this
 * process ends, and a hit on a registration that ended, or with a ticket
 * changed in any byte, is refused as a miss would be. Every wait on the
 * exporter is bounded by timeout_ms.
 *
 * *mapping_out belongs to the caller; drop the reference with vmmipc_unmap.
 * Returns:
 *   VMMIPC_OK      *mapping_out describes the mapping (a new one, or a
 *                  cached one)
 *   VMMIPC_EINVAL  NULL argument, malformed ticket, a device that does not
 *                  fit the ticket (VMMIPC_DEVICE_HOST for CUDA memory or
 *                  another for host memory, VMMIPC_DEVICE_SAME for a ticket
 *                  that names no GPU, a value below -2, an ordinal this
 *                  process does not see, or a device, also among
 *                  access_devices, without peer access to the exporter's
 *                  GPU), access_devices on a host ticket, unknown
 *                  import_flags bits (or HOLD with CONFIRM_LATER), an
 *                  option out of bounds, a host chunk the receiver refuses
 *                  to map (not a memfd sealed against shrinking, of huge
 *                  pages, not open O_RDWR, or sealed against writing: see
 *                  "Host memory"), or a protocol violation
 *   VMMIPC_EAUTH, VMMIPC_ENOENT, VMMIPC_EIO, VMMIPC_ENFILE  as vmmipc_open
 *   VMMIPC_ECONFIG as vmmipc_open, or a bad VMMIPC_CACHE_BYTES value
 *   VMMIPC_ENOMEM  the range cannot be reserved: RLIMIT_AS leaves too little
 *                  room (the message gives the figures), or the driver has
 *                  no virtual address space left
 *   VMMIPC_EEXPORT the sender failed to export chunk k (named)
 *   VMMIPC_ECUDA   a driver call failed for chunk k (named), no driver, or
 *                  (VMMIPC_DEVICE_SAME) the exporter's GPU is not among the
 *                  devices this process sees
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_import_stream(const vmmipc_ticket *ticket, int device,
                         const vmmipc_options *opts,
                         vmmipc_mapping *mapping_out);

/* vmmipc_confirm spends one use of the ticket and receives nothing: for a
 * receiver that has the memory mapped already, through another ticket of
 * the same buffer (as vmmipc_register_again makes them), and must still let
 * the sender know it has it, so that the registration ends (and its
 * release_fn runs). It connects, proves the secret both ways and has the
 * exporter spend the use, as a cache hit of vmmipc_import_stream does; with
 * VMMIPC_IMPORT_CONFIRM_LATER in opts->import_flags it returns at once and a
 * library thread does that (vmmipc_cache_info counts it; see
 * vmmipc_import_stream); with VMMIPC_IMPORT_HOLD it holds the use on this
 * process's lease at the exporter (see "Holds"), waiting for the answer as
 * without the flag. In the exporter's PID (and time) namespace it costs
 * one round trip after connecting: its proof goes with its hello, bound to
 * its own pid and start time, which the exporter reads from the kernel
 * (SO_PEERCRED, /proc, SO_PEERPIDFD: Linux 6.5+), and the exporter's proof,
 * the welcome and the answer come back in one write; elsewhere, or where
 * the exporter cannot check or predates this (it refuses the one-round
 * hello, and the call asks again at once), two, as vmmipc_open. Receives no chunk
 * descriptor and makes no driver call; holds one socket to the exporter
 * (and briefly, across namespaces, a netlink socket) while it runs.
 * Returns:
 *   VMMIPC_OK      the use is spent (or, with the flag, queued)
 *   VMMIPC_EINVAL  NULL ticket, malformed ticket, option out of bounds,
 *                  unknown import_flags bits (or HOLD with CONFIRM_LATER),
 *                  or the exporter broke the protocol (as vmmipc_open)
 *   VMMIPC_EAUTH, VMMIPC_ENOENT, VMMIPC_EIO, VMMIPC_ENFILE, VMMIPC_ECONFIG
 *                  as vmmipc_open
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_confirm(const vmmipc_ticket *ticket, const vmmipc_options *opts);

/* vmmipc_confirm_many spends one use of each of the `count` tickets at
 * `tickets`, as vmmipc_confirm does each, with one connection per exporter
 * (and one more for every 513 tickets of one exporter): the first ticket
 * of an exporter proves its secret both ways, the others follow as use
 * messages each proved with its own ticket's secret bound to that
 * handshake, sent together and answered together, so a receiver whose
 * memory is mapped already (a re-sent model: one ticket per run) pays one
 * round trip per exporter, not one per ticket. Exporters are confirmed
 * concurrently, each within timeout_ms. With VMMIPC_IMPORT_HOLD each use
 * is held (see "Holds"); VMMIPC_IMPORT_CONFIRM_LATER is refused. Each
 * ticket's outcome is its own: an ended registration (VMMIPC_ENOENT) or a
 * ticket changed in a byte (VMMIPC_EAUTH) takes nothing from the others.
 * status_out, if not NULL, has room for `count` ints and gets each
 * ticket's status (the statuses of vmmipc_confirm); it is written on every
 * return but VMMIPC_EFORK and the argument errors below. At most 1048576
 * tickets a call. The tickets and status_out stay the caller's.
 * Returns:
 *   VMMIPC_OK      every use is spent (and held, with VMMIPC_IMPORT_HOLD)
 *   VMMIPC_EINVAL  tickets NULL with count > 0, count above 1048576, an
 *                  option out of bounds, unknown import_flags bits or
 *                  CONFIRM_LATER (status_out untouched); or a malformed
 *                  ticket (its status says so, the others are confirmed)
 *   otherwise      the status of the first ticket that failed, as
 *                  vmmipc_confirm returns it; vmmipc_last_error names it
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_confirm_many(const vmmipc_ticket *tickets, size_t count,
                        const vmmipc_options *opts, int *status_out);

/* vmmipc_release lets go of one use of the ticket's registration that this
 * process holds (taken by vmmipc_import_stream or vmmipc_confirm with
 * VMMIPC_IMPORT_HOLD; see "Holds"). It returns at once: the registration id
 * is queued, and the next held use to that exporter carries it, or within
 * 2 ms a library thread sends it with others. Call
 * it once the memory is no longer read: a mapping of it may stay (unmap it
 * when you like), but the sender may write the memory from then on.
 * Returns:
 *   VMMIPC_OK      queued; the exporter lets go when it reads it (a
 *                  stopped exporter: when it runs again; a release is
 *                  tried again while it lives)
 *   VMMIPC_EINVAL  NULL or malformed ticket
 *   VMMIPC_ENOENT  this process holds no use of it: never held, let go of
 *                  already, or its exporter ended the lease (it exited,
 *                  or no longer knew it), which let go of everything held
 *                  on it
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_release(const vmmipc_ticket *ticket);

/* vmmipc_holds stores in *count_out how many uses of this process's
 * registrations receivers hold now (see "Holds"), without starting the
 * server.
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL), VMMIPC_EFORK */
int vmmipc_holds(uint64_t *count_out);

/* vmmipc_unmap drops the reference *mapping holds and zeroes *mapping. When
 * it was the last reference, the mapping is kept in the import cache (if
 * the cache has room and the exporter's buffer lives on) or undone
 * completely (unmap, release, free the address range).
 * Returns:
 *   VMMIPC_OK
 *   VMMIPC_EINVAL  NULL, or not a live reference of this process (already
 *                  unmapped, or never mapped); nothing is touched
 *   VMMIPC_ECUDA   a driver call failed while unmapping CUDA memory; the
 *                  mapping is forgotten all the same (a retry gives
 *                  VMMIPC_EINVAL)
 *   VMMIPC_EIO     munmap failed while unmapping host memory; forgotten all
 *                  the same
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_unmap(vmmipc_mapping *mapping);

typedef struct vmmipc_cache_info {
  uint64_t limit_bytes;        /* bound on unreferenced bytes; 0 = off */
  uint64_t entries;            /* mappings the cache knows, referenced or not */
  uint64_t referenced_bytes;   /* bytes of mappings with references */
  uint64_t unreferenced_bytes; /* bytes kept mapped with no reference */
  uint64_t hits;               /* imports answered from the cache */
  uint64_t misses;             /* imports that mapped anew */
  uint64_t evictions;          /* unreferenced mappings undone for room, or
                                  when the cache was turned off */
  uint64_t invalidations;      /* mappings undone because the buffer ended
                                  or the exporter exited */
  uint64_t confirms_pending;   /* uses of hits that are spent after the hit
                                  returned (VMMIPC_IMPORT_CONFIRM_LATER,
                                  and table hits) queued or in flight */
  uint64_t confirms_failed;    /* ...that failed (the exporter refused the
                                  ticket, or could not be reached) */
  uint64_t holds;              /* uses this process holds as a receiver
                                  (VMMIPC_IMPORT_HOLD, not yet released) */
  uint64_t holder_sessions;    /* live leases this process holds at
                                  exporters (one a page mapped, no
                                  descriptor; see "Holds"). The name is
                                  kept from when these were connections */
  uint64_t table_hits;         /* hits that the exporter's grant table
                                  vouched for, without a round trip (see
                                  vmmipc_import_stream) */
  uint64_t table_imports;      /* misses mapped from the file the grant
                                  table names, without a round trip (see
                                  vmmipc_import_stream); among misses */
} vmmipc_cache_info;

/* vmmipc_cache_set_limit sets this process's bound on the bytes of
 * unreferenced cached mappings (0 turns the cache off). Unreferenced
 * mappings beyond the new bound are undone before this returns.
 * Returns: VMMIPC_OK, VMMIPC_ECUDA or VMMIPC_EIO (undoing a mapping failed;
 * it is forgotten all the same), VMMIPC_EFORK */
int vmmipc_cache_set_limit(uint64_t max_unreferenced_bytes);

/* vmmipc_cache_get_info fills the first `size` bytes of *info_out (pass
 * sizeof *info_out; a later library never writes past it).
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL), VMMIPC_EFORK */
int vmmipc_cache_get_info(vmmipc_cache_info *info_out, size_t size);

/* ------------------------------------------------------------------ */
/* Pools: GPU memory made for sharing, in few large chunks            */
/* ------------------------------------------------------------------ */

/* A receiver's cost is per allocation handle, not per byte: each chunk of a
 * CUDA registration is one descriptor, one import, one map, and access is
 * set once over the range. 15 GiB to one receiver on an H200 (first
 * transfer / floor of import + map + set access): 766 chunks of 20 MiB
 * 81-98 / 54-64 ms; 240 of 64 MiB 28-41 / 25-27 ms; 15 of 1 GiB 4.0-4.8 /
 * 2.2 ms; 4 of 4 GiB 3.1-8.0 / 1.4-1.7 ms (issue 25's measurement, no log
 * here; a logged 8 GiB one, bench/results/2026-12-01-h200.md: 4096 chunks of 2 MiB
 * 537.8 / 408.3 ms, 410 of 20 MiB 53.9 / 41.8 ms). A pool allocates from large
 * physical chunks (1 GiB by default), so what is allocated in it spans few.
 *
 * How a pool works. It reserves one address range on its GPU, twice the
 * device's memory (address space only, no memory; it counts against
 * RLIMIT_AS, which must leave room for it). Chunks are cuMemCreate
 * allocations of chunk_size bytes on that GPU that allow
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, each mapped with its own
 * cuMemMap into the range and made readable and writable by that GPU (no
 * other device gets access). An allocation is rounded up to 512 bytes and
 * placed where it needs the fewest new chunks, at the lowest such address:
 * allocations pack into the chunks already mapped, and one that does not
 * fit (or is larger than a chunk) maps new chunks right after the free end
 * of what is there, so the range stays one contiguous run.
 *
 * Sharing it. Pool memory is ordinary CUDA VMM memory: register it with
 * vmmipc_register_cuda. A range must start and end on chunk boundaries:
 * vmmipc_cuda_query_range gives the chunks under a sub-range (one chunk for
 * a buffer inside one), to be registered whole while the receiver reads at
 * its offset. The library then holds its own reference to those chunks,
 * so receivers keep them however the pool's allocations change.
 *
 * Trade-offs. Rounding: to 512 bytes per allocation, and a receiver maps
 * whole chunks, so a small buffer shared alone costs a whole chunk of
 * mapping in the receiver (of memory that exists anyway). Fragmentation:
 * a chunk goes back only when no allocation touches it, so one small
 * allocation left in a chunk keeps the whole chunk; and when chunks given
 * back leave holes, a large allocation may find no run of free address
 * space (VMMIPC_ENOMEM) while memory is free. When memory goes back to the
 * driver: after each vmmipc_pool_free, wholly free chunks beyond keep_bytes
 * are unmapped and released, the highest addresses first (placement prefers
 * the low ones); vmmipc_pool_trim gives back down to any bound;
 * vmmipc_pool_destroy gives back everything. Giving a chunk back first
 * waits for the device (cuCtxSynchronize, as cudaFree does). Memory still
 * registered or imported elsewhere lives on until those let go.
 *
 * Threads: every function may be called from any thread; each pool has one
 * lock, held while a chunk is created and mapped (milliseconds). */

typedef struct vmmipc_pool vmmipc_pool; /* opaque */

/* vmmipc_pool_create makes a pool on CUDA device `device` (an ordinal of
 * this process) with chunks of chunk_size bytes (0: 1 GiB; otherwise a
 * multiple of the device's allocation granularity, 2 MiB on current GPUs)
 * that keeps up to keep_bytes of wholly free chunks mapped after a free (0:
 * gives every wholly free chunk back at once). It reserves the address
 * range and maps nothing yet. Needs no current context. *pool_out belongs to
 * the caller: destroy it with vmmipc_pool_destroy.
 * Returns:
 *   VMMIPC_OK      *pool_out is a new pool
 *   VMMIPC_EINVAL  NULL pool_out, a negative device or one this process
 *                  does not see, a chunk_size that is not a multiple of
 *                  the granularity (the message gives it), or one so large
 *                  that rounding the range up to it overflows
 *   VMMIPC_ENOMEM  RLIMIT_AS leaves no room for the range (the message
 *                  gives the figures), or the driver has no address space
 *   VMMIPC_ECUDA   libcuda.so.1 not found, or a driver call failed
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_pool_create(int device, uint64_t chunk_size, uint64_t keep_bytes,
                       vmmipc_pool **pool_out);

/* vmmipc_pool_alloc allocates size bytes (rounded up to 512) and stores
 * their device address (a CUdeviceptr, 512-byte aligned) in *dptr_out,
 * mapping new chunks when what is mapped has no room. The memory is not
 * cleared. On an error nothing new is left mapped.
 * Returns:
 *   VMMIPC_OK      *dptr_out is the allocation's address
 *   VMMIPC_EBADF   NULL, stale or destroyed pool
 *   VMMIPC_EINVAL  NULL dptr_out, size 0, or size larger than the range
 *   VMMIPC_ENOMEM  the GPU has no memory for the chunks it needs
 *                  (cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY), or no free run
 *                  of the range is large enough
 *   VMMIPC_ECUDA   another driver call failed (named)
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_pool_alloc(vmmipc_pool *pool, uint64_t size, uint64_t *dptr_out);

/* vmmipc_pool_free frees the allocation at dptr (an address
 * vmmipc_pool_alloc returned), then gives wholly free chunks beyond the
 * pool's keep_bytes back to the driver (after waiting for the device). The
 * caller makes sure the GPU no longer uses the allocation (as with any
 * free); memory registered with vmmipc_register_cuda stays valid for its
 * receivers.
 * Returns:
 *   VMMIPC_OK
 *   VMMIPC_EBADF   NULL, stale or destroyed pool
 *   VMMIPC_EINVAL  dptr is not a live allocation of this pool (never
 *                  allocated here, inside one, or freed already); nothing
 *                  is touched
 *   VMMIPC_ECUDA   giving a chunk back failed: the allocation is freed all
 *                  the same, the chunk stays mapped (a later
 *                  vmmipc_pool_trim tries again)
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_pool_free(vmmipc_pool *pool, uint64_t dptr);

/* vmmipc_pool_trim gives wholly free chunks back to the driver (after
 * waiting for the device) until at most keep_bytes of them stay mapped, the
 * lowest addresses kept, and stores the bytes given back in *released_out
 * (may be NULL; stored also on VMMIPC_ECUDA). It does not change the
 * pool's keep_bytes.
 * Returns: VMMIPC_OK, VMMIPC_EBADF (NULL, stale or destroyed pool),
 * VMMIPC_ECUDA (a driver call failed; chunks not given back stay mapped),
 * VMMIPC_EFORK */
int vmmipc_pool_trim(vmmipc_pool *pool, uint64_t keep_bytes, uint64_t *released_out);

typedef struct vmmipc_pool_info {
  uint64_t base;            /* start of the pool's address range */
  uint64_t reserved_bytes;  /* size of the range (address space only) */
  uint64_t chunk_size;
  uint64_t keep_bytes;      /* wholly free chunk bytes a free leaves mapped */
  uint64_t mapped_bytes;    /* chunks mapped now: the pool's GPU memory */
  uint64_t idle_bytes;      /* ...of which no allocation touches */
  uint64_t allocated_bytes; /* live allocations, rounded sizes */
  uint64_t allocations;     /* live allocations */
  uint64_t chunks_mapped;   /* chunks created and mapped since it began */
  uint64_t chunks_released; /* chunks given back since it began */
  int32_t device;           /* the pool's GPU */
  uint32_t torch;           /* 1 for a torch pool (vmmipc_torch_pool) */
} vmmipc_pool_info;

/* vmmipc_pool_get_info fills the first `size` bytes of *info_out (pass
 * sizeof *info_out; a later library never writes past it).
 * Returns: VMMIPC_OK, VMMIPC_EBADF (NULL, stale or destroyed pool),
 * VMMIPC_EINVAL (NULL info_out), VMMIPC_EFORK */
int vmmipc_pool_get_info(const vmmipc_pool *pool, vmmipc_pool_info *info_out, size_t size);

/* vmmipc_pool_destroy gives every chunk and the address range back and
 * makes the handle stale. It refuses while allocations live: free them
 * first. Memory registered or imported elsewhere lives on until those let
 * go.
 * Returns:
 *   VMMIPC_OK
 *   VMMIPC_EBADF   NULL, stale or destroyed pool
 *   VMMIPC_EINVAL  allocations still live (the message counts them;
 *                  nothing is touched), or a torch pool, which lives as
 *                  long as the process
 *   VMMIPC_ECUDA   a driver call failed while giving back; the pool is
 *                  destroyed all the same
 *   VMMIPC_EFORK   called after fork() */
int vmmipc_pool_destroy(vmmipc_pool *pool);

/* Torch's pluggable allocator. PyTorch's
 *   torch.cuda.memory.CUDAPluggableAllocator(path_to_libvmmipc,
 *       "vmmipc_torch_alloc", "vmmipc_torch_free")
 * with torch.cuda.MemPool and torch.cuda.use_mem_pool allocates tensors in
 * the torch pool of their device: one pool per device and process, made on
 * first use (by vmmipc_torch_pool, or the first vmmipc_torch_alloc with 1
 * GiB chunks), keep_bytes 0 (torch caches blocks itself and frees a segment
 * only to give it back), never destroyed. Python's
 * vmmipc.torch.sharing_pool() sets all this up. */

/* vmmipc_torch_pool gives device's torch pool, making it with chunk_size
 * (as vmmipc_pool_create; 0: 1 GiB) if it does not exist yet. chunk_size 0
 * takes an existing pool as it is. *pool_out is the same handle on every
 * call; it is not to be destroyed.
 * Returns: as vmmipc_pool_create, and VMMIPC_EINVAL when the device's pool
 * exists with another chunk_size (one per device and process). */
int vmmipc_torch_pool(int device, uint64_t chunk_size, vmmipc_pool **pool_out);

/* vmmipc_torch_alloc is torch's alloc_fn: size bytes from device's torch
 * pool (as vmmipc_pool_alloc). stream is unused (a cudaStream_t; torch
 * orders uses itself). Returns the device pointer, or NULL with
 * vmmipc_last_error() saying why (torch then raises its out-of-memory
 * error); NULL also after fork(). */
void *vmmipc_torch_alloc(size_t size, int device, void *stream);

/* vmmipc_torch_free is torch's free_fn: frees ptr in device's torch pool
 * (as vmmipc_pool_free, chunks going back to the driver at once). size and
 * stream are unused. A failure (ptr not from the pool, a driver call)
 * leaves vmmipc_last_error() saying why; there is nothing to return. */
void vmmipc_torch_free(void *ptr, size_t size, int device, void *stream);

/* ------------------------------------------------------------------ */
/* Arenas: host memory made for sharing with processes one forks      */
/* ------------------------------------------------------------------ */

/* An arena is host memory that one process (the owner: a DataLoader's main
 * process) maps MAP_SHARED before it starts its workers, formatted with
 * vmmipc_arena_format: a header, then `regions` regions, each with a table
 * of `slots` block slots and region_bytes of data. A worker claims one
 * region and is its only writer: it allocates blocks there, fills them and
 * marks them sent; the owner receives a block (it is then held), reads or
 * writes it in place through its own mapping, and frees it when done; the
 * worker allocates the freed block again, its pages already in memory. What
 * crosses between the processes per block is plain data (a
 * vmmipc_arena_block): no descriptor, no socket.
 *
 * Why these calls are not Go: a child made by fork() has no Go runtime.
 * Every vmmipc_arena_* function is plain C over the memory it is given (C11
 * atomics on the block states: a release store publishes what was written
 * before it, an acquire load or compare-and-swap sees it), makes no
 * allocation, opens nothing, takes no lock, and is callable in a forked
 * child, unlike every other function of this header (no VMMIPC_EFORK here).
 * They never call into the Go runtime, so they also work before or without
 * any other vmmipc call.
 *
 * The memory: any mapping of `size` bytes, page-aligned, shared by the
 * processes (a memfd, MAP_SHARED, the owner creating it before fork() or
 * handing its descriptor to a spawned child once). A fresh memfd reads as
 * zeros; untouched pages cost nothing, so size it for the largest use and
 * let it stay sparse. The caller owns the memory and its descriptor: these
 * functions keep no pointer to it between calls. Every call checks the
 * header (the magic, the layout against `size`) and every index and
 * generation it is given against the table: a damaged or stale block is
 * VMMIPC_EINVAL or VMMIPC_ENOENT, never a write out of bounds.
 *
 * A block's life: FREE -> (alloc, by the region's owner) WRITING -> (send,
 * the owner) SENT -> (receive, the arena's owner) HELD -> (free) FREE. A
 * block never sent is dropped by its writer (WRITING -> FREE). Each alloc
 * gives the slot a new generation, which every later call must name: a
 * block freed and allocated again is a new block. A region whose owner has
 * died (its pid gone, or a zombie) or left is taken over by the next claim
 * or vmmipc_arena_reap: its WRITING and SENT blocks become FREE (nobody will
 * receive them), its HELD blocks stay until the arena's owner frees them.
 * Pids are those of the caller's PID namespace.
 *
 * Threads: any number of processes and threads may call at once, with one
 * rule: vmmipc_arena_alloc, vmmipc_arena_send and vmmipc_arena_drop are
 * called by one thread at a time per region (the region's single writer; a
 * process serializes its own threads). */

#define VMMIPC_ARENA_ALIGN 64 /* every block's offset is a multiple of this;
                                 blocks of 64 KiB and more start on a page */

typedef struct vmmipc_arena_block {
  uint32_t region;     /* the region the block is in */
  uint32_t slot;       /* its slot in that region's table */
  uint64_t generation; /* which allocation of that slot this block is */
  uint64_t offset;     /* from the start of the arena's memory */
  uint64_t nbytes;     /* as asked of vmmipc_arena_alloc */
} vmmipc_arena_block;

typedef struct vmmipc_arena_info {
  uint32_t regions;        /* as formatted */
  uint32_t regions_owned;  /* claimed by a process now */
  uint64_t slots;          /* per region, as formatted */
  uint64_t region_bytes;   /* data bytes per region, as formatted */
  uint64_t blocks_writing; /* allocated, not sent yet */
  uint64_t blocks_sent;    /* sent, not received yet */
  uint64_t blocks_held;    /* received, not freed yet */
  uint64_t blocks_free;    /* carved out and free: allocated again first */
  uint64_t live_bytes;     /* nbytes of the blocks not free */
  uint64_t carved_bytes;   /* data bytes ever carved into blocks and not
                              given back: the memory the arena has touched */
  uint64_t takeovers;      /* regions taken over from a dead or gone owner */
} vmmipc_arena_info;

/* vmmipc_arena_size gives the bytes an arena of this shape needs
 * (page-aligned: header, region tables, data). regions 1..4096, slots
 * 1..1<<20, region_bytes a multiple of 4096, at least 4096, the total at
 * most 1<<46.
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL size_out, a bound broken) */
int vmmipc_arena_size(uint32_t regions, uint32_t slots, uint64_t region_bytes,
                      uint64_t *size_out);

/* vmmipc_arena_format writes the header of an arena of this shape at base,
 * which must be `size` bytes (vmmipc_arena_size's), zero-filled (a fresh
 * memfd), page-aligned and not in use by anyone yet.
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL or unaligned base, size not the
 * shape's, a bound broken, memory not zero-filled: formatted already) */
int vmmipc_arena_format(void *base, uint64_t size, uint32_t regions, uint32_t slots,
                        uint64_t region_bytes);

/* vmmipc_arena_claim makes process `pid` (the caller) the owner of a
 * region: one nobody owns, else one whose owner has died (taken over: its
 * unreceived blocks freed). *region_out is its index.
 * Returns:
 *   VMMIPC_OK
 *   VMMIPC_EINVAL  NULL, not an arena of this size, pid 0
 *   VMMIPC_ENOMEM  every region has a live owner (more workers than
 *                  regions: format with more) */
int vmmipc_arena_claim(void *base, uint64_t size, uint32_t pid, uint32_t *region_out);

/* vmmipc_arena_leave gives region back (pid its owner, leaving: at exit):
 * its WRITING and SENT blocks become FREE, its HELD ones stay.
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL, not an arena, region out of
 * range), VMMIPC_ENOENT (pid does not own the region) */
int vmmipc_arena_leave(void *base, uint64_t size, uint32_t region, uint32_t pid);

/* vmmipc_arena_reap takes over every region whose owner has died, and
 * every region nobody owns, as pid (the caller; the arena's owner), and
 * gives it back: their WRITING and SENT blocks become FREE (a writer that
 * left may have sent blocks after it left, while it exited: nobody
 * receives those). *reaped_out (may be NULL) counts the regions of dead
 * owners.
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL base, not an arena, pid 0) */
int vmmipc_arena_reap(void *base, uint64_t size, uint32_t pid, uint32_t *reaped_out);

/* vmmipc_arena_alloc allocates nbytes (>= 1) in region (the calling
 * process owns it): a free block of the region, the smallest that fits unless it is
 * more than twice nbytes and fresh room is left, else fresh room after the
 * last block. The block is WRITING; *block_out says where. Its memory
 * holds what was there before (not zeroed).
 * Returns:
 *   VMMIPC_OK
 *   VMMIPC_EINVAL  NULL, not an arena, region out of range, nbytes 0
 *   VMMIPC_ENOENT  the calling process does not own the region
 *   VMMIPC_ENOMEM  nbytes more than a region holds, or no free block fits
 *                  and no room or slot is left (the message says how much
 *                  is live): the caller falls back to other memory, or
 *                  frees blocks first */
int vmmipc_arena_alloc(void *base, uint64_t size, uint32_t region, uint64_t nbytes,
                       vmmipc_arena_block *block_out);

/* vmmipc_arena_send marks a WRITING block SENT (a release store: what was
 * written to it before is seen by whoever receives it). Hand the block to
 * the receiver after this call.
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL, not an arena, out of range),
 * VMMIPC_ENOENT (not that block, or not WRITING: sent already or freed; or
 * the calling process no longer owns the region) */
int vmmipc_arena_send(void *base, uint64_t size, const vmmipc_arena_block *block);

/* vmmipc_arena_receive marks a SENT block HELD (acquire: its writer's data
 * is seen) and fills block->offset and block->nbytes from the table (the
 * receiver names region, slot and generation; a damaged offset cannot
 * mislead it).
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL, not an arena, out of range),
 * VMMIPC_ENOENT (not SENT in that generation: received already, or its
 * region was taken over after its writer died or left) */
int vmmipc_arena_receive(void *base, uint64_t size, vmmipc_arena_block *block);

/* vmmipc_arena_free frees a HELD block (its receiver, done with it) with a
 * release store: the next writer of the block sees every access before.
 * Free a block once.
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL, not an arena, out of range),
 * VMMIPC_ENOENT (not that block, or not HELD) */
int vmmipc_arena_free(void *base, uint64_t size, const vmmipc_arena_block *block);

/* vmmipc_arena_drop frees a WRITING block: its writer's, never sent.
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL, not an arena, out of range),
 * VMMIPC_ENOENT (not that block, or not WRITING: sent, or dropped already) */
int vmmipc_arena_drop(void *base, uint64_t size, const vmmipc_arena_block *block);

/* vmmipc_arena_get_info fills the first info_size bytes of *info_out (pass
 * sizeof *info_out) with the arena's counters, read without stopping
 * anyone (each count is exact when nobody allocates or frees meanwhile).
 * Returns: VMMIPC_OK, VMMIPC_EINVAL (NULL, not an arena) */
int vmmipc_arena_get_info(const void *base, uint64_t size, vmmipc_arena_info *info_out,
                          size_t info_size);

/* ------------------------------------------------------------------ */
/* Errors and version                                                 */
/* ------------------------------------------------------------------ */

/* vmmipc_strerror names a status ("VMMIPC_EAUTH: authentication failed").
 * Returns: a static string, never NULL; never free it. */
const char *vmmipc_strerror(int status);

/* vmmipc_last_error gives this thread's detail of its last failed call,
 * e.g. "chunk 17 of 4096: cuMemImportFromShareableHandle:
 * CUDA_ERROR_OUT_OF_MEMORY". When the text changes is said once, under
 * Conventions: only this thread's next failed call replaces it. The pointer
 * is the same for every call on a thread and stays valid until the thread
 * exits.
 * Returns: a thread-local string, "" if nothing failed yet on this thread;
 * never free it. */
const char *vmmipc_last_error(void);

/* vmmipc_version returns the library version, e.g. "0.2.0".
 * Returns: a static string; never free it. */
const char *vmmipc_version(void);

#ifdef __cplusplus
}
#endif

#endif /* VMMIPC_H */
