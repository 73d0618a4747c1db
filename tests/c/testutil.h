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

static inline int child_spawn_path(child *c, const char *path, char *const argv[]);

static inline int child_spawn(child *c, char *const argv[]) {
  return child_spawn_path(c, "/proc/self/exe", argv);
}

/* child_spawn_path starts path (argv) with pipes to its stdin/stdout. */
static inline int child_spawn_path(child *c, const char *path, char *const argv[]) {
  int to[2], from[2];
  if (pipe2(to, O_CLOEXEC) || pipe2(from, O_CLOEXEC)) return -1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, to[0], 0);
  posix_spawn_file_actions_adddup2(&fa, from[1], 1);
  int rc = posix_spawn(&c->pid, path, &fa, NULL, argv, environ);
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

/* child_ask sends a command line and reads one reply line into buf. */
static inline int child_ask(child *c, char *buf, size_t n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfprintf(c->in, fmt, ap);
  va_end(ap);
  fputc('\n', c->in);
  fflush(c->in);
  if (!fgets(buf, (int)n, c->out)) return -1;
  buf[strcspn(buf, "\n")] = 0;
  return 0;
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

#endif
