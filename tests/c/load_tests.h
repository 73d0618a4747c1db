/* Tests under pressure, through the header only: imports under a tight
 * RLIMIT_AS, 1024 receivers at once, and idle connections that must not lock
 * legitimate receivers out (issue 10, items 3, 4 and 8). Part of
 * test_vmmipc.c. */
#ifndef VMMIPC_LOAD_TESTS_H
#define VMMIPC_LOAD_TESTS_H
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "contract_tests.h"
#include "sender.h"
#include "testutil.h"

#define MIB (1ull << 20)

/* say writes a line with one write(): it allocates nothing, so that it
 * works under a RLIMIT_AS that leaves malloc no room. */
static void say(const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if (n > (int)sizeof buf - 2) n = sizeof buf - 2;
  buf[n++] = '\n';
  if (write(1, buf, (size_t)n) < 0) _exit(3);
}

/* Role as_receiver HEADROOM HEX: sets RLIMIT_AS to this process's virtual
 * size plus HEADROOM bytes, imports the ticket and says "result OK" (every
 * byte verified), "result BAD n" or "result RC MESSAGE". */
static int as_receiver_main(int argc, char **argv) {
  vmmipc_ticket t;
  if (argc < 4 || hex_decode(argv[3], t.bytes, sizeof t.bytes)) return 2;
  uint64_t headroom = strtoull(argv[2], NULL, 0);
  struct rlimit r;
  getrlimit(RLIMIT_AS, &r);
  uint64_t vm = vm_size();
  r.rlim_cur = vm + headroom;
  if (setrlimit(RLIMIT_AS, &r)) {
    say("result setrlimit failed: %s", strerror(errno));
    return 0;
  }
  vmmipc_mapping m;
  int rc = vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &m);
  if (rc != VMMIPC_OK) {
    say("result %d %s", rc, vmmipc_last_error());
    return 0;
  }
  uint64_t bad = count_mismatches((const unsigned char *)(uintptr_t)m.addr, m.size, 0, 1);
  rc = vmmipc_unmap(&m);
  if (bad || rc)
    say("result BAD %llu bytes differ, unmap %d", (unsigned long long)bad, rc);
  else
    say("result OK");
  return 0;
}

/* A receiver importing 64 MiB of host memory under RLIMIT_AS = its virtual
 * size + headroom, for headroom 0 to 256 MiB in 16 MiB steps and at
 * 512 MiB: each ends in VMMIPC_OK with every byte verified or in
 * VMMIPC_ENOMEM with a message that gives the figures; never a crash or a
 * Go "fatal error" (exit status 2), never VMMIPC_EIO. 512 MiB ("a few
 * hundred MiB of headroom above what you map", the header says) must
 * succeed. */
static int test_rlimit_as_sweep(void) {
  enum { N = 64, CS = MIB };
  START_SENDER(s, t, "file", N, CS, 0, -1, 0);
  char hex[2 * VMMIPC_TICKET_SIZE + 1];
  hex_encode(t.bytes, sizeof t.bytes, hex);
  int ok = 0, enomem = 0;
  for (uint64_t mib = 0; mib <= 512; mib += mib < 256 ? 16 : 256) {
    char hr[32];
    snprintf(hr, sizeof hr, "%llu", (unsigned long long)(mib * MIB));
    char *argv[] = {"vmmipc-test-as-receiver", "as_receiver", hr, hex, NULL};
    child c;
    child_opts o = {.merge_stderr = 1};
    CHECK(child_spawn_with(&c, "/proc/self/exe", argv, &o) == 0, "spawn");
    char line[1024], result[1024] = "", fatal[1024] = "";
    while (fgets(line, sizeof line, c.out)) {
      line[strcspn(line, "\n")] = 0;
      if (strncmp(line, "result ", 7) == 0) snprintf(result, sizeof result, "%s", line + 7);
      if (!fatal[0] && (strstr(line, "fatal error") || strstr(line, "panic"))) snprintf(fatal, sizeof fatal, "%s", line);
    }
    int st = child_end(&c);
    printf("  headroom %3llu MiB: %s\n", (unsigned long long)mib, result[0] ? result : "(no result)");
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0 && !fatal[0], "headroom %llu MiB: the receiver %s %d (%s)",
          (unsigned long long)mib, WIFSIGNALED(st) ? "was killed by signal" : "exited with status",
          WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st), fatal[0] ? fatal : result);
    if (strcmp(result, "OK") == 0) {
      ok++;
      continue;
    }
    CHECK(atoi(result) == VMMIPC_ENOMEM, "headroom %llu MiB: want VMMIPC_OK or VMMIPC_ENOMEM, got %s",
          (unsigned long long)mib, result[0] ? result : "no result");
    CHECK(strstr(result, "RLIMIT_AS") && strstr(result, "MiB") && strstr(result, "free"),
          "headroom %llu MiB: the VMMIPC_ENOMEM message does not give the figures: %s", (unsigned long long)mib, result);
    if (mib == 0) {
      /* Refused before entering Go (abi.c), with the headroom Go's init
       * handed over from core.RuntimeHeadroom: not 0. */
      const char *h = strstr(result, "less than the ");
      CHECK(h && strtoull(h + strlen("less than the "), NULL, 10) > 0 && strstr(result, "Go runtime inside libvmmipc"),
            "no headroom: not refused by abi.c with core's headroom: %s", result);
    }
    CHECK(mib < 512, "512 MiB of headroom over the process's size is not enough to map 64 MiB: %s", result);
    enomem++;
  }
  printf("  %d levels imported, %d refused with VMMIPC_ENOMEM, none crashed\n", ok, enomem);
  CHECK(enomem > 0, "not even 0 bytes of headroom was refused");
  child_end(&s);
  return 0;
}

/* ---- a connection storm ---- */

/* One receiver thread of a storm_receiver process. */
typedef struct storm_thread {
  const vmmipc_ticket *t;
  const vmmipc_options *opts;
  pthread_barrier_t *start;
  int rc;
  uint64_t bad;
  double ms;
  char err[256];
} storm_thread;

static void *storm_import(void *arg) {
  storm_thread *w = arg;
  pthread_barrier_wait(w->start);
  double t0 = now_ms();
  vmmipc_mapping m;
  w->rc = vmmipc_import_stream(w->t, VMMIPC_DEVICE_HOST, w->opts, &m);
  w->ms = now_ms() - t0;
  if (w->rc == VMMIPC_OK) {
    w->bad = count_mismatches((const unsigned char *)(uintptr_t)m.addr, m.size, 0, 1);
    w->rc = vmmipc_unmap(&m);
  }
  if (w->rc) snprintf(w->err, sizeof w->err, "%d after %.0f ms: %s", w->rc, w->ms, vmmipc_last_error());
  return NULL;
}

/* Role storm_receiver THREADS HEX: starts THREADS threads, says "ready",
 * waits for a line on stdin, lets them all import at once and says
 * "done OK FAILED BAD SLOWEST_MS FIRST_ERROR". */
static int storm_receiver_main(int argc, char **argv) {
  vmmipc_ticket t;
  if (argc < 4 || hex_decode(argv[3], t.bytes, sizeof t.bytes)) return 2;
  int n = atoi(argv[2]);
  storm_thread *w = calloc((size_t)n, sizeof *w);
  pthread_t *th = calloc((size_t)n, sizeof *th);
  pthread_barrier_t start;
  pthread_barrier_init(&start, NULL, (unsigned)n + 1);
  vmmipc_options o = default_options();
  o.import_flags = VMMIPC_IMPORT_NO_CACHE; /* every receiver a full import */
  for (int i = 0; i < n; i++) {
    w[i] = (storm_thread){.t = &t, .opts = &o, .start = &start};
    pthread_create(&th[i], NULL, storm_import, &w[i]);
  }
  say("ready");
  char go[16];
  if (!fgets(go, sizeof go, stdin)) return 2;
  pthread_barrier_wait(&start);
  int ok = 0, failed = 0;
  uint64_t bad = 0;
  double slowest = 0;
  const char *first = "-";
  for (int i = 0; i < n; i++) {
    pthread_join(th[i], NULL);
    if (w[i].rc == VMMIPC_OK) ok++;
    else if (failed++ == 0) first = w[i].err;
    bad += w[i].bad;
    if (w[i].ms > slowest) slowest = w[i].ms;
  }
  say("done %d %d %llu %.0f %s", ok, failed, (unsigned long long)bad, slowest, first);
  return 0;
}

/* start_busy_sender starts a file-mode sender of chunks x chunk_size bytes
 * with uses = 0 at RLIMIT_NOFILE 1024 (so it serves 256 connections at a
 * time), its descriptor sampler off (it would spin on a core beside the
 * crowd). Returns 0, or 1 (the test failed) after saying why. */
static int start_busy_sender(child *s, vmmipc_ticket *t, uint64_t chunks, uint64_t chunk_size) {
  char var[64];
  char **env = env_with("VMMIPC_TEST_SENDER_NOFILE", "1024", var, sizeof var);
  int rc = sender_start_env(s, t, "file", chunks, chunk_size, 0, -1, 0, env);
  free(env);
  CHECK(rc == 0, "sender did not start");
  char reply[64];
  CHECK(child_ask(s, reply, sizeof reply, "nosample") == 0, "sender gone");
  return 0;
}

/* 1024 receivers at once (32 processes x 32 threads, each a full uncached
 * import of 16 chunks) against a sender at RLIMIT_NOFILE 1024 (so it serves
 * 256 at a time) with uses = 0: every receiver succeeds, every byte is
 * verified, and the sender ends with the descriptors it started with. */
static int test_connection_storm(void) {
  enum { P = 32, T = 32, N = 16, CS = 4096 };
  child s;
  vmmipc_ticket t;
  if (start_busy_sender(&s, &t, N, CS)) return 1;
  char hex[2 * VMMIPC_TICKET_SIZE + 1], threads[16];
  hex_encode(t.bytes, sizeof t.bytes, hex);
  snprintf(threads, sizeof threads, "%d", T);
  child r[P];
  for (int i = 0; i < P; i++) {
    char *argv[] = {"vmmipc-test-storm", "storm_receiver", threads, hex, NULL};
    CHECK(child_spawn(&r[i], argv) == 0, "spawn receiver %d", i);
  }
  for (int i = 0; i < P; i++) {
    char line[64] = "";
    CHECK(fgets(line, sizeof line, r[i].out) && strncmp(line, "ready", 5) == 0, "receiver %d: %s", i, line);
  }
  double t0 = now_ms();
  for (int i = 0; i < P; i++) fputs("go\n", r[i].in), fflush(r[i].in);
  int ok = 0, failed = 0;
  unsigned long long bad = 0;
  double slowest = 0;
  char first[512] = "";
  for (int i = 0; i < P; i++) {
    char line[512] = "";
    int k = 0, f = 0;
    unsigned long long b = 0;
    double ms = 0;
    int got = fgets(line, sizeof line, r[i].out) && sscanf(line, "done %d %d %llu %lf", &k, &f, &b, &ms) == 4;
    int st = child_end(&r[i]);
    CHECK(got && WIFEXITED(st) && WEXITSTATUS(st) == 0, "receiver process %d: \"%s\", status %#x", i, line, st);
    ok += k, failed += f, bad += b;
    if (ms > slowest) slowest = ms;
    if (f && !first[0]) snprintf(first, sizeof first, "%s", line);
  }
  double ms = now_ms() - t0;
  printf("  %d receivers (%d processes x %d threads) against a sender at RLIMIT_NOFILE 1024: %d ok, %d failed, "
         "%llu bytes differ; %.0f ms in all, slowest receiver %.0f ms\n",
         P * T, P, T, ok, failed, bad, ms, slowest);
  CHECK(ok == P * T && failed == 0 && bad == 0, "first failure: %s", first);
  int s_now, s_peak;
  CHECK(sender_fds(&s, 1, &s_now, &s_peak) == 0 && s_now == 1,
        "after the storm the sender holds %d descriptor(s) more than before registering, want 1 (the memfd's duplicate)",
        s_now);
  CHECK(sender_ask_int(&s, NULL, 0, "live") == 1, "the uses = 0 registration did not stay live");
  CHECK(sender_rc_is(&s, VMMIPC_OK, NULL, "unregister 0") == 0, "unregister");
  CHECK(sender_fds(&s, 0, &s_now, &s_peak) == 0 && s_now == 0, "the sender holds %d descriptor(s) at the end", s_now);
  child_end(&s);
  return 0;
}

/* connect_raw opens a non-blocking connection to the exporter's socket
 * named in the ticket, as any same-uid process could; -1 if refused. */
static int connect_raw(const vmmipc_ticket *t) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  unsigned len = t->bytes[TICKET_OFF_ADDR_LEN] | t->bytes[TICKET_OFF_ADDR_LEN + 1] << 8;
  socklen_t sl;
  if (len == 0 || len >= sizeof sa.sun_path) return -1;
  if (t->bytes[TICKET_OFF_ADDR_KIND] == 1) { /* abstract: a leading NUL */
    memcpy(sa.sun_path + 1, t->bytes + TICKET_OFF_ADDR, len);
    sl = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + len);
  } else {
    memcpy(sa.sun_path, t->bytes + TICKET_OFF_ADDR, len);
    sl = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len + 1);
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  if (connect(fd, (struct sockaddr *)&sa, sl) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* closed_by_peer reports whether the server has closed connection fd
 * (reading past anything it said, e.g. "busy"). */
static int closed_by_peer(int fd) {
  char buf[512];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0) return 1;
    if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK;
  }
}

/* 300 idle connections (opened, never authenticated) to a sender serving
 * at most 256 at once: a legitimate receiver still imports within 1 s, and
 * the sender drops every idle one (they must authenticate within 2 s). */
static int test_idle_connections(void) {
  enum { IDLE = 300, N = 16, CS = 4096 };
  child s;
  vmmipc_ticket t;
  if (start_busy_sender(&s, &t, N, CS)) return 1;
  int base = count_fds(0);
  rlim_t old = set_nofile(base + IDLE + 64 > 1024 ? (rlim_t)(base + IDLE + 64) : 1024);
  int idle[IDLE], opened = 0;
  for (int i = 0; i < IDLE; i++)
    if ((idle[opened] = connect_raw(&t)) >= 0) opened++;
  CHECK(opened == IDLE, "only %d of %d idle connections could connect", opened, IDLE);
  usleep(150 * 1000); /* older than the 100 ms after which the sender may drop them */
  vmmipc_mapping m;
  double t0 = now_ms();
  int rc = vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &m);
  double ms = now_ms() - t0;
  CHECK(rc == VMMIPC_OK, "import beside %d idle connections: %d %s", IDLE, rc, vmmipc_last_error());
  CHECK(count_mismatches((const unsigned char *)(uintptr_t)m.addr, m.size, 0, 1) == 0, "bytes differ");
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  printf("  a receiver imported in %.1f ms beside %d idle connections\n", ms, IDLE);
  CHECK(ms < 1000, "the import took %.0f ms beside idle connections (limit 1000 ms)", ms);
  int dropped = 0;
  double took = 0;
  WAIT_UNTIL(({
               for (int i = 0; i < opened; i++)
                 if (idle[i] >= 0 && closed_by_peer(idle[i])) close(idle[i]), idle[i] = -1, dropped++;
               dropped == opened;
             }),
             10000, &took);
  for (int i = 0; i < opened; i++)
    if (idle[i] >= 0) close(idle[i]);
  set_nofile(old);
  printf("  the sender dropped %d of %d idle connections within %.0f ms\n", dropped, opened, took);
  CHECK(dropped == opened, "%d idle connections were still open after 10 s", opened - dropped);
  /* The import cache's poller may hold its status socket for a moment. */
  WAIT_UNTIL(count_fds(0) == base, 2000, &took);
  CHECK(count_fds(0) == base, "fds %d, baseline %d (2 s after)", count_fds(0), base);
  int s_now, s_peak;
  CHECK(sender_fds(&s, 1, &s_now, &s_peak) == 0 && s_now == 1,
        "with the idle connections gone the sender holds %d descriptor(s) more than before registering, want 1", s_now);
  child_end(&s);
  return 0;
}
#endif
