/* The public vmmipc_* symbols. Each one refuses to run in a child after
 * fork() (the Go runtime does not survive fork) before entering Go, then
 * calls the hidden Go export vmmipcgo_*. Including vmmipc.h here makes the
 * compiler check every definition against the contract. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "abi.h"
#include "_cgo_export.h"

/* ---- host state: saved before the Go runtime starts, restored after ----
 *
 * Loading a Go c-shared library changes its host: the runtime's constructor
 * installs signal handlers (SIGSEGV, SIGBUS, SIGFPE, SIGPIPE, SIGURG, and
 * SA_ONSTACK on others), and the syscall package's init, on a thread of its
 * own, raises the soft RLIMIT_NOFILE. We snapshot the host before the Go
 * constructor (a prioritized constructor runs before plain ones), put the
 * signals back right after it (our plain constructor follows go.o's in
 * .init_array: check with `objdump -s -j .init_array` after a Go upgrade),
 * and wait, bounded, for Go's package init to finish so that the limit is
 * back before dlopen() returns. Handlers the host had keep SA_ONSTACK, the
 * one flag Go adds and must (see restore_signals). The cost: a fault inside Go code is no
 * longer a recoverable panic, and Go cannot preempt a goroutine that loops
 * without calls (we have none). Rule: no Go init may use the dynamic loader
 * (dlopen, dlsym, NSS): dlopen holds its lock while we wait. */

static pthread_key_t last_error_key;
static int last_error_key_ok;

struct kernel_sigaction { /* the kernel's layout on x86-64 */
  void *handler;
  unsigned long flags;
  void *restorer;
  unsigned long mask;
};

#define VMMIPC_NSIG 65
static struct kernel_sigaction saved_actions[VMMIPC_NSIG];
static unsigned char saved_action_ok[VMMIPC_NSIG];
static struct rlimit saved_nofile;
static int saved_nofile_ok;
static pid_t load_pid;
static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t init_cv;
static int go_init_done;

static int raw_sigaction(int sig, const struct kernel_sigaction *act, struct kernel_sigaction *old) {
  return (int)syscall(SYS_rt_sigaction, sig, act, old, 8);
}

__attribute__((constructor(101))) static void vmmipc_abi_save_host(void) {
  load_pid = getpid();
  last_error_key_ok = pthread_key_create(&last_error_key, free) == 0;
  saved_nofile_ok = getrlimit(RLIMIT_NOFILE, &saved_nofile) == 0;
  for (int sig = 1; sig < VMMIPC_NSIG; sig++)
    saved_action_ok[sig] = raw_sigaction(sig, NULL, &saved_actions[sig]) == 0;
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(&init_cv, &a);
  pthread_condattr_destroy(&a);
}

static void restore_signals(void) {
  for (int sig = 1; sig < VMMIPC_NSIG; sig++) {
    if (!saved_action_ok[sig] || sig == SIGKILL || sig == SIGSTOP) continue;
    if (sig >= 32 && sig < SIGRTMIN) {
      /* glibc's own signals (SIGCANCEL, SIGSETXID): glibc installs its
       * handler lazily when the first thread starts; resetting it would
       * make the next setuid() kill the host. Only undo Go's flag changes. */
      struct kernel_sigaction now;
      if (raw_sigaction(sig, NULL, &now) || now.handler != saved_actions[sig].handler) continue;
    }
    struct kernel_sigaction act = saved_actions[sig];
    /* Keep the one change Go must make: SA_ONSTACK on the host's own
     * handlers. A process-wide signal (SIGPROF, SIGINT, ...) may be
     * delivered to a thread that Go created, whose goroutine stack is far
     * too small for a C handler's frame; SA_ONSTACK runs it on the thread's
     * signal stack instead. SIG_DFL and SIG_IGN stay exactly as they were. */
    if (act.handler != (void *)SIG_DFL && act.handler != (void *)SIG_IGN) act.flags |= SA_ONSTACK;
    raw_sigaction(sig, &act, NULL);
  }
}

void vmmipc_abi_saved_nofile(unsigned long long *cur, unsigned long long *max, int *ok) {
  *cur = saved_nofile.rlim_cur;
  *max = saved_nofile.rlim_max;
  *ok = saved_nofile_ok;
}

void vmmipc_abi_go_init_done(void) {
  restore_signals();
  pthread_mutex_lock(&init_mu);
  go_init_done = 1;
  pthread_cond_broadcast(&init_cv);
  pthread_mutex_unlock(&init_mu);
}

__attribute__((constructor)) static void vmmipc_abi_after_go(void) {
  restore_signals();
  struct timespec deadline;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  deadline.tv_sec += 5; /* never hang the host's dlopen, whatever happens */
  pthread_mutex_lock(&init_mu);
  while (!go_init_done && pthread_cond_timedwait(&init_cv, &init_mu, &deadline) != ETIMEDOUT) {
  }
  pthread_mutex_unlock(&init_mu);
  if (saved_nofile_ok) setrlimit(RLIMIT_NOFILE, &saved_nofile);
  restore_signals();
}

/* ---- files removed at exit ----
 * A server in VMMIPC_SOCKET_DIR leaves a socket and a lock file there. At
 * exit() they are removed here, in C: no Go code runs while the process
 * exits. They are removed by name through a duplicate of the server's
 * descriptor of the directory it checked when it started, never through
 * the path: whatever the path leads to by then (a symlink re-pointed, a
 * directory renamed), nothing in another directory is touched. _exit, a
 * fatal signal or a crash leave them; the next exporter in the directory
 * removes those (core/socketdir.go). A forked child's exit removes
 * nothing: the files are its parent's. */

static int exit_dirfd = -1;
static char *exit_names[2];
static pthread_mutex_t exit_mu = PTHREAD_MUTEX_INITIALIZER;

static void remove_files_at_exit(void) {
  if (getpid() != load_pid) return;
  for (int i = 0; i < 2; i++)
    if (exit_names[i]) unlinkat(exit_dirfd, exit_names[i], 0);
}

void vmmipc_abi_remove_at_exit(int dirfd, const char *socket_name, const char *lock_name) {
  pthread_mutex_lock(&exit_mu);
  if (exit_dirfd < 0) {
    /* Ours for the process's life (the server may close its own). Without
     * a descriptor free the files stay, as after a crash. */
    int fd = fcntl(dirfd, F_DUPFD_CLOEXEC, 3);
    char *sock = strdup(socket_name), *lock = strdup(lock_name);
    if (fd >= 0 && sock && lock) {
      exit_dirfd = fd;
      exit_names[0] = sock;
      exit_names[1] = lock;
      atexit(remove_files_at_exit);
    } else {
      if (fd >= 0) close(fd);
      free(sock);
      free(lock);
    }
  }
  pthread_mutex_unlock(&exit_mu);
}

/* ---- errors ----
 * The last-error detail is per thread. It lives in a heap buffer found
 * through a pthread key, not in a __thread array: Go marks this library
 * STATIC_TLS, so all of its thread-locals come out of glibc's small static
 * TLS reserve, and a large one makes dlopen() fail ("cannot allocate memory
 * in static TLS block"). */


#define LAST_ERROR_SIZE 2048

static char *last_error_buf(int create) {
  if (!last_error_key_ok) return NULL;
  char *b = pthread_getspecific(last_error_key);
  if (!b && create) {
    b = calloc(1, LAST_ERROR_SIZE);
    if (b && pthread_setspecific(last_error_key, b)) {
      free(b);
      b = NULL;
    }
  }
  return b;
}

void vmmipc_abi_set_error(const char *msg, size_t len) {
  char *b = last_error_buf(1);
  if (!b) return;
  if (len >= LAST_ERROR_SIZE) len = LAST_ERROR_SIZE - 1;
  memcpy(b, msg, len);
  b[len] = '\0';
}

static int set_error_str(int status, const char *msg) {
  vmmipc_abi_set_error(msg, strlen(msg));
  return status;
}

#define FORK_GUARD(name)                                                      \
  do {                                                                        \
    if (getpid() != load_pid)                                                 \
      return set_error_str(VMMIPC_EFORK,                                      \
                           name ": called in a child after fork(); libvmmipc " \
                                "cannot run there: exec a new program, or "    \
                                "use the spawn/forkserver start methods");    \
  } while (0)

/* ---- trampolines ---- */

int vmmipc_abi_call_export(vmmipc_export_fn fn, uintptr_t user, uint64_t index, int *fd_out) {
  return fn((void *)user, index, fd_out);
}

void vmmipc_abi_call_release(vmmipc_release_fn fn, uintptr_t user) { fn((void *)user); }

/* ---- public API ---- */

int vmmipc_options_init(vmmipc_options *opts, size_t size) {
  FORK_GUARD("vmmipc_options_init");
  return vmmipcgo_options_init(opts, size);
}

int vmmipc_register(const uint64_t *sizes, uint64_t count, vmmipc_export_fn export_fn,
                    vmmipc_release_fn release_fn, void *user, const vmmipc_options *opts,
                    vmmipc_ticket *ticket_out) {
  FORK_GUARD("vmmipc_register");
  return vmmipcgo_register((uint64_t *)sizes, count, export_fn, release_fn, (uintptr_t)user,
                           (vmmipc_options *)opts, ticket_out);
}

int vmmipc_register_host_file(int fd, uint64_t size, uint64_t chunk_size,
                              vmmipc_release_fn release_fn, void *user,
                              const vmmipc_options *opts, vmmipc_ticket *ticket_out) {
  FORK_GUARD("vmmipc_register_host_file");
  return vmmipcgo_register_host_file(fd, size, chunk_size, release_fn, (uintptr_t)user,
                                     (vmmipc_options *)opts, ticket_out);
}

int vmmipc_register_cuda(uint64_t dptr, uint64_t size, const vmmipc_options *opts,
                         vmmipc_ticket *ticket_out) {
  FORK_GUARD("vmmipc_register_cuda");
  return vmmipcgo_register_cuda(dptr, size, (vmmipc_options *)opts, ticket_out);
}

int vmmipc_register_cuda_handles(const uint64_t *handles, const uint64_t *sizes,
                                 uint64_t count, vmmipc_release_fn release_fn, void *user,
                                 const vmmipc_options *opts, vmmipc_ticket *ticket_out) {
  FORK_GUARD("vmmipc_register_cuda_handles");
  return vmmipcgo_register_cuda_handles((uint64_t *)handles, (uint64_t *)sizes, count,
                                        release_fn, (uintptr_t)user, (vmmipc_options *)opts,
                                        ticket_out);
}

int vmmipc_register_again(const vmmipc_ticket *ticket, vmmipc_release_fn release_fn, void *user,
                          const vmmipc_options *opts, vmmipc_ticket *ticket_out) {
  FORK_GUARD("vmmipc_register_again");
  return vmmipcgo_register_again((vmmipc_ticket *)ticket, release_fn, (uintptr_t)user,
                                 (vmmipc_options *)opts, ticket_out);
}

int vmmipc_wait(const vmmipc_ticket *ticket, uint32_t timeout_ms) {
  FORK_GUARD("vmmipc_wait");
  return vmmipcgo_wait((vmmipc_ticket *)ticket, timeout_ms);
}

int vmmipc_cuda_query_range(uint64_t dptr, uint64_t size, vmmipc_cuda_range_info *info_out) {
  FORK_GUARD("vmmipc_cuda_query_range");
  return vmmipcgo_cuda_query_range(dptr, size, info_out);
}

int vmmipc_cache_set_limit(uint64_t max_unreferenced_bytes) {
  FORK_GUARD("vmmipc_cache_set_limit");
  return vmmipcgo_cache_set_limit(max_unreferenced_bytes);
}

int vmmipc_cache_get_info(vmmipc_cache_info *info_out, size_t size) {
  FORK_GUARD("vmmipc_cache_get_info");
  return vmmipcgo_cache_get_info(info_out, size);
}

int vmmipc_unregister(const vmmipc_ticket *ticket) {
  FORK_GUARD("vmmipc_unregister");
  return vmmipcgo_unregister((vmmipc_ticket *)ticket);
}

int vmmipc_exiting(void) {
  FORK_GUARD("vmmipc_exiting");
  return vmmipcgo_exiting();
}

int vmmipc_live_registrations(uint64_t *count_out) {
  FORK_GUARD("vmmipc_live_registrations");
  return vmmipcgo_live_registrations(count_out);
}

int vmmipc_live_many(const vmmipc_ticket *tickets, size_t count, uint8_t *live_out) {
  FORK_GUARD("vmmipc_live_many");
  return vmmipcgo_live_many((vmmipc_ticket *)tickets, count, live_out);
}

int vmmipc_ticket_decode(const vmmipc_ticket *ticket, vmmipc_ticket_info *info_out) {
  FORK_GUARD("vmmipc_ticket_decode");
  return vmmipcgo_ticket_decode((vmmipc_ticket *)ticket, info_out);
}

int vmmipc_confirm(const vmmipc_ticket *ticket, const vmmipc_options *opts) {
  FORK_GUARD("vmmipc_confirm");
  return vmmipcgo_confirm((vmmipc_ticket *)ticket, (vmmipc_options *)opts);
}

int vmmipc_confirm_many(const vmmipc_ticket *tickets, size_t count,
                        const vmmipc_options *opts, int *status_out) {
  FORK_GUARD("vmmipc_confirm_many");
  return vmmipcgo_confirm_many((vmmipc_ticket *)tickets, count, (vmmipc_options *)opts,
                               status_out);
}

int vmmipc_release(const vmmipc_ticket *ticket) {
  FORK_GUARD("vmmipc_release");
  return vmmipcgo_release((vmmipc_ticket *)ticket);
}

int vmmipc_holds(uint64_t *count_out) {
  FORK_GUARD("vmmipc_holds");
  return vmmipcgo_holds(count_out);
}

int vmmipc_open(const vmmipc_ticket *ticket, const vmmipc_options *opts,
                vmmipc_stream **stream_out) {
  FORK_GUARD("vmmipc_open");
  return vmmipcgo_open((vmmipc_ticket *)ticket, (vmmipc_options *)opts, stream_out);
}

int vmmipc_stream_info(const vmmipc_stream *stream, uint64_t *count_out,
                       uint64_t *total_size_out) {
  FORK_GUARD("vmmipc_stream_info");
  return vmmipcgo_stream_info((uintptr_t)stream, count_out, total_size_out);
}

int vmmipc_pull_next(vmmipc_stream *stream, vmmipc_chunk *chunk_out) {
  FORK_GUARD("vmmipc_pull_next");
  return vmmipcgo_pull_next((uintptr_t)stream, chunk_out);
}

int vmmipc_close(vmmipc_stream *stream) {
  FORK_GUARD("vmmipc_close");
  return vmmipcgo_close((uintptr_t)stream);
}

/* ---- pools (vmmipc.h, "Pools"; Go: export/pool.go) ----
 * Handles cross into Go as integers, as streams do. The torch hooks have
 * torch's signatures and no status: a failure is NULL (alloc) or nothing
 * (free), with this thread's last error set. */

int vmmipc_pool_create(int device, uint64_t chunk_size, uint64_t keep_bytes,
                       vmmipc_pool **pool_out) {
  FORK_GUARD("vmmipc_pool_create");
  return vmmipcgo_pool_create(device, chunk_size, keep_bytes, pool_out);
}

int vmmipc_pool_alloc(vmmipc_pool *pool, uint64_t size, uint64_t *dptr_out) {
  FORK_GUARD("vmmipc_pool_alloc");
  return vmmipcgo_pool_alloc((uintptr_t)pool, size, dptr_out);
}

int vmmipc_pool_free(vmmipc_pool *pool, uint64_t dptr) {
  FORK_GUARD("vmmipc_pool_free");
  return vmmipcgo_pool_free((uintptr_t)pool, dptr);
}

int vmmipc_pool_trim(vmmipc_pool *pool, uint64_t keep_bytes, uint64_t *released_out) {
  FORK_GUARD("vmmipc_pool_trim");
  if (released_out) *released_out = 0;
  return vmmipcgo_pool_trim((uintptr_t)pool, keep_bytes, released_out);
}

int vmmipc_pool_get_info(const vmmipc_pool *pool, vmmipc_pool_info *info_out, size_t size) {
  FORK_GUARD("vmmipc_pool_get_info");
  return vmmipcgo_pool_get_info((uintptr_t)pool, info_out, size);
}

int vmmipc_pool_destroy(vmmipc_pool *pool) {
  FORK_GUARD("vmmipc_pool_destroy");
  return vmmipcgo_pool_destroy((uintptr_t)pool);
}

int vmmipc_torch_pool(int device, uint64_t chunk_size, vmmipc_pool **pool_out) {
  FORK_GUARD("vmmipc_torch_pool");
  return vmmipcgo_torch_pool(device, chunk_size, pool_out);
}

void *vmmipc_torch_alloc(size_t size, int device, void *stream) {
  (void)stream;
  if (getpid() != load_pid) {
    set_error_str(VMMIPC_EFORK, "vmmipc_torch_alloc: called in a child after fork(); libvmmipc cannot "
                                "run there");
    return NULL;
  }
  uint64_t p = 0;
  if (vmmipcgo_torch_alloc(size, device, &p) != VMMIPC_OK) return NULL;
  return (void *)(uintptr_t)p;
}

void vmmipc_torch_free(void *ptr, size_t size, int device, void *stream) {
  (void)size;
  (void)stream;
  if (getpid() != load_pid) {
    set_error_str(VMMIPC_EFORK, "vmmipc_torch_free: called in a child after fork(); libvmmipc cannot "
                                "run there");
    return;
  }
  vmmipcgo_torch_free((uint64_t)(uintptr_t)ptr, device);
}

/* The Go runtime aborts the process when it cannot get address space for
 * itself, and merely entering Go from C can need some (a cgo callback on a
 * new thread allocates). So an import is refused here, before entering Go,
 * when RLIMIT_AS leaves less than the headroom the runtime is kept
 * (core.RuntimeHeadroom in core/addrspace.go, its one home, which then
 * checks the import's own size; Go's init hands it over through
 * vmmipc_abi_set_runtime_headroom before the loading constructor returns,
 * so before any call). Reads /proc/self/statm into a stack buffer: no
 * allocation. */
static unsigned long long runtime_headroom;

void vmmipc_abi_set_runtime_headroom(unsigned long long bytes) { runtime_headroom = bytes; }

static int address_space_short(unsigned long long *limit, unsigned long long *used) {
  struct rlimit r;
  if (getrlimit(RLIMIT_AS, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return 0;
  int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[64];
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  *used = strtoull(buf, NULL, 10) * (unsigned long long)sysconf(_SC_PAGESIZE);
  *limit = r.rlim_cur;
  return *limit < *used || *limit - *used < runtime_headroom;
}

int vmmipc_import_stream(const vmmipc_ticket *ticket, int device, const vmmipc_options *opts,
                         vmmipc_mapping *mapping_out) {
  FORK_GUARD("vmmipc_import_stream");
  unsigned long long limit = 0, used = 0;
  if (address_space_short(&limit, &used)) {
    char msg[512];
    snprintf(msg, sizeof msg,
             "import: RLIMIT_AS (%llu MiB) leaves %llu MiB free (%llu MiB in use), less than the %llu MiB "
             "the Go runtime inside libvmmipc is kept: raise RLIMIT_AS (ulimit -v) or import less at a time",
             limit >> 20, limit > used ? (limit - used) >> 20 : 0, used >> 20, runtime_headroom >> 20);
    return set_error_str(VMMIPC_ENOMEM, msg);
  }
  return vmmipcgo_import_stream((vmmipc_ticket *)ticket, device, (vmmipc_options *)opts,
                                mapping_out);
}

int vmmipc_unmap(vmmipc_mapping *mapping) {
  FORK_GUARD("vmmipc_unmap");
  return vmmipcgo_unmap(mapping);
}

const char *vmmipc_strerror(int status) {
  /* Also after fork: it touches no runtime state beyond a read. */
  if (getpid() == load_pid) {
    const char *s = vmmipcgo_strerror(status);
    if (s) return s;
  }
  switch (status) {
  case VMMIPC_EFORK: return "VMMIPC_EFORK: called in a child after fork()";
  default: return "VMMIPC_UNKNOWN: unknown status";
  }
}

const char *vmmipc_last_error(void) {
  const char *b = last_error_buf(0);
  return b ? b : "";
}

#define STR_(x) #x
#define STR(x) STR_(x)
const char *vmmipc_version(void) {
  return STR(VMMIPC_VERSION_MAJOR) "." STR(VMMIPC_VERSION_MINOR) "." STR(VMMIPC_VERSION_PATCH);
}
