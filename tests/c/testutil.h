/* Small helpers shared by the C tests: checks, descriptor counting, a
 * peak-descriptor sampler, and spawning this binary in another role. The
 * library does not survive fork(), so children are started with posix_spawn
 * (fork+exec), never by forking and calling the library. */
#ifndef VMMIPC_TESTUTIL_H
#define VMMIPC_TESTUTIL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
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

#include <vmmipc.h>

extern char **environ;

/* CHECK fails the current test (returns 1 from it) with a message. */
#define CHECK(cond, ...)                                                        \
  do {                                                                          \
    if (!(cond)) {                                                              \
      fprintf(stderr, "  %s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                             \
      fprintf(stderr, "\n");                                                    \
      return 1;                                                                 \
    }                                                                           \
  } while (0)

/* CHECK_RC checks a libvmmipc status and prints the library's detail. */
#define CHECK_RC(call, want)                                                    \
  do {                                                                          \
    int rc_ = (call);                                                           \
    CHECK(rc_ == (want), "%s returned %d (%s), want %d; last error: %s", #call, \
          rc_, vmmipc_strerror(rc_), (want), vmmipc_last_error());              \
  } while (0)

/* CHECK_SAYS checks that call returned status want and that its message
 * holds says and not not_says (NULL: anything else goes). */
static inline int message_lacks(const char *msg, const char *not_says) {
  return !not_says || !strstr(msg, not_says);
}
#define CHECK_SAYS(call, want, says, not_says)                                                             \
  do {                                                                                                     \
    int rc_ = (call);                                                                                      \
    const char *e_ = vmmipc_last_error(), *not_ = (not_says);                                              \
    CHECK(rc_ == (want) && strstr(e_, (says)) && message_lacks(e_, not_),                                  \
          "%s returned %d (%s), want %d saying \"%s\"%s%s: %s", #call, rc_, vmmipc_strerror(rc_), (want), \
          (says), not_ ? " and not " : "", not_ ? not_ : "", e_);                                          \
    printf("  %-14.*s -> %s\n", (int)strcspn(vmmipc_strerror(rc_), ":"), vmmipc_strerror(rc_), e_);      \
  } while (0)

static inline double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* count_fds counts the open descriptors of pid (0 = self), not counting the
 * one used to read the directory. */
static inline int count_fds(pid_t pid) {
  char path[64];
  if (pid)
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  else
    snprintf(path, sizeof path, "/proc/self/fd");
  DIR *d = opendir(path);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return pid ? n : n - 1;
}

/* A thread that samples a process's descriptor count until stopped. */
typedef struct fd_sampler {
  pthread_t thread;
  pid_t pid;
  volatile int stop;
  int peak;
  long samples;
} fd_sampler;

static void *fd_sampler_run(void *arg) {
  fd_sampler *s = arg;
  while (!s->stop) {
    int n = count_fds(s->pid);
    /* Counting self opens one descriptor for the directory; count_fds
     * subtracts it, but the sampler's own read is in flight while other
     * threads work, so it never shows up as extra. */
    if (n > s->peak) s->peak = n;
    s->samples++;
  }
  return NULL;
}

static inline void fd_sampler_start(fd_sampler *s, pid_t pid) {
  memset(s, 0, sizeof *s);
  s->pid = pid;
  s->peak = count_fds(pid);
  pthread_create(&s->thread, NULL, fd_sampler_run, s);
}

static inline int fd_sampler_stop(fd_sampler *s) {
  s->stop = 1;
  pthread_join(s->thread, NULL);
  return s->peak;
}

/* default_options is a vmmipc_options as vmmipc_options_init leaves it. */
static inline vmmipc_options default_options(void) {
  vmmipc_options o;
  vmmipc_options_init(&o, sizeof o);
  return o;
}

/* set_nofile sets the soft RLIMIT_NOFILE and returns the old soft limit. */
static inline rlim_t set_nofile(rlim_t soft) {
  struct rlimit r;
  getrlimit(RLIMIT_NOFILE, &r);
  rlim_t old = r.rlim_cur;
  r.rlim_cur = soft;
  setrlimit(RLIMIT_NOFILE, &r);
  return old;
}

/* A child process of this binary, with pipes to its stdin and stdout. */
typedef struct child {
  pid_t pid;
  FILE *in;  /* we write its stdin */
  FILE *out; /* we read its stdout */
} child;

/* How to start a child: its environment (NULL: ours) and whether its stderr
 * goes into the same pipe as its stdout (to read a Go "fatal error"). */
typedef struct child_opts {
  char *const *envp;
  int merge_stderr;
} child_opts;

/* child_spawn_with starts path (argv) with pipes to its stdin/stdout. */
static inline int child_spawn_with(child *c, const char *path, char *const argv[], const child_opts *o) {
  int to[2], from[2];
  if (pipe2(to, O_CLOEXEC)) return -1;
  if (pipe2(from, O_CLOEXEC)) {
    close(to[0]);
    close(to[1]);
    return -1;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, to[0], 0);
  posix_spawn_file_actions_adddup2(&fa, from[1], 1);
  if (o && o->merge_stderr) posix_spawn_file_actions_adddup2(&fa, from[1], 2);
  int rc = posix_spawn(&c->pid, path, &fa, NULL, argv, o && o->envp ? o->envp : environ);
  posix_spawn_file_actions_destroy(&fa);
  close(to[0]);
  close(from[1]);
  if (rc) {
    close(to[1]);
    close(from[0]);
    return -1;
  }
  c->in = fdopen(to[1], "w");
  c->out = fdopen(from[0], "r");
  setvbuf(c->in, NULL, _IOLBF, 0);
  return 0;
}

static inline int child_spawn_path(child *c, const char *path, char *const argv[]) {
  return child_spawn_with(c, path, argv, NULL);
}

/* child_spawn starts this binary (argv[1] names its role). */
static inline int child_spawn(child *c, char *const argv[]) {
  return child_spawn_path(c, "/proc/self/exe", argv);
}

/* child_vask sends a command line and reads one reply line, without its
 * newline, into buf. Returns 0, or -1 if the child did not answer. */
static inline int child_vask(child *c, char *buf, size_t n, const char *fmt, va_list ap) {
  vfprintf(c->in, fmt, ap);
  fputc('\n', c->in);
  fflush(c->in);
  if (!fgets(buf, (int)n, c->out)) return -1;
  buf[strcspn(buf, "\n")] = 0;
  return 0;
}

/* child_ask is child_vask with the command's arguments. */
static inline int child_ask(child *c, char *buf, size_t n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int rc = child_vask(c, buf, n, fmt, ap);
  va_end(ap);
  return rc;
}

/* child_end closes the pipes (the child exits on EOF) and reaps it. */
static inline int child_end(child *c) {
  if (c->in) fclose(c->in);
  if (c->out) fclose(c->out);
  c->in = c->out = NULL;
  int st = 0;
  waitpid(c->pid, &st, 0);
  return st;
}

static inline void hex_encode(const unsigned char *b, size_t n, char *out) {
  static const char digits[] = "0123456789abcdef";
  for (size_t i = 0; i < n; i++) {
    out[2 * i] = digits[b[i] >> 4];
    out[2 * i + 1] = digits[b[i] & 15];
  }
  out[2 * n] = 0;
}

static inline int hex_decode(const char *s, unsigned char *b, size_t n) {
  if (strlen(s) != 2 * n) return -1;
  for (size_t i = 0; i < n; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1) return -1;
    b[i] = (unsigned char)v;
  }
  return 0;
}

/* pattern is the byte expected at offset off of a test buffer. */
static inline unsigned char pattern(uint64_t off, unsigned seed) {
  uint64_t x = off * 0x9E3779B97F4A7C15ull + seed;
  return (unsigned char)(x >> 56);
}

/* One mapping of /proc/self/maps. */
typedef struct maps_entry {
  unsigned long long lo, hi;
  unsigned long ino;
  char perms[8];
  int memfd; /* a mapping of a memfd ("/memfd:NAME"), not the library's own
                bookkeeping: a grant table and spend logs ("vmmipc-grants",
                "vmmipc-spends", one page or 256 KiB each, kept per peer
                process and bounded; core's tests count those) */
} maps_entry;

/* A snapshot of /proc/self/maps at one moment. */
typedef struct maps_snapshot {
  int n;
  maps_entry e[4096];
} maps_snapshot;

/* maps_take reads /proc/self/maps into *s: the one parser of that file.
 * Returns 0, or -1 if it cannot be read. */
static inline int maps_take(maps_snapshot *s) {
  s->n = 0;
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return -1;
  char line[512];
  while (s->n < 4096 && fgets(line, sizeof line, f)) {
    maps_entry *e = &s->e[s->n];
    if (sscanf(line, "%llx-%llx %7s %*s %*s %lu", &e->lo, &e->hi, e->perms, &e->ino) != 4) continue;
    e->memfd = strstr(line, "/memfd:") != NULL && strstr(line, "/memfd:vmmipc-grants") == NULL &&
               strstr(line, "/memfd:vmmipc-spends") == NULL;
    s->n++;
  }
  fclose(f);
  return 0;
}

/* maps_now is a snapshot of this moment, in one static buffer: call it from
 * the test's own thread, and use the result before the next call. */
static inline const maps_snapshot *maps_now(void) {
  static maps_snapshot s;
  return maps_take(&s) == 0 ? &s : NULL;
}

/* maps_memfd_count counts the mappings of memfds (-1: unreadable). */
static inline int maps_memfd_count(void) {
  const maps_snapshot *s = maps_now();
  if (!s) return -1;
  int n = 0;
  for (int i = 0; i < s->n; i++) n += s->e[i].memfd;
  return n;
}

/* maps_has_range reports whether any mapping overlaps [addr, addr+size). */
static inline int maps_has_range(uint64_t addr, uint64_t size) {
  const maps_snapshot *s = maps_now();
  if (!s) return -1;
  for (int i = 0; i < s->n; i++)
    if (s->e[i].lo < addr + size && addr < s->e[i].hi) return 1;
  return 0;
}

/* maps_inode_at gives the inode of the file mapped at addr (0: none). */
static inline unsigned long maps_inode_at(uint64_t addr) {
  const maps_snapshot *s = maps_now();
  for (int i = 0; s && i < s->n; i++)
    if (s->e[i].lo <= addr && addr < s->e[i].hi) return s->e[i].ino;
  return 0;
}

/* maps_has_inode reports whether any mapping is of the memfd with inode ino
 * (a memfd's inode is its own: addresses may be reused, inodes are not
 * while the file lives). */
static inline int maps_has_inode(unsigned long ino) {
  const maps_snapshot *s = maps_now();
  if (!s) return -1;
  for (int i = 0; i < s->n; i++)
    if (s->e[i].memfd && s->e[i].ino == ino) return 1;
  return 0;
}

/* maps_new_reservations counts the anonymous PROT_NONE mappings of exactly
 * size bytes that are not inside ranges mapped at the snapshot: an import's
 * reservation (it reserves its whole range PROT_NONE first) made since and
 * not undone. The Go runtime grows its heap inside ranges it had reserved
 * before, reserves new arenas of 64 MiB or parts of them, and thread
 * stacks' guard pages are one page, so none of them counts; a whole-mapping
 * line count, or any PROT_NONE range of at least size bytes, would see
 * them. */
static inline int maps_new_reservations(const maps_snapshot *before, uint64_t size) {
  const maps_snapshot *s = maps_now();
  if (!s) return -1;
  int n = 0;
  for (int i = 0; i < s->n; i++) {
    const maps_entry *e = &s->e[i];
    if (strcmp(e->perms, "---p") != 0 || e->ino != 0 || e->hi - e->lo != size) continue;
    unsigned long long covered = 0;
    for (int j = 0; j < before->n; j++) {
      unsigned long long a = e->lo > before->e[j].lo ? e->lo : before->e[j].lo;
      unsigned long long b = e->hi < before->e[j].hi ? e->hi : before->e[j].hi;
      if (a < b) covered += b - a;
    }
    if (covered < e->hi - e->lo) {
      fprintf(stderr, "  new reservation: %llx-%llx ---p\n", e->lo, e->hi);
      n++;
    }
  }
  return n;
}

/* vm_size is this process's virtual size in bytes, what RLIMIT_AS counts. */
static inline uint64_t vm_size(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  unsigned long long pages = 0;
  if (f) {
    if (fscanf(f, "%llu", &pages) != 1) pages = 0;
    fclose(f);
  }
  return pages * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* Ticket layout, format 3 (core/ticket.go). The header promises no layout:
 * only tests that attack the wire (raw sockets, corrupted fields) use it. */
enum {
  TICKET_OFF_ADDR_KIND = 11, /* u8: 1 = abstract socket, 2 = path */
  TICKET_OFF_PID = 12,       /* u32 */
  TICKET_OFF_REG_ID = 24,    /* u64: the registration id */
  TICKET_OFF_SECRET = 40,    /* [32] */
  TICKET_OFF_ADDR_LEN = 104, /* u16, little-endian */
  TICKET_OFF_ADDR = 106,     /* address bytes (abstract: without the NUL) */
};

/* cache_info reads the import cache's counters (all fields). */
static inline vmmipc_cache_info cache_info(void) {
  vmmipc_cache_info i;
  memset(&i, 0, sizeof i);
  vmmipc_cache_get_info(&i, sizeof i);
  return i;
}

/* WAIT_UNTIL polls cond every millisecond for up to ms milliseconds; it
 * leaves the elapsed time in *took_ms (if not NULL) and is true if cond
 * held. */
#define WAIT_UNTIL(cond, ms, took_ms)                                           \
  ({                                                                            \
    double t0_ = now_ms(), *took_ = (took_ms);                                  \
    int ok_;                                                                    \
    while (!(ok_ = !!(cond)) && now_ms() - t0_ < (ms)) usleep(1000);            \
    if (took_) *took_ = now_ms() - t0_;                                         \
    ok_;                                                                        \
  })

/* count_mismatches counts the bytes of [p, p+n) that differ from the
 * pattern of a buffer at offset off with seed. */
static inline uint64_t count_mismatches(const unsigned char *p, uint64_t n, uint64_t off, unsigned seed) {
  uint64_t bad = 0;
  for (uint64_t i = 0; i < n; i++) bad += p[i] != pattern(off + i, seed);
  return bad;
}

/* verify_chunk_fd checks that a received chunk's descriptor holds the
 * pattern (seed 1). */
static inline int verify_chunk_fd(const vmmipc_chunk *c) {
  unsigned char *p = mmap(NULL, c->size, PROT_READ, MAP_SHARED, c->fd, (off_t)c->file_offset);
  if (p == MAP_FAILED) return 0;
  int ok = 1;
  for (uint64_t i = 0; i < c->size && ok; i++) ok = p[i] == pattern(c->offset + i, 1);
  munmap(p, c->size);
  return ok;
}

/* try_open opens a ticket expecting status want, and checks no descriptor
 * arrived (the count is unchanged). */
static inline int try_open(const vmmipc_ticket *t, int want, const char *needle) {
  int base = count_fds(0);
  vmmipc_stream *st = NULL;
  vmmipc_mapping m = {0};
  int rc = vmmipc_open(t, NULL, &st);
  if (rc == VMMIPC_OK) vmmipc_close(st);
  CHECK(rc == want, "open returned %d (%s), want %d: %s", rc, vmmipc_strerror(rc), want, vmmipc_last_error());
  CHECK(!needle || strstr(vmmipc_last_error(), needle), "message lacks \"%s\": %s", needle, vmmipc_last_error());
  printf("  %-14s -> %s\n", vmmipc_strerror(rc), vmmipc_last_error());
  rc = vmmipc_import_stream(t, VMMIPC_DEVICE_HOST, NULL, &m);
  if (rc == VMMIPC_OK) vmmipc_unmap(&m);
  CHECK(rc == want, "import returned %d, want %d: %s", rc, want, vmmipc_last_error());
  CHECK(!needle || strstr(vmmipc_last_error(), needle), "import's message lacks \"%s\": %s", needle, vmmipc_last_error());
  /* No descriptor arrived or stayed. A library thread's short connection
   * (the cache's status poll, a hit's late confirmation) may have been
   * open at the baseline or be open now for a moment: wait for it. */
  for (int i = 0; i < 100 && count_fds(0) > base; i++) usleep(10000);
  CHECK(count_fds(0) <= base, "fds %d, baseline %d", count_fds(0), base);
  return 0;
}

/* import_verify imports a host ticket and checks every byte against seed. */
static inline int import_verify(const vmmipc_ticket *t, unsigned seed, vmmipc_mapping *m) {
  CHECK_RC(vmmipc_import_stream(t, VMMIPC_DEVICE_HOST, NULL, m), VMMIPC_OK);
  uint64_t bad = count_mismatches((const unsigned char *)(uintptr_t)m->addr, m->size, 0, seed);
  CHECK(bad == 0, "%llu bytes differ from pattern %u", (unsigned long long)bad, seed);
  return 0;
}

/* import_and_unmap imports a host ticket, checks every byte against
 * pattern 1 and unmaps it, leaving in addr and size where it was mapped
 * (where the import cache keeps it while the registration lives). */
static inline int import_and_unmap(const vmmipc_ticket *t, uint64_t *addr, uint64_t *size) {
  vmmipc_mapping m;
  if (import_verify(t, 1, &m)) return 1;
  *addr = m.addr;
  *size = m.size;
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  return 0;
}

/* env_with makes a copy of our environment with var set to value (NULL:
 * unset), its "var=value" string in buf; free the array with free(). */
static inline char **env_with(const char *var, const char *value, char *buf, size_t buflen) {
  size_t n = 0, k = strlen(var);
  while (environ[n]) n++;
  char **env = calloc(n + 2, sizeof *env);
  size_t j = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], var, k) != 0 || environ[i][k] != '=') env[j++] = environ[i];
  if (value) {
    snprintf(buf, buflen, "%s=%s", var, value);
    env[j++] = buf;
  }
  env[j] = NULL;
  return env;
}

#endif
