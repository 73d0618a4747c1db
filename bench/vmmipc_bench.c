/* vmmipc_bench: how long moving a buffer of N chunks between two processes
 * takes, against the floor, for a first transfer and for a repeated one.
 *
 *   vmmipc_bench [--host | --cuda] --chunks N [--chunk-size BYTES]
 *                [--floor] [--first W,W,...] [--repeated cache|nocache]
 *                [--rounds K] [--repeat R] [--fd-runs F] [--nofile LIMIT]
 *   vmmipc_bench --probe          exit status 0 when a GPU is usable
 *
 * This process is the sender: it creates the buffer (CUDA: N chunks made by
 * cuMemCreate with POSIX-fd handles, mapped contiguously; host: one sealed
 * memfd) and starts each receiver as a separate process (this program
 * again, through posix_spawn, with a control socket on its descriptor 3;
 * tickets cross that socket, never the command line). It prints one JSON
 * object per measurement on stdout:
 *
 *   {"approach":"floor", ...}  no transport: exporting all N chunks in one
 *       thread (sender), then importing, mapping and setting access for N
 *       already-received descriptors in one thread (receiver; host memory:
 *       mmap of each); floor_ms = export_ms + import_ms. Also the driver's
 *       serialization: the receiver's import again while the sender exports
 *       concurrently, and exporting from 8 threads. --repeat R times.
 *   {"approach":"first","window":W, ...}  a fresh receiver process's
 *       vmmipc_import_stream, from call to return, of a registration made
 *       before (uses = 1; window 0 = the library's default).
 *   {"approach":"repeated","cache":true|false,"round":k, ...}  one receiver
 *       process imports the same buffer 1 + K times. The sender keeps one
 *       anchor registration (uses = 0) and makes a new ticket for every
 *       round with vmmipc_register_again (uses = 1). Each round: the sender
 *       writes a fresh byte into the buffer, sends the ticket, the receiver
 *       imports (timed), checks the markers and that byte, and unmaps. With
 *       the cache, round 0 maps anew and rounds 1..K must be cache hits
 *       (vmmipc_cache_get_info says so, or the row is marked failed); with
 *       VMMIPC_IMPORT_NO_CACHE every round is a full import.
 *
 * Each --first window and each --repeated session runs F times with a
 * thread in each process sampling /proc/self/fd (the peak extra descriptors
 * of both sides, "sampled":true) and R times without it (the times; the
 * sampler spins on a core in each process). VMMIPC_BENCH_SCHEDULE=label
 * names the library configuration being measured (bench/run.sh sets it with
 * the schedule variables it passes to the library); it is copied into every
 * row. VMMIPC_LIBCUDA (the timing shim) marks rows "profiled". --nofile sets
 * the receivers' soft RLIMIT_NOFILE (the limit runs). */
#define _GNU_SOURCE
#include <math.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "../tests/c/testutil.h"
#include "../tests/c/cuda_dlopen.h"

static int use_cuda = -1;
static const char *schedule = ""; /* VMMIPC_BENCH_SCHEDULE */
static int profiled;              /* the driver is the timing shim */
static uint64_t nchunks = 64, chunk_size = 0;
static rlim_t recv_nofile;

/* marker is the byte every chunk i starts with, checked by receivers. */
static unsigned char marker(uint64_t i) { return (unsigned char)(i * 7 + 1); }

static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "vmmipc_bench: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  exit(1);
}

/* json_escape copies s into out as the inside of a JSON string. */
static const char *json_escape(const char *s, char *out, size_t n) {
  size_t j = 0;
  for (; *s && j + 7 < n; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') out[j++] = '\\', out[j++] = (char)c;
    else if (c < 0x20) j += (size_t)snprintf(out + j, n - j, "\\u%04x", c);
    else out[j++] = (char)c;
  }
  out[j] = 0;
  return out;
}

/* json_number reads the number after "key": in a flat JSON object (the
 * receiver's replies); NAN when absent. */
static double json_number(const char *obj, const char *key) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *p = strstr(obj, pat);
  return p ? strtod(p + strlen(pat), NULL) : NAN;
}

/* fds_json writes a peak descriptor count, or null when not sampled. */
static const char *fds_json(int peak, char *out, size_t n) {
  if (peak < 0) snprintf(out, n, "null");
  else snprintf(out, n, "%d", peak);
  return out;
}

/* ---- control channel: lines and descriptor batches over a socketpair ---- */

static int ctl_write(int s, const char *line) {
  size_t n = strlen(line);
  while (n) {
    ssize_t w = send(s, line, n, MSG_NOSIGNAL);
    if (w <= 0) return -1;
    line += w, n -= (size_t)w;
  }
  return 0;
}

/* ctl_read reads one line (without the newline), byte by byte: the channel
 * carries little, and descriptors must not be read past. */
static int ctl_read(int s, char *buf, size_t n) {
  size_t j = 0;
  while (j + 1 < n) {
    char c;
    ssize_t r = recv(s, &c, 1, 0);
    if (r <= 0) return -1;
    if (c == '\n') break;
    buf[j++] = c;
  }
  buf[j] = 0;
  return 0;
}

#define FD_BATCH 250 /* SCM_RIGHTS carries at most 253 per message */

static int send_fds(int s, const int *fds, int n) {
  char one = 'F';
  struct iovec iov = {&one, 1};
  union { char buf[CMSG_SPACE(FD_BATCH * sizeof(int))]; struct cmsghdr align; } u;
  struct msghdr m = {0};
  m.msg_iov = &iov, m.msg_iovlen = 1;
  m.msg_control = u.buf, m.msg_controllen = CMSG_SPACE(n * sizeof(int));
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_RIGHTS, c->cmsg_len = CMSG_LEN(n * sizeof(int));
  memcpy(CMSG_DATA(c), fds, n * sizeof(int));
  return sendmsg(s, &m, MSG_NOSIGNAL) == 1 ? 0 : -1;
}

static int recv_fds(int s, int *fds, int want) {
  char one;
  struct iovec iov = {&one, 1};
  union { char buf[CMSG_SPACE(FD_BATCH * sizeof(int))]; struct cmsghdr align; } u;
  struct msghdr m = {0};
  m.msg_iov = &iov, m.msg_iovlen = 1;
  m.msg_control = u.buf, m.msg_controllen = sizeof u.buf;
  if (recvmsg(s, &m, MSG_CMSG_CLOEXEC) != 1 || (m.msg_flags & MSG_CTRUNC)) return -1;
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  if (!c || c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(want * sizeof(int))) return -1;
  memcpy(fds, CMSG_DATA(c), want * sizeof(int));
  return 0;
}

/* ---- the sender's buffer ---- */

static CUmemGenericAllocationHandle *handles; /* CUDA: one per chunk */
static CUdeviceptr dbase;                     /* CUDA: the mapped buffer */
static int memfd = -1;                        /* host: the whole buffer */
static size_t gran;

static void cuda_check(CUresult r, const char *what, uint64_t i) {
  if (r) die("chunk %llu: %s: %s", (unsigned long long)i, what, cu_err(r));
}

static CUmemAllocationProp device_prop(void) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = 1, p.requestedHandleTypes = BCU_POSIX_FD, p.location.type = 1, p.location.id = 0;
  return p;
}

static void make_buffer(void) {
  uint64_t total = nchunks * chunk_size;
  if (!use_cuda) {
    /* Sparse: only the marker pages are ever touched, so an 8 GiB buffer
     * costs a few MiB of memory. */
    memfd = memfd_create("vmmipc-bench", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (memfd < 0 || ftruncate(memfd, (off_t)total)) die("memfd of %llu bytes: %s", (unsigned long long)total, strerror(errno));
    for (uint64_t i = 0; i < nchunks; i++) {
      unsigned char b = marker(i);
      if (pwrite(memfd, &b, 1, (off_t)(i * chunk_size)) != 1) die("pwrite: %s", strerror(errno));
    }
    if (fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK)) die("sealing the memfd: %s", strerror(errno));
    return;
  }
  CUmemAllocationProp p = device_prop();
  cuda_check(cu.Granularity(&gran, &p, 0), "cuMemGetAllocationGranularity", 0);
  if (chunk_size % gran) die("chunk size %llu is not a multiple of the granularity %zu", (unsigned long long)chunk_size, gran);
  cuda_check(cu.AddressReserve(&dbase, total, gran, 0, 0), "cuMemAddressReserve", 0);
  handles = calloc(nchunks, sizeof *handles);
  for (uint64_t i = 0; i < nchunks; i++) {
    cuda_check(cu.MemCreate(&handles[i], chunk_size, &p, 0), "cuMemCreate", i);
    cuda_check(cu.MemMap(dbase + i * chunk_size, chunk_size, 0, handles[i], 0), "cuMemMap", i);
  }
  CUmemAccessDesc acc = {{1, 0}, BCU_PROT_READWRITE};
  cuda_check(cu.SetAccess(dbase, total, &acc, 1), "cuMemSetAccess", 0);
  for (uint64_t i = 0; i < nchunks; i++)
    cuda_check(cu.MemsetD8(dbase + i * chunk_size, marker(i), chunk_size), "cuMemsetD8", i);
  cuda_check(cu.CtxSynchronize(), "cuCtxSynchronize", 0);
}

/* The round byte: the second byte of the last chunk, rewritten by the sender
 * before every repeated round, so that a receiver proves it maps the live
 * memory (the sender's in-place writes), not a stale copy. */
static uint64_t round_byte_offset(void) { return (nchunks - 1) * chunk_size + 1; }

static void write_round_byte(unsigned char b) {
  if (!use_cuda) {
    if (pwrite(memfd, &b, 1, (off_t)round_byte_offset()) != 1) die("pwrite: %s", strerror(errno));
    return;
  }
  cuda_check(cu.HtoD(dbase + round_byte_offset(), &b, 1), "cuMemcpyHtoD", nchunks - 1);
}

/* export_chunk returns a new descriptor for chunk i (the floor's export). */
static int export_chunk(uint64_t i) {
  if (!use_cuda) {
    int fd = fcntl(memfd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) die("chunk %llu: dup: %s", (unsigned long long)i, strerror(errno));
    return fd;
  }
  int fd = -1;
  cuda_check(cu.Export(&fd, handles[i], BCU_POSIX_FD, 0), "cuMemExportToShareableHandle", i);
  return fd;
}

/* ---- the receiver's floor: import, map, set access; no transport ---- */

typedef struct import_times {
  double import_ms, map_ms, access_ms, total_ms;
} import_times;

static double elapsed(double *t) {
  double n = now_ms(), d = n - *t;
  *t = n;
  return d;
}

/* import_all maps the N descriptors into one reserved range and returns the
 * range's base; the descriptors stay open (the caller closes them). */
static uint64_t import_all(const int *fds, import_times *it) {
  uint64_t total = nchunks * chunk_size;
  memset(it, 0, sizeof *it);
  double start = now_ms(), t = start;
  if (!use_cuda) {
    unsigned char *base = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) die("reserve: %s", strerror(errno));
    for (uint64_t i = 0; i < nchunks; i++) {
      struct stat st;
      if (fstat(fds[i], &st)) die("fstat: %s", strerror(errno));
      it->import_ms += elapsed(&t);
      if (mmap(base + i * chunk_size, chunk_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fds[i],
               (off_t)(i * chunk_size)) == MAP_FAILED)
        die("mmap: %s", strerror(errno));
      it->map_ms += elapsed(&t);
    }
    it->total_ms = now_ms() - start;
    return (uint64_t)(uintptr_t)base;
  }
  CUdeviceptr base;
  cuda_check(cu.AddressReserve(&base, total, gran, 0, 0), "cuMemAddressReserve", 0);
  t = now_ms();
  for (uint64_t i = 0; i < nchunks; i++) {
    CUmemGenericAllocationHandle h;
    cuda_check(cu.Import(&h, (void *)(uintptr_t)fds[i], BCU_POSIX_FD), "cuMemImportFromShareableHandle", i);
    it->import_ms += elapsed(&t);
    cuda_check(cu.MemMap(base + i * chunk_size, chunk_size, 0, h, 0), "cuMemMap", i);
    cuda_check(cu.MemRelease(h), "cuMemRelease", i);
    it->map_ms += elapsed(&t);
  }
  CUmemAccessDesc acc = {{1, 0}, BCU_PROT_READWRITE};
  cuda_check(cu.SetAccess(base, total, &acc, 1), "cuMemSetAccess", 0);
  it->access_ms = elapsed(&t);
  it->total_ms = now_ms() - start;
  return base;
}

static void unmap_all(uint64_t base) {
  uint64_t total = nchunks * chunk_size;
  if (!use_cuda) {
    munmap((void *)(uintptr_t)base, total);
    return;
  }
  for (uint64_t i = 0; i < nchunks; i++) cuda_check(cu.MemUnmap(base + i * chunk_size, chunk_size), "cuMemUnmap", i);
  cuda_check(cu.AddressFree(base, total), "cuMemAddressFree", 0);
}

static int read_byte(uint64_t at, unsigned char *b) {
  if (use_cuda) return cu.DtoH(b, at, 1) ? -1 : 0;
  *b = *(unsigned char *)(uintptr_t)at;
  return 0;
}

/* check_markers reads back the first byte of a few chunks. */
static int check_markers(uint64_t base) {
  uint64_t idx[] = {0, nchunks / 2, nchunks - 1};
  for (int k = 0; k < 3; k++) {
    unsigned char b = 0;
    if (read_byte(base + idx[k] * chunk_size, &b) || b != marker(idx[k])) return -1;
  }
  return 0;
}

static void receiver_setup(void) {
  if (recv_nofile) {
    set_nofile(recv_nofile);
  } else { /* the floor holds N descriptors at once: allow what the hard limit allows */
    struct rlimit r;
    getrlimit(RLIMIT_NOFILE, &r);
    r.rlim_cur = r.rlim_max;
    setrlimit(RLIMIT_NOFILE, &r);
  }
  if (use_cuda && (!cuda_load() || cuda_use_device(0))) die("receiver: CUDA unavailable");
  if (use_cuda) {
    CUmemAllocationProp p = device_prop();
    cuda_check(cu.Granularity(&gran, &p, 0), "cuMemGetAllocationGranularity", 0);
  }
}

/* recv_floor: the receiver of the floor measurement (control socket on 3). */
static int recv_floor(void) {
  const int s = 3;
  receiver_setup();
  int base_fds = count_fds(0);
  int *fds = malloc(nchunks * sizeof *fds);
  for (uint64_t got = 0; got < nchunks; got += FD_BATCH) {
    int n = nchunks - got < FD_BATCH ? (int)(nchunks - got) : FD_BATCH;
    if (recv_fds(s, fds + got, n)) die("receiver: receiving descriptors %llu..: %s", (unsigned long long)got, strerror(errno));
  }
  int held = count_fds(0) - base_fds;
  import_times alone, busy;
  uint64_t base = import_all(fds, &alone);
  int ok = check_markers(base) == 0;
  double t = now_ms();
  unmap_all(base);
  double unmap_ms = now_ms() - t;
  /* The same import while the sender process exports: the driver's
   * serialization across processes. */
  char line[256];
  if (ctl_write(s, "go\n") || ctl_read(s, line, sizeof line)) die("receiver: control channel");
  base = import_all(fds, &busy);
  if (ctl_write(s, "stop\n")) die("receiver: control channel");
  unmap_all(base);
  for (uint64_t i = 0; i < nchunks; i++) close(fds[i]);
  free(fds);
  char out[1024];
  snprintf(out, sizeof out,
           "{\"ok\":%s,\"import_ms\":%.3f,\"import_only_ms\":%.3f,\"map_release_ms\":%.3f,\"set_access_ms\":%.3f,"
           "\"unmap_ms\":%.3f,\"held_fds\":%d,\"contended_import_ms\":%.3f,\"contended_import_only_ms\":%.3f}\n",
           ok ? "true" : "false", alone.total_ms, alone.import_ms, alone.map_ms, alone.access_ms, unmap_ms, held,
           busy.total_ms, busy.import_ms);
  return ctl_write(s, out);
}

/* recv_imports: the receiver of libvmmipc transfers (control socket on 3).
 * For each line "import HEX WINDOW FLAGS ROUNDBYTE" it imports the ticket,
 * checks what it mapped, unmaps, and answers one JSON object; it exits at
 * "end" or when the sender goes away. */
static int recv_imports(int sampling) {
  const int s = 3;
  receiver_setup();
  char line[1024];
  while (ctl_read(s, line, sizeof line) == 0 && strncmp(line, "import ", 7) == 0) {
    char hex[2 * VMMIPC_TICKET_SIZE + 1];
    unsigned window, flags, round_byte;
    vmmipc_ticket t;
    if (sscanf(line + 7, "%512s %u %u %u", hex, &window, &flags, &round_byte) != 4 ||
        hex_decode(hex, t.bytes, sizeof t.bytes))
      die("receiver: bad import line");
    vmmipc_options o;
    vmmipc_options_init(&o, sizeof o);
    o.window = window;
    o.import_flags = flags;
    vmmipc_cache_info before, after;
    vmmipc_cache_get_info(&before, sizeof before);
    int base_fds = count_fds(0);
    fd_sampler fs;
    if (sampling) fd_sampler_start(&fs, 0);
    vmmipc_mapping m;
    double t0 = now_ms();
    int rc = vmmipc_import_stream(&t, use_cuda ? VMMIPC_DEVICE_SAME : VMMIPC_DEVICE_HOST, &o, &m);
    double ms = now_ms() - t0;
    int peak = sampling ? fd_sampler_stop(&fs) - base_fds : -1;
    vmmipc_cache_get_info(&after, sizeof after);
    char err[768] = "", out[1536], pk[16];
    int ok = rc == 0;
    double unmap_ms = 0;
    if (ok) {
      unsigned char b = 0;
      if (check_markers(m.addr)) {
        ok = 0;
        snprintf(err, sizeof err, "the mapped chunks do not hold the sender's markers");
      } else if (read_byte(m.addr + round_byte_offset(), &b) || b != round_byte) {
        ok = 0;
        snprintf(err, sizeof err, "the mapping does not show the sender's latest write (byte %u, want %u)", b, round_byte);
      }
      double u = now_ms();
      int urc = vmmipc_unmap(&m);
      unmap_ms = now_ms() - u;
      if (urc) ok = 0, json_escape(vmmipc_last_error(), err, sizeof err);
    } else {
      char msg[600];
      snprintf(msg, sizeof msg, "%s: %s", vmmipc_strerror(rc), vmmipc_last_error());
      json_escape(msg, err, sizeof err);
    }
    snprintf(out, sizeof out,
             "{\"ok\":%s,\"ms\":%.3f,\"peak_fds_receiver\":%s,\"unmap_ms\":%.3f,\"cache_hits\":%llu,"
             "\"cache_misses\":%llu,\"cache_entries\":%llu,\"cache_unreferenced_bytes\":%llu,\"error\":\"%s\"}\n",
             ok ? "true" : "false", ms, fds_json(peak, pk, sizeof pk), unmap_ms,
             (unsigned long long)(after.hits - before.hits), (unsigned long long)(after.misses - before.misses),
             (unsigned long long)after.entries, (unsigned long long)after.unreferenced_bytes, err);
    if (ctl_write(s, out)) return 1;
  }
  return 0;
}

/* ---- the sender ---- */

static void make_ctl(int sv[2]) {
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) die("socketpair: %s", strerror(errno));
}

/* spawn_receiver starts this program as a receiver with a control socket
 * on its descriptor 3 (sv[1], closed here); sv[0] stays ours. */
static pid_t spawn_receiver(char **extra, int sv[2]) {
  char n[32], cs[32], nf[32];
  snprintf(n, sizeof n, "%llu", (unsigned long long)nchunks);
  snprintf(cs, sizeof cs, "%llu", (unsigned long long)chunk_size);
  snprintf(nf, sizeof nf, "%llu", (unsigned long long)recv_nofile);
  char *argv[16] = {"vmmipc_bench", use_cuda ? "--cuda" : "--host", "--chunks", n, "--chunk-size", cs, "--nofile", nf};
  int a = 8;
  for (int i = 0; extra[i]; i++) argv[a++] = extra[i];
  argv[a] = NULL;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, sv[1], 3);
  pid_t pid;
  if (posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, environ)) die("posix_spawn: %s", strerror(errno));
  posix_spawn_file_actions_destroy(&fa);
  close(sv[1]);
  return pid;
}

/* export_threads exports every chunk from `threads` threads at once. */
typedef struct { uint64_t from, to; int *fds; } export_slice;
static void *export_slice_run(void *arg) {
  export_slice *sl = arg;
  for (uint64_t i = sl->from; i < sl->to; i++) sl->fds[i] = export_chunk(i);
  return NULL;
}
static double export_threads(int threads) {
  int *fds = malloc(nchunks * sizeof *fds);
  pthread_t th[64];
  export_slice sl[64];
  double t0 = now_ms();
  for (int k = 0; k < threads; k++) {
    sl[k] = (export_slice){nchunks * k / threads, nchunks * (k + 1) / threads, fds};
    pthread_create(&th[k], NULL, export_slice_run, &sl[k]);
  }
  for (int k = 0; k < threads; k++) pthread_join(th[k], NULL);
  double ms = now_ms() - t0;
  for (uint64_t i = 0; i < nchunks; i++) close(fds[i]);
  free(fds);
  return ms;
}

static const char *memory_name(void) { return use_cuda ? "cuda" : "host"; }

static void run_floor(void) {
  int base_fds = count_fds(0);
  int *fds = malloc(nchunks * sizeof *fds);
  double t0 = now_ms();
  for (uint64_t i = 0; i < nchunks; i++) fds[i] = export_chunk(i);
  double export_ms = now_ms() - t0;
  int held = count_fds(0) - base_fds;
  int sv[2];
  make_ctl(sv);
  int ctl = sv[0];
  char *extra[] = {"--recv-floor", NULL};
  pid_t pid = spawn_receiver(extra, sv);
  for (uint64_t sent = 0; sent < nchunks; sent += FD_BATCH) {
    int n = nchunks - sent < FD_BATCH ? (int)(nchunks - sent) : FD_BATCH;
    if (send_fds(ctl, fds + sent, n)) die("sending descriptors: %s", strerror(errno));
    for (int k = 0; k < n; k++) close(fds[sent + k]);
  }
  free(fds);
  char line[1024];
  if (ctl_read(ctl, line, sizeof line) || strcmp(line, "go")) die("floor receiver: expected go, got '%s'", line);
  /* Export (and close) in a loop while the receiver imports. */
  if (ctl_write(ctl, "started\n")) die("control channel");
  struct pollfd p = {ctl, POLLIN, 0};
  uint64_t exported = 0;
  t0 = now_ms();
  for (;;) {
    close(export_chunk(exported % nchunks));
    exported++;
    if (exported % 16 == 0 && poll(&p, 1, 0) == 1) break;
  }
  double busy_export_ms = now_ms() - t0;
  if (ctl_read(ctl, line, sizeof line) || strcmp(line, "stop")) die("floor receiver: expected stop, got '%s'", line);
  char result[1024];
  if (ctl_read(ctl, result, sizeof result)) die("floor receiver: no result");
  int st;
  waitpid(pid, &st, 0);
  close(ctl);
  double threads1 = export_threads(1), threads8 = export_threads(8);
  double import_ms = json_number(result, "import_ms");
  result[strlen(result) - 1] = 0; /* drop the closing brace: merged into ours */
  printf("{\"approach\":\"floor\",\"memory\":\"%s\",\"N\":%llu,\"chunk_size\":%llu,\"export_ms\":%.3f,"
         "\"export_held_fds\":%d,\"floor_ms\":%.3f,\"us_per_chunk\":%.3f,"
         "\"contended_export_us_per_chunk\":%.3f,\"export_1thread_ms\":%.3f,\"export_8threads_ms\":%.3f,%s}\n",
         memory_name(), (unsigned long long)nchunks, (unsigned long long)chunk_size, export_ms, held,
         export_ms + import_ms, (export_ms + import_ms) * 1e3 / nchunks, busy_export_ms * 1e3 / exported, threads1,
         threads8, result + 1);
  fflush(stdout);
}

static void check_rc(int rc, const char *what) {
  if (rc) die("%s: %s: %s", what, vmmipc_strerror(rc), vmmipc_last_error());
}

static void register_buffer(uint32_t uses, vmmipc_ticket *t) {
  vmmipc_options o;
  vmmipc_options_init(&o, sizeof o);
  o.uses = uses;
  check_rc(use_cuda ? vmmipc_register_cuda(dbase, nchunks * chunk_size, &o, t)
                    : vmmipc_register_host_file(memfd, nchunks * chunk_size, chunk_size, NULL, NULL, &o, t),
           "register");
}

/* A session: one receiver process, 1 + rounds imports of the same buffer.
 * repeated = 0: one import of a registration with uses = 1 (a first
 * transfer); repeated = 1: an anchor with uses = 0 and a register_again
 * ticket per round. */
typedef struct session {
  int repeated;
  uint32_t window, flags, rounds;
  int sampling;
} session;

static void run_session(const session *ss) {
  vmmipc_ticket anchor;
  register_buffer(ss->repeated ? 0 : 1, &anchor);
  int sv[2];
  make_ctl(sv);
  int ctl = sv[0];
  char *extra[] = {"--recv-imports", ss->sampling ? "1" : "0", NULL};
  pid_t pid = spawn_receiver(extra, sv);
  for (uint32_t round = 0; round <= ss->rounds; round++) {
    vmmipc_ticket t = anchor;
    double register_ms = 0;
    if (ss->repeated) {
      vmmipc_options o;
      vmmipc_options_init(&o, sizeof o);
      o.uses = 1;
      double t0 = now_ms();
      check_rc(vmmipc_register_again(&anchor, NULL, NULL, &o, &t), "vmmipc_register_again");
      register_ms = now_ms() - t0;
    }
    unsigned char round_byte = (unsigned char)(0xA0 + round);
    write_round_byte(round_byte);
    char hex[2 * VMMIPC_TICKET_SIZE + 1], line[640], reply[2048], pk[16];
    hex_encode(t.bytes, sizeof t.bytes, hex);
    snprintf(line, sizeof line, "import %s %u %u %u\n", hex, ss->window, ss->flags, round_byte);
    int base_fds = count_fds(0);
    fd_sampler fs;
    if (ss->sampling) fd_sampler_start(&fs, 0);
    int got = ctl_write(ctl, line) == 0 && ctl_read(ctl, reply, sizeof reply) == 0 && reply[0] == '{';
    int peak = ss->sampling ? fd_sampler_stop(&fs) - base_fds : -1;
    if (!got) {
      int st = 0;
      waitpid(pid, &st, 0);
      pid = -1;
      snprintf(reply, sizeof reply, "{\"ok\":false,\"error\":\"the receiver exited (wait status %d) before answering\"}", st);
    }
    /* A repeated round must be what it claims: with the cache, round 0 maps
     * anew and every later round is a hit; without it, nothing is a hit. */
    const char *wrong = NULL;
    double hits = json_number(reply, "cache_hits"), misses = json_number(reply, "cache_misses");
    if (got && !strncmp(reply, "{\"ok\":true,", 11) && ss->repeated) {
      int want_hit = !(ss->flags & VMMIPC_IMPORT_NO_CACHE) && round > 0;
      if (want_hit && !(hits == 1 && misses == 0)) wrong = "expected a cache hit, but the receiver mapped anew";
      if (!want_hit && hits != 0) wrong = "expected a full import, but the receiver's cache answered";
    }
    char head[768];
    int h = snprintf(head, sizeof head,
                     "{\"approach\":\"%s\",\"schedule\":\"%s\",\"profiled\":%s,\"sampled\":%s,\"memory\":\"%s\","
                     "\"N\":%llu,\"chunk_size\":%llu,\"window\":%u,\"nofile\":%llu,\"peak_fds_sender\":%s,",
                     ss->repeated ? "repeated" : "first", schedule, profiled ? "true" : "false",
                     ss->sampling ? "true" : "false", memory_name(), (unsigned long long)nchunks,
                     (unsigned long long)chunk_size, ss->window, (unsigned long long)recv_nofile,
                     fds_json(peak, pk, sizeof pk));
    if (ss->repeated)
      snprintf(head + h, sizeof head - h, "\"cache\":%s,\"round\":%u,\"register_ms\":%.4f,",
               ss->flags & VMMIPC_IMPORT_NO_CACHE ? "false" : "true", round, register_ms);
    if (wrong) {
      /* The receiver's object starts {"ok":true, and ends ,"error":""}:
       * keep what lies between, and say what was wrong. */
      char *mid = reply + strlen("{\"ok\":true,"), *tail = strstr(reply, ",\"error\":");
      if (tail) *tail = 0;
      printf("%s\"ok\":false,%s,\"error\":\"%s\"}\n", head, mid, wrong);
    } else {
      printf("%s%s\n", head, reply + 1); /* the receiver's fields, merged into ours */
    }
    fflush(stdout);
    if (!got) break;
  }
  if (pid > 0) {
    ctl_write(ctl, "end\n");
    waitpid(pid, NULL, 0);
  }
  close(ctl);
  /* Ends the anchor (or a first transfer's registration that a failed
   * receiver left unused; VMMIPC_ENOENT once used up) and waits until the
   * library holds nothing of it, so the next session starts clean. */
  vmmipc_unregister(&anchor);
  vmmipc_wait(&anchor, 10000);
}

/* for_each_number calls fn for each value of a comma-separated list. */
static void for_each_number(const char *list, void (*fn)(uint32_t, void *), void *arg) {
  for (const char *w = list; w && *w;) {
    fn((uint32_t)strtoul(w, NULL, 10), arg);
    w = strchr(w, ',');
    if (w) w++;
  }
}

typedef struct { int fd_runs, repeat; } run_counts;

static void run_first(uint32_t window, void *arg) {
  run_counts *rc = arg;
  for (int k = 0; k < rc->fd_runs + rc->repeat; k++) {
    session ss = {0, window, 0, 0, k < rc->fd_runs};
    run_session(&ss);
  }
}

int main(int argc, char **argv) {
  static char schedule_json[128];
  if (getenv("VMMIPC_BENCH_SCHEDULE")) schedule = json_escape(getenv("VMMIPC_BENCH_SCHEDULE"), schedule_json, sizeof schedule_json);
  profiled = getenv("VMMIPC_LIBCUDA") != NULL;
  const char *first = NULL, *repeated = NULL;
  int floor = 0;
  uint32_t rounds = 3;
  run_counts counts = {1, 1};
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--host")) use_cuda = 0;
    else if (!strcmp(argv[i], "--cuda")) use_cuda = 1;
    else if (!strcmp(argv[i], "--chunks") && i + 1 < argc) nchunks = strtoull(argv[++i], 0, 0);
    else if (!strcmp(argv[i], "--chunk-size") && i + 1 < argc) chunk_size = strtoull(argv[++i], 0, 0);
    else if (!strcmp(argv[i], "--floor")) floor = 1;
    else if (!strcmp(argv[i], "--first") && i + 1 < argc) first = argv[++i];
    else if (!strcmp(argv[i], "--repeated") && i + 1 < argc) repeated = argv[++i];
    else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = (uint32_t)strtoul(argv[++i], 0, 0);
    else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) counts.repeat = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--fd-runs") && i + 1 < argc) counts.fd_runs = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--nofile") && i + 1 < argc) recv_nofile = strtoull(argv[++i], 0, 0);
    else if (!strcmp(argv[i], "--probe")) return !cuda_load(); /* 0: a GPU is usable */
    else if (!strcmp(argv[i], "--recv-floor")) return recv_floor();
    else if (!strcmp(argv[i], "--recv-imports") && i + 1 < argc) return recv_imports(atoi(argv[i + 1]));
    else
      die("usage: vmmipc_bench [--host|--cuda] --chunks N [--chunk-size B] [--floor] [--first W,W] "
          "[--repeated cache|nocache] [--rounds K] [--repeat R] [--fd-runs F] [--nofile L] | --probe");
  }
  if (repeated && strcmp(repeated, "cache") && strcmp(repeated, "nocache"))
    die("--repeated takes cache or nocache, not '%s'", repeated);
  if (!floor && !first && !repeated) die("nothing to measure: give --floor, --first or --repeated");
  int have_gpu = use_cuda != 0 && cuda_load();
  if (use_cuda == 1 && !have_gpu) die("--cuda: no CUDA driver or device");
  use_cuda = have_gpu;
  if (!chunk_size) chunk_size = 2 << 20;
  if (nchunks == 0) die("--chunks must be positive");
  if (use_cuda && cuda_use_device(0)) die("cannot use CUDA device 0");
  struct rlimit r; /* the sender holds N descriptors during the floor */
  getrlimit(RLIMIT_NOFILE, &r);
  r.rlim_cur = r.rlim_max;
  setrlimit(RLIMIT_NOFILE, &r);
  double t0 = now_ms();
  make_buffer();
  fprintf(stderr, "vmmipc_bench: %s buffer of %llu x %llu bytes made in %.0f ms\n", use_cuda ? "CUDA" : "host",
          (unsigned long long)nchunks, (unsigned long long)chunk_size, now_ms() - t0);
  for (int k = 0; floor && k < counts.repeat; k++) run_floor();
  for_each_number(first, run_first, &counts);
  for (int k = 0; repeated && k < counts.fd_runs + counts.repeat; k++) {
    session ss = {1, 0, strcmp(repeated, "nocache") ? 0 : VMMIPC_IMPORT_NO_CACHE, rounds, k < counts.fd_runs};
    run_session(&ss);
  }
  return 0;
}
