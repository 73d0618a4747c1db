/* Loading libvmmipc must leave the host as it was: RLIMIT_NOFILE and every
 * signal disposition (handler, flags, restorer, mask) unchanged, checked the
 * moment the library is loaded and again after it has been used.
 *
 * Built twice: without LINKED it dlopen()s the library given as argv[1];
 * with LINKED it is linked against it, and the parent run (argv[1] =
 * "parent") sets the limit, every disposition to its default and SIGINT to
 * ignored, then execs itself so the check runs at the start of main(),
 * after the library's constructors. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

struct ksa { /* the kernel's sigaction on x86-64 */
  void *handler;
  unsigned long flags;
  void *restorer;
  unsigned long mask;
};

#define NSIGS 65
static struct ksa before[NSIGS];
static struct rlimit nofile_before;
static int failures;

static void snapshot(struct ksa *out) {
  for (int s = 1; s < NSIGS; s++) syscall(SYS_rt_sigaction, s, NULL, &out[s], 8);
}

static void compare(const char *when) {
  struct ksa now[NSIGS];
  snapshot(now);
  int bad = 0;
  for (int s = 1; s < NSIGS; s++) {
    /* The one allowed change: SA_ONSTACK on a handler the host installed
     * (Go requires it: the handler may run on a thread Go created). */
    struct ksa want = before[s];
    if (want.handler != (void *)SIG_DFL && want.handler != (void *)SIG_IGN) want.flags |= SA_ONSTACK;
    if (memcmp(&now[s], &want, sizeof now[s])) {
      printf("  %s: signal %d changed: handler %p->%p flags %#lx->%#lx (want %#lx) mask %#lx->%#lx\n", when, s,
             before[s].handler, now[s].handler, before[s].flags, now[s].flags, want.flags, before[s].mask, now[s].mask);
      bad++;
    }
  }
  struct rlimit r;
  getrlimit(RLIMIT_NOFILE, &r);
  if (r.rlim_cur != nofile_before.rlim_cur || r.rlim_max != nofile_before.rlim_max) {
    printf("  %s: RLIMIT_NOFILE changed: %llu/%llu -> %llu/%llu\n", when,
           (unsigned long long)nofile_before.rlim_cur, (unsigned long long)nofile_before.rlim_max,
           (unsigned long long)r.rlim_cur, (unsigned long long)r.rlim_max);
    bad++;
  }
  printf("%s %s\n", bad ? "FAIL" : "PASS", when);
  failures += bad != 0;
}

#ifndef LINKED
static void on_usr1(int sig, siginfo_t *si, void *uc) { (void)sig, (void)si, (void)uc; }
static void on_hup(int sig) { (void)sig; }
static void *nothing(void *arg) { return arg; }

/* A host with opinions: a lowered soft fd limit, handlers with flags and
 * masks, an ignored signal, and a thread already started (so glibc's own
 * lazily installed signal handlers are in place before the snapshot). */
static void make_host(void) {
  struct rlimit r;
  getrlimit(RLIMIT_NOFILE, &r);
  r.rlim_cur = r.rlim_max > 256 ? 256 : r.rlim_max;
  setrlimit(RLIMIT_NOFILE, &r);
  struct sigaction sa = {0};
  sa.sa_sigaction = on_usr1;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigaddset(&sa.sa_mask, SIGUSR2);
  sigaction(SIGUSR1, &sa, NULL);
  signal(SIGHUP, on_hup);
  signal(SIGINT, SIG_IGN);
  pthread_t t;
  pthread_create(&t, NULL, nothing, NULL);
  pthread_join(t, NULL);
}
#endif

#ifdef LINKED
#include <vmmipc.h>
int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "parent") == 0) {
    struct rlimit r;
    getrlimit(RLIMIT_NOFILE, &r);
    r.rlim_cur = r.rlim_max > 200 ? 200 : r.rlim_max;
    setrlimit(RLIMIT_NOFILE, &r);
    /* Exec keeps an ignored signal ignored: start the child from a known
     * state whatever this process inherited (nohup ignores SIGHUP, a
     * background job of a non-interactive shell SIGINT and SIGQUIT). */
    for (int s = 1; s < NSIGS; s++)
      if (s != SIGKILL && s != SIGSTOP && (s < 32 || s >= SIGRTMIN)) signal(s, SIG_DFL);
    signal(SIGINT, SIG_IGN); /* survives exec */
    char cur[32];
    snprintf(cur, sizeof cur, "%llu", (unsigned long long)r.rlim_cur);
    execl("/proc/self/exe", argv[0], "child", cur, (char *)NULL);
    return 127;
  }
  /* child: the library was loaded and initialized before main(). */
  getrlimit(RLIMIT_NOFILE, &nofile_before);
  unsigned long long want = argc > 2 ? strtoull(argv[2], 0, 10) : 0;
  int ok = nofile_before.rlim_cur == want;
  printf("%s linked: RLIMIT_NOFILE soft %llu at main(), set to %llu before exec\n", ok ? "PASS" : "FAIL",
         (unsigned long long)nofile_before.rlim_cur, want);
  failures += !ok;
  struct ksa now[NSIGS];
  snapshot(now);
  int bad = 0;
  for (int s = 1; s < NSIGS; s++) {
    if (s >= 32 && s < SIGRTMIN) continue; /* glibc's own, installed with the first thread */
    void *want_h = s == SIGINT ? (void *)SIG_IGN : (void *)SIG_DFL;
    if (now[s].handler != want_h) {
      printf("  signal %d has handler %p at main(), want %p\n", s, now[s].handler, want_h);
      bad++;
    }
  }
  printf("%s linked: every signal disposition as exec left it\n", bad ? "FAIL" : "PASS");
  failures += bad != 0;
  memcpy(before, now, sizeof now);
  /* Use the runtime for real: share a memfd with ourselves. */
  int fd = memfd_create("hygiene", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  vmmipc_ticket t;
  vmmipc_mapping m;
  int rc = fd < 0 || ftruncate(fd, 1 << 20) || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) ||
           vmmipc_register_host_file(fd, 1 << 20, 65536, NULL, NULL, NULL, &t) ||
           vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &m) || vmmipc_unmap(&m);
  if (rc) printf("  library calls failed: %s\n", vmmipc_last_error());
  failures += rc != 0;
  compare("linked: after calls");
  printf("%d passed, %d failed\n", 4 - failures, failures);
  return failures != 0;
}
#else
int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s path/to/libvmmipc.so\n", argv[0]);
    return 2;
  }
  make_host();
  getrlimit(RLIMIT_NOFILE, &nofile_before);
  snapshot(before);
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    printf("FAIL dlopen: %s\n", dlerror());
    return 1;
  }
  compare("right after dlopen");
  const char *(*version)(void) = (const char *(*)(void))dlsym(h, "vmmipc_version");
  int (*live)(uint64_t *) = (int (*)(uint64_t *))dlsym(h, "vmmipc_live_registrations");
  int (*open_)(const void *, const void *, void **) = (int (*)(const void *, const void *, void **))dlsym(h, "vmmipc_open");
  if (!version || !live || !open_) {
    printf("FAIL dlsym\n");
    return 1;
  }
  uint64_t n;
  unsigned char ticket[256] = {0};
  void *st;
  int rc = live(&n);
  rc |= open_(ticket, NULL, &st) != -1; /* EINVAL, through the Go side */
  printf("%s calls into the library (version %s)\n", rc ? "FAIL" : "PASS", version());
  failures += rc != 0;
  usleep(50 * 1000);
  compare("50 ms later, after calls");
  /* Exported symbols: only vmmipc_*, checked by the build (nm) too. */
  if (dlsym(h, "crosscall2") || dlsym(h, "vmmipcgo_open") || dlsym(h, "_cgo_topofstack")) {
    printf("FAIL internal symbols are exported\n");
    failures++;
  } else {
    printf("PASS only vmmipc_* symbols resolve\n");
  }
  /* never dlclose a Go library */
  printf("%d passed, %d failed\n", 5 - failures, failures);
  return failures != 0;
}
#endif
