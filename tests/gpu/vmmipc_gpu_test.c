/* GPU test of libvmmipc's CUDA backend: real allocations, separate
 * processes, data compared byte for byte, descriptors counted in
 * /proc/self/fd. Needs a CUDA GPU and driver; build and run it with
 * tests/gpu/run.sh after `make lib`.
 *
 * Processes. With no arguments this program is the runner: it starts itself
 * once per scenario ("scenario NAME", always posix_spawn: the Go runtime in
 * libvmmipc does not survive fork), echoes every line they print and counts
 * the PASS and FAIL lines. A scenario process is the sender: it allocates
 * with the driver API (cuMemCreate with the POSIX-fd handle type,
 * cuMemAddressReserve, cuMemMap, cuMemSetAccess), registers, and spawns
 * receivers ("recv MODE key=value..."), talking to them over two pipes that
 * the receiver sees as fds 3 (to the sender) and 4 (from the sender).
 *
 * Data. Every byte of a buffer is a function of its offset and a seed, so a
 * receiver can recompute what it must see; it copies the mapping back to the
 * host and compares everything with memcmp.
 *
 * Failure injection needs no hook in the library: the sender registers with
 * vmmipc_register and an export_fn that (a) fails at chunk k, (b) hands out
 * a memfd instead of a CUDA handle at chunk k (the receiver's import fails),
 * or (c) hands out a smaller allocation at chunk k (the receiver's cuMemMap
 * fails).
 *
 * The import cache ("cache") and vmmipc_cuda_query_range ("query-range")
 * have scenarios of their own; elsewhere a receiver that must make two
 * distinct mappings of one registration passes VMMIPC_IMPORT_NO_CACHE (a
 * second import of the same registration in one process is a cache hit). */
#define _GNU_SOURCE
#include <cuda.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "vmmipc.h"

extern char **environ;

#define MIB (1ull << 20)
#define FD_BUDGET 8      /* extra descriptors either side may hold */
#define TIME_LIMIT_S 300 /* any process of this test dies after this */

static char self_path[4096];
static char label[160]; /* the check being run, for PASS/FAIL lines */
static int failed;      /* FAIL lines printed by this process */
static CUdevice dev;
static CUcontext primary;
static size_t gran; /* allocation granularity: the chunk unit */

/* ---- output: one write() per line, so processes never interleave ---- */

static void line(const char *tag, const char *fmt, va_list ap) {
  char buf[2048];
  int n = snprintf(buf, sizeof buf, "%s %s: ", tag, label);
  n += vsnprintf(buf + n, sizeof buf - n - 1, fmt, ap);
  if (n > (int)sizeof buf - 2) n = sizeof buf - 2;
  buf[n++] = '\n';
  if (write(1, buf, n) < 0) _exit(3);
}

static void check(int ok, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  line(ok ? "PASS" : "FAIL", fmt, ap);
  va_end(ap);
  if (!ok) failed++;
}

static void note(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  line("#", fmt, ap);
  va_end(ap);
}

static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  line("FAIL", fmt, ap);
  va_end(ap);
  exit(2);
}

static const char *cu_name(CUresult r) {
  const char *s = NULL;
  cuGetErrorName(r, &s);
  return s ? s : "unknown CUresult";
}

#define CK(call)                                                               \
  do {                                                                         \
    CUresult r_ = (call);                                                      \
    if (r_ != CUDA_SUCCESS) die("%s:%d: %s: %s", __FILE__, __LINE__, #call, cu_name(r_)); \
  } while (0)

#define VK(call)                                                               \
  do {                                                                         \
    int s_ = (call);                                                           \
    if (s_ != VMMIPC_OK) die("%s:%d: %s: %d (%s)", __FILE__, __LINE__, #call, s_, vmmipc_last_error()); \
  } while (0)

static void set_label(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(label, sizeof label, fmt, ap);
  va_end(ap);
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

/* ---- CUDA setup ---- */

static void cuda_init(void) {
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&primary, dev));
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
}

static size_t free_mem(void) {
  size_t f = 0, t = 0;
  CK(cuMemGetInfo(&f, &t));
  return f;
}

/* ---- data ---- */

/* pattern fills dst with the bytes at [off, off+bytes) of a buffer: each
 * 32-bit word is a hash of its index (unique below 16 GiB) and the seed.
 * Cheap enough (vectorised) to check 8 GiB in seconds. */
static void pattern(void *dst, uint64_t off, size_t bytes, uint32_t seed) {
  uint32_t *w = dst;
  uint32_t x = (uint32_t)(off / 4);
  for (size_t i = 0; i < bytes / 4; i++, x++) w[i] = (x * 0x9E3779B1u) ^ (x >> 7) ^ seed;
}

/* A buffer made of chunks, as an application would build it. */
typedef struct {
  CUdeviceptr base;
  size_t total, n;
  size_t *sizes;
  CUmemGenericAllocationHandle *h;
} vbuf;

static void vbuf_alloc(vbuf *b, const size_t *sizes, size_t n, int handle_types) {
  memset(b, 0, sizeof *b);
  b->n = n;
  b->sizes = calloc(n, sizeof *b->sizes);
  b->h = calloc(n, sizeof *b->h);
  for (size_t i = 0; i < n; i++) b->total += b->sizes[i] = sizes[i];
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = (CUmemAllocationHandleType)handle_types;
  CK(cuMemAddressReserve(&b->base, b->total, gran, 0, 0));
  size_t off = 0;
  for (size_t i = 0; i < n; i++) {
    CK(cuMemCreate(&b->h[i], sizes[i], &prop, 0));
    CK(cuMemMap(b->base + off, sizes[i], 0, b->h[i], 0));
    off += sizes[i];
  }
  CUmemAccessDesc a = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CK(cuMemSetAccess(b->base, b->total, &a, 1));
}

static void vbuf_fill(vbuf *b, uint32_t seed) {
  void *host = malloc(gran);
  for (size_t off = 0; off < b->total; off += gran) {
    pattern(host, off, gran, seed);
    CK(cuMemcpyHtoD(b->base + off, host, gran));
  }
  CK(cuCtxSynchronize());
  free(host);
}

/* vbuf_free unmaps, releases every handle and frees the address range. */
static void vbuf_free(vbuf *b) {
  size_t off = 0;
  for (size_t i = 0; i < b->n; i++) {
    CK(cuMemUnmap(b->base + off, b->sizes[i]));
    CK(cuMemRelease(b->h[i]));
    off += b->sizes[i];
  }
  CK(cuMemAddressFree(b->base, b->total));
  free(b->sizes);
  free(b->h);
  memset(b, 0, sizeof *b);
}

static size_t *uniform(size_t n, size_t size) {
  size_t *s = calloc(n, sizeof *s);
  for (size_t i = 0; i < n; i++) s[i] = size;
  return s;
}

/* vbuf_uniform allocates n POSIX-fd shareable chunks of size bytes each and
 * fills them with the pattern of seed. */
static void vbuf_uniform(vbuf *b, size_t n, size_t size, uint32_t seed) {
  size_t *sizes = uniform(n, size);
  vbuf_alloc(b, sizes, n, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  free(sizes);
  vbuf_fill(b, seed);
}

/* expect_fn writes into dst the bytes [off, off+bytes) of a buffer must
 * hold, given arg. */
typedef void expect_fn(void *dst, uint64_t off, size_t bytes, uint32_t arg);

/* every_byte: a buffer all of whose bytes are b. */
static void every_byte(void *dst, uint64_t off, size_t bytes, uint32_t b) {
  (void)off;
  memset(dst, (int)b, bytes);
}

/* compare copies [p, p+total) to the host and compares it with what
 * expect(arg) says it holds; on a mismatch it writes where into why and
 * returns 0. */
static int compare(CUdeviceptr p, size_t total, expect_fn *expect, uint32_t arg, char *why, size_t whylen) {
  unsigned char *got = malloc(gran), *want = malloc(gran);
  int ok = 1;
  for (size_t off = 0; off < total && ok; off += gran) {
    CUresult r = cuMemcpyDtoH(got, p + off, gran);
    if (r != CUDA_SUCCESS) {
      snprintf(why, whylen, "cuMemcpyDtoH at offset %zu: %s", off, cu_name(r));
      ok = 0;
      break;
    }
    expect(want, off, gran, arg);
    if (memcmp(got, want, gran) != 0) {
      size_t i = 0;
      while (got[i] == want[i]) i++;
      snprintf(why, whylen, "byte %zu is %#x, want %#x", off + i, got[i], want[i]);
      ok = 0;
    }
  }
  free(got);
  free(want);
  return ok;
}

/* verify checks [p, p+total) against the pattern of seed. */
static int verify(CUdeviceptr p, size_t total, uint32_t seed, char *why, size_t whylen) {
  return compare(p, total, pattern, seed, why, whylen);
}

/* verify_byte checks that every byte of [p, p+total) is b. */
static int verify_byte(CUdeviceptr p, size_t total, unsigned char b, char *why, size_t whylen) {
  return compare(p, total, every_byte, b, why, whylen);
}

/* ---- descriptors ---- */

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (d == NULL) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* not the directory's own descriptor */
}

/* A thread that samples this process's descriptor count until stopped. */
typedef struct {
  pthread_t thread;
  int stop, base, peak;
} sampler;

static void *sample_loop(void *p) {
  sampler *s = p;
  while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
    int n = count_fds();
    if (n > s->peak) s->peak = n;
    usleep(50);
  }
  return NULL;
}

static void sampler_start(sampler *s) {
  s->stop = 0;
  s->base = s->peak = count_fds();
  if (pthread_create(&s->thread, NULL, sample_loop, s) != 0) die("pthread_create failed");
}

static int sampler_stop(sampler *s) { /* returns the peak extra count */
  __atomic_store_n(&s->stop, 1, __ATOMIC_RELEASE);
  pthread_join(s->thread, NULL);
  int n = count_fds();
  if (n > s->peak) s->peak = n;
  return s->peak - s->base;
}

/* ---- tickets on the command line ---- */

static void ticket_hex(const vmmipc_ticket *t, char *out) {
  for (int i = 0; i < VMMIPC_TICKET_SIZE; i++) sprintf(out + 2 * i, "%02x", t->bytes[i]);
}

static void ticket_unhex(const char *s, vmmipc_ticket *t) {
  if (strlen(s) != 2 * VMMIPC_TICKET_SIZE) die("bad ticket argument");
  for (int i = 0; i < VMMIPC_TICKET_SIZE; i++) {
    unsigned v;
    sscanf(s + 2 * i, "%2x", &v);
    t->bytes[i] = (unsigned char)v;
  }
}

/* ---- processes ---- */

typedef struct {
  pid_t pid;
  int to, from; /* pipes to and from the child */
} child;

static int high_fd(int fd) { /* keep pipe ends clear of 0..9: spawn dups onto 1, 3 and 4 */
  int h = fcntl(fd, F_DUPFD_CLOEXEC, 10);
  close(fd);
  return h;
}

/* spawn starts this program with args (NULL-terminated, without argv[0]);
 * stdout_fd, if >= 0, becomes its stdout. */
static child spawn(const char *const *args, int stdout_fd) {
  int up[2], down[2];
  if (pipe2(up, O_CLOEXEC) || pipe2(down, O_CLOEXEC)) die("pipe2: %s", strerror(errno));
  for (int i = 0; i < 2; i++) up[i] = high_fd(up[i]), down[i] = high_fd(down[i]);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (stdout_fd >= 0) posix_spawn_file_actions_adddup2(&fa, stdout_fd, 1); /* stdout_fd is >= 10 */
  posix_spawn_file_actions_adddup2(&fa, up[1], 3);
  posix_spawn_file_actions_adddup2(&fa, down[0], 4);
  char *argv[32];
  int n = 0;
  argv[n++] = self_path;
  while (*args && n < 31) argv[n++] = (char *)*args++;
  argv[n] = NULL;
  child c = {0};
  int err = posix_spawn(&c.pid, self_path, &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (err) die("posix_spawn: %s", strerror(err));
  close(up[1]);
  close(down[0]);
  c.to = down[1];
  c.from = up[0];
  return c;
}

static char get_byte(child *c) {
  char b = 0;
  if (read(c->from, &b, 1) != 1) return 0; /* the child exited */
  return b;
}

static void put_byte(int fd, char b) {
  if (write(fd, &b, 1) != 1) { /* the peer is gone; its own report says why */
  }
}

/* reap waits for a child, then closes its pipes (so that descriptor
 * counts taken meanwhile still include them); a receiver that crashed (not
 * one that reported its own FAIL lines and exited 1 or 2) is a failure. */
static void reap(child *c, const char *who) {
  int st = 0;
  while (waitpid(c->pid, &st, 0) < 0 && errno == EINTR) {
  }
  close(c->to);
  close(c->from);
  if (WIFSIGNALED(st))
    check(0, "%s was killed by signal %d (%s)", who, WTERMSIG(st), strsignal(WTERMSIG(st)));
  else if (WEXITSTATUS(st) > 2)
    check(0, "%s exited with status %d", who, WEXITSTATUS(st));
}

/* Receivers speak through fds 3 and 4. */
static void tell_sender(char b) { put_byte(3, b); }
static void wait_sender(void) {
  char b;
  if (read(4, &b, 1) != 1) die("the sender went away");
}

static const char *arg(int argc, char **argv, const char *key) {
  size_t k = strlen(key);
  for (int i = 1; i < argc; i++)
    if (strncmp(argv[i], key, k) == 0 && argv[i][k] == '=') return argv[i] + k + 1;
  return NULL;
}

static unsigned long long arg_u(int argc, char **argv, const char *key, unsigned long long dflt) {
  const char *v = arg(argc, argv, key);
  return v ? strtoull(v, NULL, 0) : dflt;
}

static int wait_live_registrations(uint64_t want, double seconds) {
  double until = now_s() + seconds;
  uint64_t n = ~0ull;
  do {
    VK(vmmipc_live_registrations(&n));
    if (n == want) return 1;
    usleep(1000);
  } while (now_s() < until);
  return 0;
}

/* ================================================================== */
/* Receivers                                                          */
/* ================================================================== */

/* recv verify: import (VMMIPC_DEVICE_SAME), count descriptors throughout,
 * compare every byte; with wait=1, tell the sender, wait for its go, and
 * compare again against seed2. */
static int recv_verify(int argc, char **argv) {
  vmmipc_ticket t;
  ticket_unhex(arg(argc, argv, "ticket"), &t);
  uint32_t seed = (uint32_t)arg_u(argc, argv, "seed", 0);
  uint64_t nofile = arg_u(argc, argv, "nofile", 0);
  if (nofile) {
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = nofile;
    if (setrlimit(RLIMIT_NOFILE, &rl)) die("setrlimit: %s", strerror(errno));
  }
  cuda_init();
  CK(cuCtxSetCurrent(primary));
  (void)free_mem(); /* let the context settle before counting */
  vmmipc_ticket_info info;
  VK(vmmipc_ticket_decode(&t, &info));

  sampler s;
  sampler_start(&s);
  vmmipc_mapping m;
  double t0 = now_s();
  int rc = vmmipc_import_stream(&t, VMMIPC_DEVICE_SAME, NULL, &m);
  double dt = now_s() - t0;
  int extra = sampler_stop(&s);
  if (rc != VMMIPC_OK) die("vmmipc_import_stream: %d (%s)", rc, vmmipc_last_error());
  note("imported %llu chunks, %llu bytes in %.3f s", (unsigned long long)info.chunk_count,
       (unsigned long long)info.total_size, dt);
  check(m.size == info.total_size && m.device == 0 && m.memory_kind == VMMIPC_MEMORY_CUDA,
        "mapping is %llu bytes on device %d, kind %u", (unsigned long long)m.size, m.device,
        m.memory_kind);
  check(extra <= FD_BUDGET, "receiver: peak extra descriptors %d (limit %d, RLIMIT_NOFILE %s)",
        extra, FD_BUDGET, nofile ? "64" : "unchanged");
  char why[256] = "";
  check(verify(m.addr, m.size, seed, why, sizeof why), "receiver: all %llu bytes match %s",
        (unsigned long long)m.size, why);
  if (arg_u(argc, argv, "wait", 0)) {
    tell_sender('I');
    wait_sender();
    uint32_t seed2 = (uint32_t)arg_u(argc, argv, "seed2", 0);
    check(verify(m.addr, m.size, seed2, why, sizeof why),
          "receiver: sees the sender's writes made after the import %s", why);
  }
  rc = vmmipc_unmap(&m);
  check(rc == VMMIPC_OK, "vmmipc_unmap: %d %s", rc, rc ? vmmipc_last_error() : "");
  rc = vmmipc_unmap(&m);
  check(rc == VMMIPC_EINVAL, "a second vmmipc_unmap is refused with VMMIPC_EINVAL (got %d)", rc);
  return failed ? 1 : 0;
}

/* recv fail: import a warm-up ticket, then one that must fail with code
 * `expect` and a message containing `msg`; afterwards nothing may remain:
 * same descriptors, same free memory, and the address range is free again.
 * Then tell the sender ('F'), wait for it to check its side, and exit. */
static int recv_fail(int argc, char **argv) {
  vmmipc_ticket warm, t;
  ticket_unhex(arg(argc, argv, "warm"), &warm);
  ticket_unhex(arg(argc, argv, "ticket"), &t);
  int expect = (int)strtol(arg(argc, argv, "expect"), NULL, 0);
  const char *msg = arg(argc, argv, "msg"), *call = arg(argc, argv, "call");
  uint32_t seed = (uint32_t)arg_u(argc, argv, "seed", 0);
  cuda_init();
  CK(cuCtxSetCurrent(primary));

  /* Warm-up: starts the library's poller and the driver's import path, so
   * that what they keep for the life of the process is not counted below. */
  vmmipc_mapping m;
  VK(vmmipc_import_stream(&warm, VMMIPC_DEVICE_SAME, NULL, &m));
  char why[256] = "";
  check(verify(m.addr, m.size, seed, why, sizeof why), "warm-up import reads right %s", why);
  VK(vmmipc_unmap(&m));

  vmmipc_ticket_info info;
  VK(vmmipc_ticket_decode(&t, &info));
  int fds0 = count_fds();
  sampler s;
  sampler_start(&s); /* first, so its stack takes no address probed below */
  size_t span = (info.total_size + gran - 1) / gran * gran;
  CUdeviceptr probe = 0;
  CK(cuMemAddressReserve(&probe, span, gran, 0, 0)); /* where the import will reserve */
  CK(cuMemAddressFree(probe, span));
  size_t free0 = free_mem();
  memset(&m, 0, sizeof m);
  /* Tickets from vmmipc_register carry no GPU UUID: name the device. */
  int rc = vmmipc_import_stream(&t, 0, NULL, &m);
  int extra = sampler_stop(&s);
  const char *err = vmmipc_last_error();
  check(rc == expect && strstr(err, msg) != NULL && strstr(err, call) != NULL,
        "import fails with %d (want %d): \"%s\" (want \"%s\" and \"%s\")", rc, expect, err, msg, call);
  check(m.addr == 0 && m.size == 0, "the mapping is left untouched");
  check(extra <= FD_BUDGET, "receiver: peak extra descriptors %d (limit %d)", extra, FD_BUDGET);
  int fds1 = count_fds();
  check(fds1 == fds0, "receiver: descriptors back to %d (now %d)", fds0, fds1);
  size_t free1 = free_mem();
  /* Within one chunk: the driver may keep a page table it allocated. */
  check(free1 + gran > free0, "receiver: device free memory back to %zu within one chunk (now %zu, %+lld bytes)",
        free0, free1, (long long)free1 - (long long)free0);
  CUdeviceptr again = 0;
  CUresult r = cuMemAddressReserve(&again, span, gran, probe, 0);
  check(r == CUDA_SUCCESS && again == probe,
        "the reservation was freed: reserving %zu bytes at %#llx again gives %#llx (%s)", span,
        (unsigned long long)probe, (unsigned long long)again, cu_name(r));
  if (r == CUDA_SUCCESS) CK(cuMemAddressFree(again, span));
  tell_sender('F');
  wait_sender();
  return failed ? 1 : 0;
}

/* recv contexts: import on a thread with no current context and on a
 * thread with a context of its own; check each thread's context afterwards;
 * unmap both from the main thread. Both skip the import cache, so that the
 * second import makes its driver calls too (a hit would make none). */
typedef struct {
  vmmipc_ticket t;
  uint32_t seed;
  int own_ctx;
  vmmipc_mapping m;
} ctx_job;

static void *ctx_thread(void *p) {
  ctx_job *j = p;
  CUcontext mine = NULL, cur = (CUcontext)1;
  if (j->own_ctx) {
#if CUDA_VERSION >= 13000
    CK(cuCtxCreate(&mine, NULL, 0, dev));
#else
    CK(cuCtxCreate(&mine, 0, dev));
#endif
  }
  CK(cuCtxGetCurrent(&cur));
  if (cur != mine) die("the test's own context setup failed");
  vmmipc_options o;
  vmmipc_options_init(&o, sizeof o);
  o.import_flags = VMMIPC_IMPORT_NO_CACHE;
  int rc = vmmipc_import_stream(&j->t, VMMIPC_DEVICE_SAME, &o, &j->m);
  check(rc == VMMIPC_OK, "import on a thread with %s: %d %s", j->own_ctx ? "its own context" : "no context",
        rc, rc ? vmmipc_last_error() : "");
  CK(cuCtxGetCurrent(&cur));
  check(cur == mine, "the thread's current context is unchanged (%s)", j->own_ctx ? "its own" : "none");
  if (rc != VMMIPC_OK) return NULL;
  char why[256] = "";
  if (!j->own_ctx) CK(cuCtxPushCurrent(primary)); /* copying needs a context */
  check(verify(j->m.addr, j->m.size, j->seed, why, sizeof why), "data read on that thread matches %s", why);
  CUcontext popped = NULL;
  CK(cuCtxPopCurrent(&popped));
  CK(cuCtxGetCurrent(&cur));
  check(popped == (j->own_ctx ? mine : primary) && cur == NULL,
        "the thread's context stack is as it was (one entry, then empty)");
  if (mine) CK(cuCtxDestroy(mine));
  return NULL;
}

static int recv_contexts(int argc, char **argv) {
  cuda_init(); /* main thread: no current context */
  ctx_job jobs[2] = {0};
  for (int i = 0; i < 2; i++) {
    ticket_unhex(arg(argc, argv, "ticket"), &jobs[i].t);
    jobs[i].seed = (uint32_t)arg_u(argc, argv, "seed", 0);
    jobs[i].own_ctx = i;
    pthread_t th;
    pthread_create(&th, NULL, ctx_thread, &jobs[i]);
    pthread_join(th, NULL); /* one after the other: the second proves the first left no trace */
  }
  if (jobs[0].m.addr && jobs[1].m.addr)
    check(jobs[0].m.addr != jobs[1].m.addr, "the uncached imports are two mappings (%#llx, %#llx)",
          (unsigned long long)jobs[0].m.addr, (unsigned long long)jobs[1].m.addr);
  for (int i = 0; i < 2; i++) {
    if (jobs[i].m.addr == 0) continue;
    int rc = vmmipc_unmap(&jobs[i].m);
    check(rc == VMMIPC_OK, "unmap from another thread, later: %d %s", rc, rc ? vmmipc_last_error() : "");
  }
  return failed ? 1 : 0;
}

/* recv nodriver: VMMIPC_LIBCUDA points nowhere; every CUDA call must fail
 * cleanly with VMMIPC_ECUDA naming the path. */
static int recv_nodriver(int argc, char **argv) {
  vmmipc_ticket t;
  ticket_unhex(arg(argc, argv, "ticket"), &t);
  vmmipc_ticket out;
  int rc = vmmipc_register_cuda(0x7f0000000000ull, 2 * MIB, NULL, &out);
  check(rc == VMMIPC_ECUDA && strstr(vmmipc_last_error(), "/nonexistent/libcuda.so.1"),
        "register without a driver: %d \"%s\"", rc, vmmipc_last_error());
  vmmipc_mapping m;
  rc = vmmipc_import_stream(&t, VMMIPC_DEVICE_SAME, NULL, &m);
  check(rc == VMMIPC_ECUDA && strstr(vmmipc_last_error(), "/nonexistent/libcuda.so.1"),
        "import without a driver: %d \"%s\"", rc, vmmipc_last_error());
  return failed ? 1 : 0;
}

/* ---- the import cache ---- */

static vmmipc_cache_info cache_now(void) {
  vmmipc_cache_info i;
  memset(&i, 0, sizeof i);
  VK(vmmipc_cache_get_info(&i, sizeof i));
  return i;
}

/* range_is_free reports whether [addr, addr+span) can be reserved again
 * at addr: the mapping that held it is gone, reservation included. */
static int range_is_free(CUdeviceptr addr, size_t span) {
  CUdeviceptr again = 0;
  CUresult r = cuMemAddressReserve(&again, span, gran, addr, 0);
  if (r != CUDA_SUCCESS) return 0;
  CK(cuMemAddressFree(again, span));
  return again == addr;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* import_timed imports t onto the exporter's GPU with opts (NULL: the
 * defaults) and returns the time it took in milliseconds. */
static double import_timed(const vmmipc_ticket *t, const vmmipc_options *opts, vmmipc_mapping *m) {
  double t0 = now_s();
  int rc = vmmipc_import_stream(t, VMMIPC_DEVICE_SAME, opts, m);
  double ms = (now_s() - t0) * 1e3;
  if (rc != VMMIPC_OK) die("vmmipc_import_stream: %d (%s)", rc, vmmipc_last_error());
  return ms;
}

/* recv cache: the import cache on CUDA memory. ticket= is a uses = 0
 * registration of the sender's buffer (pattern seed=); again= comes from
 * vmmipc_register_again, same= from registering the same range again,
 * handles= from vmmipc_register_cuda_handles of the same allocations (a new
 * identity). The sender writes 0xA5 over its buffer when told 'W', and
 * unregisters and frees everything when told 'U'. */
static int recv_cache(int argc, char **argv) {
  vmmipc_ticket t0, t_again, t_same, t_handles;
  ticket_unhex(arg(argc, argv, "ticket"), &t0);
  ticket_unhex(arg(argc, argv, "again"), &t_again);
  ticket_unhex(arg(argc, argv, "same"), &t_same);
  ticket_unhex(arg(argc, argv, "handles"), &t_handles);
  uint32_t seed = (uint32_t)arg_u(argc, argv, "seed", 0);
  cuda_init();
  CK(cuCtxSetCurrent(primary));
  (void)free_mem(); /* let the context settle before counting */
  vmmipc_ticket_info info;
  VK(vmmipc_ticket_decode(&t0, &info));
  size_t span = (info.total_size + gran - 1) / gran * gran;
  char why[256] = "";

  /* The first import maps anew; unmapped, it stays cached. */
  vmmipc_cache_info c0 = cache_now();
  vmmipc_mapping m;
  double first_ms = import_timed(&t0, NULL, &m);
  CUdeviceptr addr = m.addr;
  vmmipc_cache_info c1 = cache_now();
  check(c1.misses == c0.misses + 1 && c1.entries == c0.entries + 1 && c1.referenced_bytes == info.total_size,
        "first import: one miss, one entry of %llu referenced bytes (misses +%llu, entries %llu, referenced %llu)",
        (unsigned long long)info.total_size, (unsigned long long)(c1.misses - c0.misses),
        (unsigned long long)c1.entries, (unsigned long long)c1.referenced_bytes);
  check(verify(m.addr, m.size, seed, why, sizeof why), "first import: all %llu bytes match %s",
        (unsigned long long)m.size, why);
  VK(vmmipc_unmap(&m));
  c1 = cache_now();
  check(c1.unreferenced_bytes == info.total_size && c1.referenced_bytes == 0,
        "unmapped, the mapping stays cached (%llu unreferenced bytes)", (unsigned long long)c1.unreferenced_bytes);

  /* Repeated imports of the uses = 0 registration: hits, no descriptor. */
  enum { HITS = 21 };
  double ms[HITS];
  int all_same = 1;
  sampler s;
  sampler_start(&s);
  for (int i = 0; i < HITS; i++) {
    ms[i] = import_timed(&t0, NULL, &m);
    all_same &= m.addr == addr;
    VK(vmmipc_unmap(&m));
  }
  int extra = sampler_stop(&s);
  vmmipc_cache_info c2 = cache_now();
  qsort(ms, HITS, sizeof ms[0], cmp_double);
  note("%llu chunks, %llu bytes: first import %.1f ms; cache hit min %.3f ms, median %.3f ms, max %.3f ms",
       (unsigned long long)info.chunk_count, (unsigned long long)info.total_size, first_ms, ms[0], ms[HITS / 2],
       ms[HITS - 1]);
  check(all_same, "every repeated import returned the cached address");
  check(c2.hits == c1.hits + HITS && c2.misses == c1.misses, "%d hits, no miss (hits +%llu, misses +%llu)", HITS,
        (unsigned long long)(c2.hits - c1.hits), (unsigned long long)(c2.misses - c1.misses));
  /* A hit's socket, and maybe the cache's status poll: no chunk arrives. */
  check(extra <= 2, "cache hits: peak extra descriptors %d (two sockets at most: no chunk is received)", extra);
  check(ms[HITS / 2] < 1.0, "a cache hit of %llu chunks takes %.3f ms (median of %d; target under 1 ms)",
        (unsigned long long)info.chunk_count, ms[HITS / 2], HITS);

  /* The sender's in-place writes are seen through the cached mapping. */
  import_timed(&t0, NULL, &m);
  check(m.addr == addr, "a hit before the sender's write");
  tell_sender('W');
  wait_sender();
  check(verify_byte(m.addr, m.size, 0xA5, why, sizeof why),
        "the cached mapping sees the sender's cuMemsetD8 made after the import %s", why);
  VK(vmmipc_unmap(&m));

  /* VMMIPC_IMPORT_NO_CACHE: a new mapping, imported anew, not kept. */
  vmmipc_options o;
  vmmipc_options_init(&o, sizeof o);
  o.import_flags = VMMIPC_IMPORT_NO_CACHE;
  vmmipc_cache_info c3 = cache_now();
  double uncached_ms = import_timed(&t0, &o, &m);
  vmmipc_cache_info c4 = cache_now();
  note("an uncached import of the same registration: %.1f ms", uncached_ms);
  check(m.addr != addr && c4.hits == c3.hits && c4.misses == c3.misses + 1,
        "VMMIPC_IMPORT_NO_CACHE maps anew (at %#llx, cached at %#llx; hits +%llu, misses +%llu)",
        (unsigned long long)m.addr, (unsigned long long)addr, (unsigned long long)(c4.hits - c3.hits),
        (unsigned long long)(c4.misses - c3.misses));
  check(verify_byte(m.addr, m.size, 0xA5, why, sizeof why), "the uncached mapping reads the same memory %s", why);
  CUdeviceptr uncached = m.addr;
  VK(vmmipc_unmap(&m));
  check(cache_now().entries == c3.entries && range_is_free(uncached, span),
        "the uncached mapping is undone at its unmap, its range freed");

  /* Tickets of the same identity hit; register_cuda_handles misses. */
  vmmipc_cache_info c5 = cache_now();
  import_timed(&t_again, NULL, &m);
  check(m.addr == addr, "vmmipc_register_again's ticket is a cache hit (%#llx)", (unsigned long long)m.addr);
  VK(vmmipc_unmap(&m));
  import_timed(&t_same, NULL, &m);
  check(m.addr == addr, "the same range registered again is a cache hit (%#llx)", (unsigned long long)m.addr);
  VK(vmmipc_unmap(&m));
  vmmipc_cache_info c6 = cache_now();
  check(c6.hits == c5.hits + 2 && c6.misses == c5.misses, "two hits (hits +%llu, misses +%llu)",
        (unsigned long long)(c6.hits - c5.hits), (unsigned long long)(c6.misses - c5.misses));
  import_timed(&t_handles, NULL, &m);
  vmmipc_cache_info c7 = cache_now();
  check(m.addr != addr && c7.misses == c6.misses + 1,
        "vmmipc_register_cuda_handles makes a new identity: a miss (at %#llx)", (unsigned long long)m.addr);
  check(verify_byte(m.addr, m.size, 0xA5, why, sizeof why), "the handles' mapping reads the same memory %s", why);
  VK(vmmipc_unmap(&m)); /* its one use is spent: not kept */

  /* The sender unregisters: the cached mapping is invalidated and undone,
   * and its range is free again. */
  vmmipc_cache_info c8 = cache_now();
  tell_sender('U');
  wait_sender();
  /* The cache forgets the entry, then undoes it: wait for both. */
  double since = now_s();
  int gone = 0;
  while (!(gone = cache_now().entries + 1 == c8.entries && range_is_free(addr, span)) && now_s() - since < 2)
    usleep(1000);
  double took = (now_s() - since) * 1e3;
  vmmipc_cache_info c9 = cache_now();
  check(gone && c9.invalidations == c8.invalidations + 1 && c9.unreferenced_bytes == 0,
        "invalidated and undone %.0f ms after the sender unregistered (entries %llu -> %llu, invalidations +%llu, "
        "range %s)",
        took, (unsigned long long)c8.entries, (unsigned long long)c9.entries,
        (unsigned long long)(c9.invalidations - c8.invalidations), range_is_free(addr, span) ? "free" : "still held");
  tell_sender('D'); /* the sender now checks that the memory came back */
  wait_sender();
  return failed ? 1 : 0;
}

/* ================================================================== */
/* Scenarios (each one is a sender process)                           */
/* ================================================================== */

/* spawn_recv starts a receiver; extra is a NULL-terminated list of
 * key=value arguments. */
static child spawn_recv(const char *mode, const vmmipc_ticket *t, const char *const *extra) {
  static char hex[2 * VMMIPC_TICKET_SIZE + 16], lb[200];
  strcpy(hex, "ticket=");
  ticket_hex(t, hex + 7);
  snprintf(lb, sizeof lb, "label=%s", label);
  const char *args[24] = {"recv", mode, lb, hex};
  int n = 4;
  while (extra && *extra && n < 23) args[n++] = *extra++;
  args[n] = NULL;
  return spawn(args, -1);
}

#define ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})

static vmmipc_options options(uint32_t uses) {
  vmmipc_options o;
  vmmipc_options_init(&o, sizeof o);
  o.uses = uses;
  return o;
}

/* Data across processes for `n` chunks of the given sizes. */
static void scenario_data(const char *name, const size_t *sizes, size_t n, int nofile64) {
  uint32_t seed = 0x1000u + (uint32_t)n;
  vbuf b;
  vbuf_alloc(&b, sizes, n, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  vbuf_fill(&b, seed);
  vmmipc_options o = options(1);
  vmmipc_ticket t;
  double t0 = now_s();
  VK(vmmipc_register_cuda(b.base, b.total, &o, &t));
  note("registered %zu chunks in %.3f s", n, now_s() - t0);
  vmmipc_ticket_info info;
  VK(vmmipc_ticket_decode(&t, &info));
  check(info.chunk_count == n && info.total_size == b.total && info.memory_kind == VMMIPC_MEMORY_CUDA,
        "ticket holds %llu chunks, %llu bytes", (unsigned long long)info.chunk_count,
        (unsigned long long)info.total_size);
  char sd[32], nf[32];
  snprintf(sd, sizeof sd, "seed=%u", seed);
  snprintf(nf, sizeof nf, "nofile=%d", nofile64 ? 64 : 0);
  child c = spawn_recv("verify", &t, ARGS(sd, nf));
  /* Counting starts after registering (the server is up) and after the
   * spawn (its two pipes are the test's): the receiver takes far longer to
   * start than this. */
  sampler s;
  sampler_start(&s);
  reap(&c, "receiver");
  int extra = sampler_stop(&s);
  check(extra <= FD_BUDGET, "sender: peak extra descriptors %d (limit %d)", extra, FD_BUDGET);
  check(wait_live_registrations(0, 5), "the registration ended after its one use");
  vbuf_free(&b);
  (void)name;
}

static void run_data(size_t n) {
  set_label("data %zux%zuMiB", n, gran / MIB);
  size_t *sizes = uniform(n, gran);
  scenario_data(label, sizes, n, n == 4096);
  free(sizes);
}

static void run_mixed(void) {
  size_t sizes[] = {2 * MIB, 4 * MIB, 6 * MIB, 2 * MIB, 6 * MIB, 4 * MIB, 2 * MIB};
  set_label("data mixed 2/4/6MiB");
  scenario_data(label, sizes, sizeof sizes / sizeof sizes[0], 0);
}

/* The sender frees its buffer right after registering. */
static void run_free_after_register(void) {
  set_label("sender frees after register");
  size_t free0 = free_mem();
  vbuf b;
  vbuf_uniform(&b, 16, gran, 77);
  size_t total = b.total;
  vmmipc_options o = options(1);
  vmmipc_ticket t;
  VK(vmmipc_register_cuda(b.base, b.total, &o, &t));
  vbuf_free(&b); /* unmap, release our handles, free the range */
  size_t held = free_mem();
  check(free0 - held >= total, "the registration keeps the %zu bytes alive after the owner freed them", total);
  child c = spawn_recv("verify", &t, ARGS("seed=77"));
  reap(&c, "receiver");
  check(wait_live_registrations(0, 5), "the registration ended after its one use");
  double until = now_s() + 5;
  size_t f;
  while ((f = free_mem()) + gran <= held + total && now_s() < until) usleep(1000);
  check(f + gran > held + total, "the registration's references were released at its end (free %zu -> %zu, %+lld vs. expected)",
        held, f, (long long)(f - held) - (long long)total);
}

/* Failure injection through vmmipc_register with our own export_fn. */
enum fail_mode { FAIL_EXPORT, FAIL_IMPORT, FAIL_MAP };

typedef struct {
  vbuf *b;
  uint64_t k;
  enum fail_mode mode;
  CUmemGenericAllocationHandle small; /* FAIL_MAP: a 1-granule allocation */
  int released;
} injector;

static int inject_export(void *user, uint64_t index, int *fd_out) {
  injector *in = user;
  CUcontext cur = NULL;
  cuCtxGetCurrent(&cur);
  if (cur != primary) cuCtxSetCurrent(primary); /* a library thread */
  CUmemGenericAllocationHandle h = in->b->h[index];
  if (index == in->k) {
    switch (in->mode) {
    case FAIL_EXPORT:
      return 42;
    case FAIL_IMPORT: {
      int fd = memfd_create("not-a-cuda-handle", MFD_CLOEXEC);
      if (fd < 0 || ftruncate(fd, (off_t)in->b->sizes[index]) != 0) return 43;
      *fd_out = fd;
      return 0;
    }
    case FAIL_MAP:
      h = in->small;
      break;
    }
  }
  int fd = -1;
  if (cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS) return 44;
  *fd_out = fd;
  return 0;
}

static void inject_release(void *user) { ((injector *)user)->released = 1; }

static void run_failure(enum fail_mode mode) {
  static const char *names[] = {"export fails at chunk k", "import fails at chunk k", "map fails at chunk k"};
  set_label("%s", names[mode]);
  size_t n = 64, unit = mode == FAIL_MAP ? 2 * gran : gran;
  uint64_t k = 37;
  vbuf b;
  vbuf_uniform(&b, n, unit, 5);
  injector in = {.b = &b, .k = k, .mode = mode};
  if (mode == FAIL_MAP) {
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CK(cuMemCreate(&in.small, gran, &prop, 0));
  }
  vmmipc_options o = options(1);
  vmmipc_ticket warm, t;
  VK(vmmipc_register_cuda(b.base, unit, &o, &warm)); /* chunk 0 alone */
  o.memory_kind = VMMIPC_MEMORY_CUDA;
  VK(vmmipc_register(b.sizes, n, inject_export, inject_release, &in, &o, &t));
  char ex[32], at[64], call[96];
  static const int codes[] = {VMMIPC_EEXPORT, VMMIPC_ECUDA, VMMIPC_ECUDA};
  static const char *calls[] = {"export_fn returned 42", "cuMemImportFromShareableHandle", "cuMemMap"};
  snprintf(ex, sizeof ex, "expect=%d", codes[mode]);
  snprintf(at, sizeof at, "msg=chunk %llu of %zu", (unsigned long long)k, n);
  snprintf(call, sizeof call, "call=%s", calls[mode]);
  static char wh[2 * VMMIPC_TICKET_SIZE + 8];
  strcpy(wh, "warm=");
  ticket_hex(&warm, wh + 5);
  child c = spawn_recv("fail", &t, ARGS(wh, ex, at, call, "seed=5"));
  sampler s;
  sampler_start(&s);
  char got = get_byte(&c);
  int extra = sampler_stop(&s);
  if (got == 'F') {
    /* The receiver failed as expected and says it holds nothing. Now drop
     * the sender's side too: every byte it allocated must come back, which
     * it cannot if the receiver still maps or holds any chunk. (Measured
     * from here: the receiver's own context also takes device memory.) */
    size_t before = free_mem();
    size_t mine = b.total + (mode == FAIL_MAP ? gran : 0);
    int rc = vmmipc_unregister(&t);
    check(rc == VMMIPC_OK, "the failed registration was still live (the use was given back): %d", rc);
    check(wait_live_registrations(0, 5) && in.released, "release_fn ran once the registration ended");
    vbuf_free(&b);
    if (mode == FAIL_MAP) CK(cuMemRelease(in.small));
    double until = now_s() + 5;
    size_t f;
    while ((f = free_mem()) + gran <= before + mine && now_s() < until) usleep(1000);
    check(f + gran > before + mine,
          "the sender's %zu bytes came back while the receiver lives (free %zu -> %zu, %+lld vs. expected): the receiver kept no chunk",
          mine, before, f, (long long)(f - before) - (long long)mine);
    put_byte(c.to, 'G');
  } else {
    close(c.to); /* the receiver failed otherwise: unblock it if it waits */
    c.to = -1;
  }
  check(extra <= FD_BUDGET, "sender: peak extra descriptors %d (limit %d)", extra, FD_BUDGET);
  reap(&c, "receiver");
}

/* A ticket with uses = 2: both receivers see writes made after import. */
static void run_two_receivers(void) {
  set_label("uses=2, writes after import");
  vbuf b;
  vbuf_uniform(&b, 8, gran, 11);
  vmmipc_options o = options(2);
  vmmipc_ticket t;
  VK(vmmipc_register_cuda(b.base, b.total, &o, &t));
  child c[2];
  for (int i = 0; i < 2; i++) c[i] = spawn_recv("verify", &t, ARGS("seed=11", "wait=1", "seed2=12"));
  int ready = 0;
  for (int i = 0; i < 2; i++) ready += get_byte(&c[i]) == 'I';
  check(ready == 2, "both receivers imported (%d of 2)", ready);
  vbuf_fill(&b, 12); /* write after both imported */
  for (int i = 0; i < 2; i++) put_byte(c[i].to, 'G');
  for (int i = 0; i < 2; i++) reap(&c[i], "receiver");
  check(wait_live_registrations(0, 5), "the registration ended after its two uses");
  vbuf_free(&b);
}

/* A library call made on a new thread, which has no current context: the
 * library must work there and leave the thread without one. */
typedef struct {
  int (*call)(void *arg);
  void *arg;
  int rc;
  CUcontext after; /* the thread's current context once call returned */
} bare_call;

static void *bare_thread(void *p) {
  bare_call *c = p;
  c->rc = c->call(c->arg);
  cuCtxGetCurrent(&c->after);
  return NULL;
}

/* without_context runs call(arg) on a new thread and returns its status;
 * *after is that thread's current context once the call returned. */
static int without_context(int (*call)(void *arg), void *arg, CUcontext *after) {
  bare_call c = {.call = call, .arg = arg, .after = (CUcontext)1};
  pthread_t th;
  if (pthread_create(&th, NULL, bare_thread, &c) != 0) die("pthread_create failed");
  pthread_join(th, NULL);
  *after = c.after;
  return c.rc;
}

typedef struct {
  vbuf *b;
  vmmipc_ticket t;
} registration;

/* register_for_two registers a registration's buffer for two uses. */
static int register_for_two(void *p) {
  registration *r = p;
  vmmipc_options o = options(2);
  int rc = vmmipc_register_cuda(r->b->base, r->b->total, &o, &r->t);
  if (rc != VMMIPC_OK) note("vmmipc_register_cuda: %s", vmmipc_last_error());
  return rc;
}

static void run_contexts(void) {
  set_label("caller contexts");
  vbuf b;
  vbuf_uniform(&b, 8, gran, 21);
  registration r = {.b = &b};
  CUcontext after;
  int rc = without_context(register_for_two, &r, &after);
  check(rc == VMMIPC_OK && after == NULL, "register on a thread with no context: %d, context after: %p", rc,
        (void *)after);
  if (rc != VMMIPC_OK) die("cannot go on without a ticket");
  child c = spawn_recv("contexts", &r.t, ARGS("seed=21"));
  reap(&c, "receiver");
  check(wait_live_registrations(0, 5), "both imports used the ticket up");
  vbuf_free(&b);
}

/* vmmipc_register_cuda_handles: borrowed handles, size checks, release_fn. */
static int handles_released;
static void handles_release(void *user) { (void)user; handles_released++; }

static void run_handles(void) {
  set_label("register_cuda_handles");
  size_t sizes[] = {2 * MIB, 6 * MIB, 4 * MIB};
  vbuf b;
  vbuf_alloc(&b, sizes, 3, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  vbuf_fill(&b, 31);
  uint64_t hs[3], sz[3];
  for (int i = 0; i < 3; i++) hs[i] = b.h[i], sz[i] = sizes[i];
  vmmipc_options o = options(1);
  vmmipc_ticket t;

  sz[1] = 4 * MIB; /* smaller than the allocation */
  int rc = vmmipc_register_cuda_handles(hs, sz, 3, handles_release, NULL, &o, &t);
  check(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "handle 1"), "a size smaller than the allocation: %d \"%s\"",
        rc, vmmipc_last_error());
  sz[1] = 8 * MIB; /* larger */
  rc = vmmipc_register_cuda_handles(hs, sz, 3, handles_release, NULL, &o, &t);
  check(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "handle 1"), "a size larger than the allocation: %d \"%s\"",
        rc, vmmipc_last_error());
  sz[1] = 6 * MIB + 4096; /* not a granule multiple */
  rc = vmmipc_register_cuda_handles(hs, sz, 3, handles_release, NULL, &o, &t);
  check(rc == VMMIPC_EINVAL, "a size off the granularity: %d \"%s\"", rc, vmmipc_last_error());
  check(handles_released == 0, "release_fn not called for refused registrations");

  sz[1] = 6 * MIB;
  VK(vmmipc_register_cuda_handles(hs, sz, 3, handles_release, NULL, &o, &t));
  child c = spawn_recv("verify", &t, ARGS("seed=31"));
  reap(&c, "receiver");
  check(wait_live_registrations(0, 5) && handles_released == 1, "release_fn ran once at the end (%d)",
        handles_released);
  vbuf_free(&b);
}

/* Bad input is refused with a clear error and leaves nothing behind. */
static void run_bad_input(void) {
  set_label("bad input");
  vmmipc_options o = options(1);
  vmmipc_ticket t;
  size_t two[] = {2 * gran, 2 * gran};
  vbuf none;
  vbuf_alloc(&none, two, 2, CU_MEM_HANDLE_TYPE_NONE);
  int rc = vmmipc_register_cuda(none.base, none.total, &o, &t);
  check(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "CU_MEM_HANDLE_TYPE_NONE"),
        "an allocation without POSIX-fd export: %d \"%s\"", rc, vmmipc_last_error());
  vbuf_free(&none);

  vbuf b;
  vbuf_alloc(&b, two, 2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  rc = vmmipc_register_cuda(b.base + gran, 2 * gran, &o, &t);
  check(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "start on an allocation boundary"),
        "a range starting inside an allocation: %d \"%s\"", rc, vmmipc_last_error());
  rc = vmmipc_register_cuda(b.base, 3 * gran, &o, &t);
  check(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "end on an allocation boundary"),
        "a range ending inside an allocation: %d \"%s\"", rc, vmmipc_last_error());
  rc = vmmipc_register_cuda(b.base + b.total + 64 * gran, gran, &o, &t);
  check(rc < 0 && rc != VMMIPC_EINTERNAL, "an unmapped address: %d \"%s\"", rc, vmmipc_last_error());
  CUdeviceptr plain = 0;
  CK(cuMemAlloc(&plain, gran));
  rc = vmmipc_register_cuda(plain, gran, &o, &t);
  check(rc < 0 && rc != VMMIPC_EINTERNAL, "cuMemAlloc memory: %d \"%s\"", rc, vmmipc_last_error());
  CK(cuMemFree(plain));

  uint64_t live = 9;
  VK(vmmipc_live_registrations(&live));
  check(live == 0, "no registration was left behind (%llu)", (unsigned long long)live);

  VK(vmmipc_register_cuda(b.base, b.total, &o, &t));
  vmmipc_mapping m;
  int32_t bad_access[] = {7};
  o.access_devices = bad_access;
  o.access_device_count = 1;
  rc = vmmipc_import_stream(&t, VMMIPC_DEVICE_SAME, &o, &m);
  check(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "access device 7"),
        "a missing access device: %d \"%s\"", rc, vmmipc_last_error());
  rc = vmmipc_import_stream(&t, 5, NULL, &m);
  check(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "device 5"), "a missing device: %d \"%s\"", rc,
        vmmipc_last_error());

  /* Without a driver (in a child: the library loads the driver once). */
  setenv("VMMIPC_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
  child c = spawn_recv("nodriver", &t, NULL);
  unsetenv("VMMIPC_LIBCUDA");
  reap(&c, "receiver");

  /* The ticket was never used: an import in this process still works. */
  rc = vmmipc_import_stream(&t, 0, NULL, &m);
  check(rc == VMMIPC_OK, "refused imports did not use the ticket up: %d %s", rc, rc ? vmmipc_last_error() : "");
  if (rc == VMMIPC_OK) VK(vmmipc_unmap(&m));
  vbuf_free(&b);
}

/* The import cache on CUDA memory (see recv_cache): hits of a uses = 0
 * registration, the sender's in-place writes through the cached mapping,
 * VMMIPC_IMPORT_NO_CACHE, register_again and the same range registered
 * again (hits), register_cuda_handles (a miss), invalidation when the
 * sender unregisters, and the memory coming back once it is undone. */
static int cache_handles_released;
static void cache_handles_release(void *user) {
  (void)user;
  __atomic_add_fetch(&cache_handles_released, 1, __ATOMIC_SEQ_CST);
}

static void run_cache(void) {
  set_label("import cache %dx%zuMiB", 4096, gran / MIB);
  size_t n = 4096;
  uint32_t seed = 0x2000;
  vbuf b;
  vbuf_uniform(&b, n, gran, seed);
  size_t total = b.total;
  vmmipc_options o0 = options(0), o1 = options(1);
  vmmipc_ticket t0, t_again, t_same, t_handles;
  VK(vmmipc_register_cuda(b.base, b.total, &o0, &t0));
  VK(vmmipc_register_again(&t0, NULL, NULL, &o1, &t_again));
  VK(vmmipc_register_cuda(b.base, b.total, &o1, &t_same));
  uint64_t *hs = calloc(n, sizeof *hs), *sz = calloc(n, sizeof *sz);
  for (size_t i = 0; i < n; i++) hs[i] = b.h[i], sz[i] = b.sizes[i];
  VK(vmmipc_register_cuda_handles(hs, sz, n, cache_handles_release, NULL, &o1, &t_handles));
  free(hs);
  free(sz);
  uint64_t live = 0;
  VK(vmmipc_live_registrations(&live));
  check(live == 4, "four registrations live (%llu)", (unsigned long long)live);
  static char again[2 * VMMIPC_TICKET_SIZE + 8], same[2 * VMMIPC_TICKET_SIZE + 8], handles[2 * VMMIPC_TICKET_SIZE + 16],
      sd[32];
  strcpy(again, "again=");
  ticket_hex(&t_again, again + 6);
  strcpy(same, "same=");
  ticket_hex(&t_same, same + 5);
  strcpy(handles, "handles=");
  ticket_hex(&t_handles, handles + 8);
  snprintf(sd, sizeof sd, "seed=%u", seed);
  child c = spawn_recv("cache", &t0, ARGS(again, same, handles, sd));
  size_t held = 0;
  for (char cmd; (cmd = get_byte(&c)) != 0;) {
    if (cmd == 'W') { /* write over the buffer in place, after the import */
      CK(cuMemsetD8(b.base, 0xA5, b.total));
      CK(cuCtxSynchronize());
    } else if (cmd == 'U') { /* end everything and free our side */
      check(wait_live_registrations(1, 5), "every registration but the anchor ended (the receiver used them up)");
      check(__atomic_load_n(&cache_handles_released, __ATOMIC_SEQ_CST) == 1,
            "release_fn of register_cuda_handles ran once");
      /* Free our buffer while the anchor still holds the memory, and count
       * then: once the anchor ends, the receiver's cache may undo its
       * mapping at any moment (its poller asks every 250 ms). */
      vbuf_free(&b);
      held = free_mem(); /* the anchor and the receiver's cached mapping hold the memory */
      VK(vmmipc_unregister(&t0));
      check(wait_live_registrations(0, 5), "every registration ended");
    } else if (cmd == 'D') { /* the receiver's mapping is undone: the memory comes back */
      double until = now_s() + 5;
      size_t f;
      while ((f = free_mem()) + gran <= held + total && now_s() < until) usleep(1000);
      check(f + gran > held + total,
            "the memory came back once the receiver's cache undid its mapping (free %zu -> %zu, %+lld vs. expected)",
            held, f, (long long)(f - held) - (long long)total);
    }
    put_byte(c.to, 'G');
  }
  reap(&c, "receiver");
  if (b.n) vbuf_free(&b); /* the receiver failed before 'U' */
}

/* vmmipc_cuda_query_range: the range on allocation boundaries that covers
 * [dptr, dptr + size), the handle types and the device; ENOENT for memory
 * that is not VMM; no context needed or changed. */
typedef struct {
  CUdeviceptr p;
  vmmipc_cuda_range_info info;
} range_query;

/* query_page asks for the range that covers the 4096 bytes at p. */
static int query_page(void *p) {
  range_query *q = p;
  return vmmipc_cuda_query_range(q->p, 4096, &q->info);
}

static void run_query_range(void) {
  set_label("cuda_query_range");
  size_t sizes[] = {gran, 2 * gran, 3 * gran};
  vbuf b;
  vbuf_alloc(&b, sizes, 3, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  const struct {
    uint64_t off, size, base_off, want_size;
    const char *what;
  } cases[] = {
      {gran + 4096, 100, gran, 2 * gran, "a range inside allocation 1"},
      {gran / 2, gran, 0, 3 * gran, "a range across allocations 0 and 1"},
      {0, 6 * gran, 0, 6 * gran, "the whole buffer"},
      {6 * gran - 1, 1, 3 * gran, 3 * gran, "its last byte"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    vmmipc_cuda_range_info info;
    memset(&info, 0xAB, sizeof info);
    int rc = vmmipc_cuda_query_range(b.base + cases[i].off, cases[i].size, &info);
    check(rc == VMMIPC_OK && info.base == b.base + cases[i].base_off && info.size == cases[i].want_size &&
              (info.handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) && info.device == 0,
          "%s: %d, base %+lld, size %llu (want %+lld, %llu), handle types %#x, device %d: %s", cases[i].what, rc,
          (long long)(info.base - b.base), (unsigned long long)info.size, (long long)cases[i].base_off,
          (unsigned long long)cases[i].want_size, info.handle_types, info.device, rc ? vmmipc_last_error() : "");
  }
  /* What it is for: the covering range registers. */
  vmmipc_cuda_range_info info;
  VK(vmmipc_cuda_query_range(b.base + gran + 4096, 100, &info));
  vmmipc_options o = options(1);
  vmmipc_ticket t;
  int rc = vmmipc_register_cuda(info.base, info.size, &o, &t);
  check(rc == VMMIPC_OK, "the range it gives registers: %d %s", rc, rc ? vmmipc_last_error() : "");
  if (rc == VMMIPC_OK) VK(vmmipc_unregister(&t));
  range_query q = {.p = b.base + gran};
  CUcontext after;
  rc = without_context(query_page, &q, &after);
  check(rc == VMMIPC_OK && q.info.base == b.base + gran && after == NULL,
        "on a thread with no current context: %d, and the thread still has none (%p)", rc, (void *)after);

  /* Not VMM memory: ENOENT, whatever the reason. */
  CUdeviceptr plain = 0;
  CK(cuMemAlloc(&plain, gran));
  rc = vmmipc_cuda_query_range(plain, 4096, &info);
  check(rc == VMMIPC_ENOENT, "cuMemAlloc memory: %d \"%s\"", rc, vmmipc_last_error());
  CK(cuMemFree(plain));
  void *host = malloc(4096);
  rc = vmmipc_cuda_query_range((uint64_t)(uintptr_t)host, 4096, &info);
  check(rc == VMMIPC_ENOENT, "host memory: %d \"%s\"", rc, vmmipc_last_error());
  free(host);
  rc = vmmipc_cuda_query_range(b.base + b.total + 64 * gran, 4096, &info);
  check(rc == VMMIPC_ENOENT, "an unmapped address: %d \"%s\"", rc, vmmipc_last_error());
  rc = vmmipc_cuda_query_range(b.base + b.total - 4096, 8192, &info);
  check(rc == VMMIPC_ENOENT, "a range whose end is past the mapping: %d \"%s\"", rc, vmmipc_last_error());
  check(vmmipc_cuda_query_range(b.base, 0, &info) == VMMIPC_EINVAL &&
            vmmipc_cuda_query_range(b.base, 4096, NULL) == VMMIPC_EINVAL,
        "size 0 and a NULL info_out are refused with VMMIPC_EINVAL");

  /* An allocation that cannot be exported: handle_types says so. */
  size_t one[] = {gran};
  vbuf none;
  vbuf_alloc(&none, one, 1, CU_MEM_HANDLE_TYPE_NONE);
  rc = vmmipc_cuda_query_range(none.base, gran, &info);
  check(rc == VMMIPC_OK && (info.handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0,
        "an allocation without POSIX-fd export: %d, handle types %#x", rc, info.handle_types);
  vbuf_free(&none);
  vbuf_free(&b);
  check(wait_live_registrations(0, 5), "no registration left behind");
}

static int run_scenario(const char *name) {
  alarm(TIME_LIMIT_S);
  cuda_init();
  CK(cuCtxSetCurrent(primary));
  if (gran != 2 * MIB) note("allocation granularity is %zu bytes, not 2 MiB: chunk sizes scale", gran);
  if (strcmp(name, "data1") == 0) run_data(1);
  else if (strcmp(name, "data3") == 0) run_data(3);
  else if (strcmp(name, "data300") == 0) run_data(300);
  else if (strcmp(name, "data4096") == 0) run_data(4096);
  else if (strcmp(name, "mixed") == 0) run_mixed();
  else if (strcmp(name, "free") == 0) run_free_after_register();
  else if (strcmp(name, "fail-export") == 0) run_failure(FAIL_EXPORT);
  else if (strcmp(name, "fail-import") == 0) run_failure(FAIL_IMPORT);
  else if (strcmp(name, "fail-map") == 0) run_failure(FAIL_MAP);
  else if (strcmp(name, "uses2") == 0) run_two_receivers();
  else if (strcmp(name, "contexts") == 0) run_contexts();
  else if (strcmp(name, "handles") == 0) run_handles();
  else if (strcmp(name, "bad-input") == 0) run_bad_input();
  else if (strcmp(name, "cache") == 0) run_cache();
  else if (strcmp(name, "query-range") == 0) run_query_range();
  else die("unknown scenario %s", name);
  return failed ? 1 : 0;
}

/* The runner: each scenario in its own process; count PASS/FAIL lines. */
static int run_all(int argc, char **argv) {
  static const char *all[] = {"data1", "data3", "data300", "data4096", "mixed", "free", "fail-export",
                              "fail-import", "fail-map", "uses2", "contexts", "handles", "bad-input",
                              "cache", "query-range"};
  int pass = 0, fail = 0;
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
    const char *name = all[i];
    int only = argc < 2;
    for (int a = 1; a < argc; a++) only |= strcmp(argv[a], name) == 0;
    if (!only) continue;
    int p[2];
    if (pipe2(p, O_CLOEXEC)) return 2;
    p[0] = high_fd(p[0]);
    p[1] = high_fd(p[1]);
    const char *args[] = {"scenario", name, NULL};
    set_label("%s", name);
    double t0 = now_s();
    child c = spawn(args, p[1]);
    close(p[1]);
    FILE *in = fdopen(p[0], "r");
    char *ln = NULL;
    size_t cap = 0;
    int f0 = fail;
    while (getline(&ln, &cap, in) > 0) {
      fputs(ln, stdout);
      fflush(stdout);
      pass += strncmp(ln, "PASS ", 5) == 0;
      fail += strncmp(ln, "FAIL ", 5) == 0;
    }
    free(ln);
    fclose(in);
    int st = 0;
    close(c.to);
    close(c.from);
    waitpid(c.pid, &st, 0);
    if (WIFSIGNALED(st) || (WEXITSTATUS(st) != 0 && fail == f0)) {
      printf("FAIL %s: the scenario process ended with %s %d and no FAIL line\n", name,
             WIFSIGNALED(st) ? "signal" : "status", WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
      fail++;
    }
    printf("# %s took %.1f s\n", name, now_s() - t0);
    fflush(stdout);
  }
  printf("%d passed, %d failed\n", pass, fail);
  return fail ? 1 : 0;
}

int main(int argc, char **argv) {
  ssize_t n = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
  if (n <= 0) return 2;
  self_path[n] = '\0';
  if (argc >= 3 && strcmp(argv[1], "scenario") == 0) return run_scenario(argv[2]);
  if (argc >= 3 && strcmp(argv[1], "recv") == 0) {
    alarm(TIME_LIMIT_S);
    const char *lb = arg(argc, argv, "label");
    set_label("%s", lb ? lb : "receiver");
    if (strcmp(argv[2], "verify") == 0) return recv_verify(argc, argv);
    if (strcmp(argv[2], "fail") == 0) return recv_fail(argc, argv);
    if (strcmp(argv[2], "contexts") == 0) return recv_contexts(argc, argv);
    if (strcmp(argv[2], "nodriver") == 0) return recv_nodriver(argc, argv);
    if (strcmp(argv[2], "cache") == 0) return recv_cache(argc, argv);
    die("unknown receiver mode %s", argv[2]);
  }
  return run_all(argc, argv);
}
