/* Tests of the 0.2 contract (vmmipc.h), each through the header only:
 * ticket integrity, vmmipc_register_again, vmmipc_wait, vmmipc_live_many,
 * host files, option bounds and status names. Part of test_vmmipc.c (one translation unit). */
#ifndef VMMIPC_CONTRACT_TESTS_H
#define VMMIPC_CONTRACT_TESTS_H
#include <sys/mman.h>

#include "sender.h"
#include "testutil.h"

/* own_memfd makes a sealed memfd of n bytes holding pattern seed (this
 * process is the sender). */
static int own_memfd(uint64_t n, unsigned seed) { return fill_memfd("vmmipc-test-own", n, 0, seed, 0); }

/* Every single-byte change of a ticket is refused ("Trust": any single-byte
 * change of a ticket is refused), by open and by import, with a message,
 * without a descriptor left behind and without spending the use: the good
 * ticket still imports afterwards. Each byte is flipped two ways. */
static int test_ticket_corruption_sweep(void) {
  START_SENDER(s, good, "file", 4, 4096, 1, -1, 0);
  int base = count_fds(0);
  vmmipc_options o = default_options();
  o.timeout_ms = 2000;
  int by_status[16] = {0};
  double t0 = now_ms();
  for (size_t i = 0; i < VMMIPC_TICKET_SIZE; i++) {
    for (int flip = 0; flip < 2; flip++) {
      vmmipc_ticket t = good;
      t.bytes[i] ^= flip ? 0x80 : 0x01;
      vmmipc_stream *st = NULL;
      int rc = vmmipc_open(&t, &o, &st);
      if (rc == VMMIPC_OK) vmmipc_close(st);
      CHECK(rc < 0 && rc != VMMIPC_EINTERNAL && vmmipc_last_error()[0],
            "byte %zu ^ %#x: open returned %d (%s): %s", i, flip ? 0x80 : 0x01, rc, vmmipc_strerror(rc),
            vmmipc_last_error());
      by_status[-rc]++;
      if (flip) continue;
      vmmipc_mapping m = {0};
      rc = vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, &o, &m);
      if (rc == VMMIPC_OK) vmmipc_unmap(&m);
      CHECK(rc < 0 && rc != VMMIPC_EINTERNAL && m.addr == 0, "byte %zu ^ 0x01: import returned %d: %s", i, rc,
            vmmipc_last_error());
    }
  }
  double ms = now_ms() - t0;
  printf("  %d corrupted tickets refused in %.0f ms:", 2 * VMMIPC_TICKET_SIZE, ms);
  for (int c = 1; c < 16; c++)
    if (by_status[c]) printf(" %.*s %d", (int)strcspn(vmmipc_strerror(-c), ":"), vmmipc_strerror(-c), by_status[c]);
  printf("\n");
  CHECK(count_fds(0) == base, "fds %d, baseline %d", count_fds(0), base);
  vmmipc_mapping m;
  CHECK_RC(vmmipc_import_stream(&good, VMMIPC_DEVICE_HOST, NULL, &m), VMMIPC_OK);
  CHECK(count_mismatches((const unsigned char *)(uintptr_t)m.addr, m.size, 0, 1) == 0, "bytes differ");
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  child_end(&s);
  return 0;
}

/* sender_rc_is sends a command whose reply is "RC MESSAGE" and checks RC,
 * and that MESSAGE contains needle (if not NULL). */
static int sender_rc_is(child *c, int want, const char *needle, const char *cmd) {
  char reply[700];
  int rc = sender_ask_int(c, reply, sizeof reply, "%s", cmd);
  CHECK(rc == want && (!needle || strstr(reply, needle)), "sender: %s: got \"%s\", want %d%s%s", cmd, reply, want,
        needle ? " and " : "", needle ? needle : "");
  return 0;
}

#define CHECK_SENDER_RC(c, want, needle, cmd)          \
  do {                                                 \
    if (sender_rc_is((c), (want), (needle), (cmd))) return 1; \
  } while (0)

/* A receiver's import of ticket t must be a cache hit at addr: one more hit,
 * no miss, no descriptor received: three sockets at most (the hit's, the
 * netlink socket its handshake opens for a moment to ask the kernel which
 * socket is its peer, and the cache's status poll of its unreferenced
 * mapping, which may overlap). */
static int expect_hit(const vmmipc_ticket *t, uint64_t addr, const char *what) {
  vmmipc_cache_info c0 = cache_info();
  int base = count_fds(0);
  fd_sampler fs;
  fd_sampler_start(&fs, 0);
  vmmipc_mapping m;
  int rc = vmmipc_import_stream(t, VMMIPC_DEVICE_HOST, NULL, &m);
  int peak = fd_sampler_stop(&fs);
  CHECK(rc == VMMIPC_OK, "%s: import returned %d: %s", what, rc, vmmipc_last_error());
  vmmipc_cache_info c1 = cache_info();
  CHECK(m.addr == addr, "%s: mapped at %#llx, not at the cached %#llx: not a cache hit", what,
        (unsigned long long)m.addr, (unsigned long long)addr);
  CHECK(c1.hits == c0.hits + 1 && c1.misses == c0.misses, "%s: hits %llu->%llu, misses %llu->%llu", what,
        (unsigned long long)c0.hits, (unsigned long long)c1.hits, (unsigned long long)c0.misses,
        (unsigned long long)c1.misses);
  CHECK(peak - base <= 3, "%s: the hit took %d extra descriptors (three sockets at most)", what, peak - base);
  CHECK(count_mismatches((const unsigned char *)(uintptr_t)m.addr, m.size, 0, 1) == 0, "%s: bytes differ", what);
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  /* A hit that the sender's grant table vouched for spends its use just
   * after it returned: wait for that, as the checks after this one read
   * the sender. */
  CHECK(WAIT_UNTIL(cache_info().confirms_pending == 0, 5000, NULL), "%s: the hit's use is still being spent", what);
  return 0;
}

/* vmmipc_register_again: the same buffer identity (a cached receiver gets
 * the memory without a re-import), its own uses and ttl, its own release_fn
 * once at its end; the original's release_fn (callback mode) runs only
 * after every registration made from it has ended. */
static int test_register_again(void) {
  enum { N = 16, CS = 4096 };
  START_CACHED(s, t0, addr, size, "callback", N, CS, 0, -1, 0);
  vmmipc_ticket t1, t2, t3;
  CHECK(maps_has_range(addr, size) == 1, "the mapping of a live uses = 0 registration was not kept in the cache");
  int exports = sender_ask_int(&s, NULL, 0, "exports");
  CHECK(exports == N, "export_fn ran %d times for %d chunks", exports, N);

  char err[700];
  CHECK(sender_ask_ticket(&s, &t1, err, sizeof err, "again 0 1 0") == 0, "register_again: %s", err);
  vmmipc_ticket_info i0, i1;
  CHECK_RC(vmmipc_ticket_decode(&t0, &i0), VMMIPC_OK);
  CHECK_RC(vmmipc_ticket_decode(&t1, &i1), VMMIPC_OK);
  CHECK(memcmp(&t0, &t1, sizeof t0) != 0, "register_again returned the original ticket");
  CHECK(i1.exporter_pid == i0.exporter_pid && i1.chunk_count == N && i1.total_size == size &&
            i1.memory_kind == VMMIPC_MEMORY_HOST,
        "the new ticket describes other memory");
  if (expect_hit(&t1, addr, "register_again's ticket")) return 1;
  exports = sender_ask_int(&s, NULL, 0, "exports");
  CHECK(exports == N, "the hit re-exported: export_fn ran %d times, want %d", exports, N);
  /* Its one use was spent by the hit: it ended and was released, once. */
  CHECK(sender_ask_int(&s, NULL, 0, "released 1") == 1, "release_fn of the new registration did not run once");
  CHECK_SENDER_RC(&s, VMMIPC_OK, NULL, "wait 1 2000");
  if (try_open(&t1, VMMIPC_ENOENT, "used up")) return 1;
  CHECK(sender_ask_int(&s, NULL, 0, "released-now 0") == 0, "the original was released");

  /* Its own ttl. */
  CHECK(sender_ask_ticket(&s, &t2, err, sizeof err, "again 0 0 300") == 0, "register_again: %s", err);
  if (expect_hit(&t2, addr, "a ttl = 300 ms ticket of the same memory")) return 1;
  CHECK_SENDER_RC(&s, VMMIPC_OK, NULL, "wait 2 5000");
  CHECK(sender_ask_int(&s, NULL, 0, "released-now 2") == 1, "release_fn of the expired registration did not run once");
  if (try_open(&t2, VMMIPC_ENOENT, "expired")) return 1;

  /* Refused: a forged ticket, bounds, a ticket of another process. */
  CHECK_SENDER_RC(&s, VMMIPC_EAUTH, "wrong secret", "again-forged 0");
  CHECK(sender_ask_ticket(&s, &t3, err, sizeof err, "again 0 1 %llu", VMMIPC_MAX_TTL_MS + 1) != 0 &&
            strstr(err, "ttl_ms"),
        "a ttl above VMMIPC_MAX_TTL_MS: %s", err);
  vmmipc_ticket out;
  int rc = vmmipc_register_again(&t0, NULL, NULL, NULL, &out);
  CHECK(rc == VMMIPC_ENOENT && strstr(vmmipc_last_error(), "another exporter"),
        "register_again of another process's ticket: %d %s", rc, vmmipc_last_error());
  CHECK_RC(vmmipc_register_again(NULL, NULL, NULL, NULL, &out), VMMIPC_EINVAL);
  CHECK_RC(vmmipc_register_again(&t0, NULL, NULL, NULL, NULL), VMMIPC_EINVAL);

  /* The original ends first: its release_fn waits for t3. */
  CHECK(sender_ask_ticket(&s, &t3, err, sizeof err, "again 0 1 0") == 0, "register_again: %s", err);
  CHECK_SENDER_RC(&s, VMMIPC_OK, NULL, "unregister 0");
  CHECK(sender_ask_int(&s, NULL, 0, "released-now 0") == 0,
        "the original's release_fn ran while a registration made from it lives");
  CHECK_SENDER_RC(&s, VMMIPC_ETIMEDOUT, "has ended", "wait 0 0");
  if (try_open(&t0, VMMIPC_ENOENT, "unregistered")) return 1;
  CHECK(sender_ask_ticket(&s, &out, err, sizeof err, "again 0 1 0") != 0 && strstr(err, "error -4"),
        "register_again of an ended registration: %s", err);
  if (expect_hit(&t3, addr, "a ticket made from an unregistered one")) return 1;
  /* Now no registration of the buffer lives: the last hit's answer (just
   * after it, for a hit the grant table vouched for) says so, and the
   * mapping goes with its last reference. */
  CHECK(WAIT_UNTIL(!maps_has_range(addr, size), 3000, NULL), "the mapping of an ended buffer was kept");
  CHECK(sender_ask_int(&s, NULL, 0, "released 3") == 1, "release_fn of t3 did not run once");
  CHECK(sender_ask_int(&s, NULL, 0, "released 0") == 1, "the original's release_fn did not run once at the end");
  CHECK_SENDER_RC(&s, VMMIPC_OK, NULL, "wait 0 2000");
  CHECK(sender_ask_int(&s, NULL, 0, "live") == 0, "registrations left in the sender");
  exports = sender_ask_int(&s, NULL, 0, "exports");
  CHECK(exports == N, "export_fn ran %d times in all, want %d (one import, three hits)", exports, N);
  int s_now, s_peak;
  CHECK(sender_fds(&s, 0, &s_now, &s_peak) == 0 && s_now == 0, "the sender holds %d descriptor(s)", s_now);
  child_end(&s);
  return 0;
}

/* One waiter thread of test_wait. */
typedef struct waiter {
  const vmmipc_ticket *t;
  const int *released;
  int rc, released_at_return;
  double returned_ms;
} waiter;

static void *wait_thread(void *arg) {
  waiter *w = arg;
  w->rc = vmmipc_wait(w->t, 10000);
  w->released_at_return = __atomic_load_n(w->released, __ATOMIC_SEQ_CST);
  w->returned_ms = now_ms();
  return NULL;
}

/* Role wait_foreign HEX: vmmipc_wait in a process that registered nothing;
 * prints "RC MESSAGE". */
static int wait_foreign_main(int argc, char **argv) {
  vmmipc_ticket t;
  if (argc < 3 || hex_decode(argv[2], t.bytes, sizeof t.bytes)) return 2;
  int rc = vmmipc_wait(&t, 0);
  printf("%d %s\n", rc, vmmipc_last_error());
  return 0;
}

/* vmmipc_wait: ETIMEDOUT while live (timeout 0 polls), OK once ended and
 * released (and ever after), EAUTH for a wrong secret, ENOENT for tickets
 * this process did not issue, EINVAL for NULL. */
static int test_wait(void) {
  enum { SIZE = 4 * 4096 };
  int fd = own_memfd(SIZE, 1), released = 0;
  CHECK(fd >= 0, "memfd");
  vmmipc_options o = default_options();
  vmmipc_ticket t;
  CHECK_RC(vmmipc_register_host_file(fd, SIZE, 4096, on_release, &released, &o, &t), VMMIPC_OK);
  close(fd); /* the library holds its own duplicate */
  double t0 = now_ms();
  int rc = vmmipc_wait(&t, 0);
  double ms = now_ms() - t0;
  CHECK(rc == VMMIPC_ETIMEDOUT && strstr(vmmipc_last_error(), "still live"), "wait(0) on a live registration: %d %s",
        rc, vmmipc_last_error());
  CHECK(ms < 100, "wait with timeout 0 took %.1f ms", ms);
  printf("  %s -> %s\n", vmmipc_strerror(rc), vmmipc_last_error());
  t0 = now_ms();
  rc = vmmipc_wait(&t, 200);
  ms = now_ms() - t0;
  CHECK(rc == VMMIPC_ETIMEDOUT && ms >= 190 && ms < 2000, "wait(200) on a live registration: %d after %.0f ms", rc, ms);
  vmmipc_ticket forged = t;
  forged.bytes[TICKET_OFF_SECRET + 3] ^= 1;
  rc = vmmipc_wait(&forged, 0);
  CHECK(rc == VMMIPC_EAUTH, "wait with a wrong secret: %d %s", rc, vmmipc_last_error());
  forged = t;
  forged.bytes[TICKET_OFF_REG_ID + 5] ^= 1; /* an id this process never issued */
  CHECK_RC(vmmipc_wait(&forged, 0), VMMIPC_ENOENT);
  CHECK_RC(vmmipc_wait(NULL, 0), VMMIPC_EINVAL);

  /* A waiter returns once the registration is used up and released. */
  waiter wt = {.t = &t, .released = &released, .rc = 99};
  pthread_t th;
  pthread_create(&th, NULL, wait_thread, &wt);
  usleep(50 * 1000);
  vmmipc_mapping m;
  /* The use is spent once the last chunk is sent, which is before the
   * import returns: time the waiter from the import's start. */
  double importing = now_ms();
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &m), VMMIPC_OK);
  double imported = now_ms();
  CHECK(count_mismatches((const unsigned char *)(uintptr_t)m.addr, m.size, 0, 1) == 0, "bytes differ");
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  pthread_join(th, NULL);
  CHECK(wt.rc == VMMIPC_OK && wt.released_at_return == 1, "waiter: %d, release_fn calls when it returned: %d", wt.rc,
        wt.released_at_return);
  CHECK(wt.returned_ms >= importing && wt.returned_ms - importing < 2000,
        "the waiter returned %.1f ms after the import that used the registration up began", wt.returned_ms - importing);
  printf("  the waiter returned %.1f ms after the import that used the registration up began (the import took %.1f ms)\n",
         wt.returned_ms - importing, imported - importing);
  t0 = now_ms();
  CHECK_RC(vmmipc_wait(&t, 0), VMMIPC_OK); /* ended earlier: at once */
  CHECK(now_ms() - t0 < 100, "wait on an ended registration took %.0f ms", now_ms() - t0);
  CHECK(released == 1, "release_fn ran %d times", released);

  /* Unregistered: released before vmmipc_unregister returns (no export in
   * flight), so a wait right after is OK at once. */
  fd = own_memfd(SIZE, 1);
  o.uses = 0;
  CHECK_RC(vmmipc_register_host_file(fd, SIZE, 4096, on_release, &released, &o, &t), VMMIPC_OK);
  close(fd);
  CHECK_RC(vmmipc_wait(&t, 0), VMMIPC_ETIMEDOUT);
  CHECK_RC(vmmipc_unregister(&t), VMMIPC_OK);
  CHECK_RC(vmmipc_wait(&t, 0), VMMIPC_OK);
  CHECK(released == 2, "release_fn ran %d times in all, want 2", released);

  /* Tickets of another process: here, and where nothing was registered. */
  START_SENDER(s, theirs, "file", 1, 4096, 1, -1, 0);
  rc = vmmipc_wait(&theirs, 0);
  CHECK(rc == VMMIPC_ENOENT && strstr(vmmipc_last_error(), "another exporter"), "wait on a foreign ticket: %d %s", rc,
        vmmipc_last_error());
  char hex[2 * VMMIPC_TICKET_SIZE + 1], reply[700];
  hex_encode(theirs.bytes, sizeof theirs.bytes, hex);
  char *argv[] = {"vmmipc-test-wait", "wait_foreign", hex, NULL};
  child w;
  CHECK(child_spawn(&w, argv) == 0, "spawn");
  CHECK(fgets(reply, sizeof reply, w.out) != NULL, "no reply");
  child_end(&w);
  CHECK(atoi(reply) == VMMIPC_ENOENT, "wait in a process that registered nothing: %s", reply);
  child_end(&s);
  return 0;
}

/* vmmipc_live_many: 1 for live registrations of this process, 0 for ended
 * ones (used up or unregistered), a wrong secret, another process's ticket
 * and a malformed one; argument errors leave live_out untouched. */
static int test_live_many(void) {
  enum { SIZE = 4096 };
  int fd = own_memfd(SIZE, 1);
  CHECK(fd >= 0, "memfd");
  vmmipc_options o = default_options();
  o.uses = 0;
  vmmipc_ticket t[7];
  CHECK_RC(vmmipc_register_host_file(fd, SIZE, 4096, NULL, NULL, &o, &t[0]), VMMIPC_OK);
  close(fd);
  o.uses = 1;
  for (int i = 1; i <= 3; i++) CHECK_RC(vmmipc_register_again(&t[0], NULL, NULL, &o, &t[i]), VMMIPC_OK);
  vmmipc_mapping m;
  CHECK_RC(vmmipc_import_stream(&t[2], VMMIPC_DEVICE_HOST, NULL, &m), VMMIPC_OK); /* uses t[2] up */
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  CHECK_RC(vmmipc_unregister(&t[3]), VMMIPC_OK);
  t[4] = t[1];
  t[4].bytes[TICKET_OFF_SECRET + 3] ^= 1;
  START_SENDER(s, theirs, "file", 1, 4096, 1, -1, 0);
  t[5] = theirs;
  t[6] = t[1];
  t[6].bytes[TICKET_OFF_ADDR_KIND] = 9; /* no such address kind: malformed */
  const uint8_t want[7] = {1, 1, 0, 0, 0, 0, 0};
  uint8_t live[7];
  double deadline = now_ms() + 5000; /* the used-up grant ends once its receiver answered */
  do {
    memset(live, 7, sizeof live);
    CHECK_RC(vmmipc_live_many(t, 7, live), VMMIPC_OK);
  } while (memcmp(live, want, sizeof live) && now_ms() < deadline && usleep(1000) == 0);
  CHECK(!memcmp(live, want, sizeof live), "live: %d %d %d %d %d %d %d, want 1 1 0 0 0 0 0 (anchor, grant, used up, "
        "unregistered, wrong secret, another process's, malformed)", live[0], live[1], live[2], live[3], live[4], live[5],
        live[6]);
  child_end(&s);

  memset(live, 7, sizeof live);
  CHECK_RC(vmmipc_live_many(NULL, 1, live), VMMIPC_EINVAL);
  CHECK_RC(vmmipc_live_many(t, 1, NULL), VMMIPC_EINVAL);
  CHECK_RC(vmmipc_live_many(t, (size_t)1048576 + 1, live), VMMIPC_EINVAL);
  CHECK(strstr(vmmipc_last_error(), "split them") != NULL, "too many: %s", vmmipc_last_error());
  CHECK(live[0] == 7, "an argument error wrote live_out");
  CHECK_RC(vmmipc_live_many(NULL, 0, NULL), VMMIPC_OK);
  CHECK_RC(vmmipc_unregister(&t[1]), VMMIPC_OK);
  CHECK_RC(vmmipc_unregister(&t[0]), VMMIPC_OK);
  return 0;
}

/* vmmipc_register_host_file holds its own duplicate of the memfd: the
 * caller may close its fd at once, and a different file that later gets
 * the same number is never sent. */
static int test_host_file_close_and_reuse(void) {
  START_SENDER(s, t, "file", 64, 4096, 2, -1, 0);
  char reply[64];
  CHECK(child_ask(&s, reply, sizeof reply, "close-reuse") == 0 && strcmp(reply, "same 1") == 0,
        "the sender's new memfd did not take the closed one's number: %s", reply);
  int s_now, s_peak;
  CHECK(sender_fds(&s, 1, &s_now, &s_peak) == 0 && s_now == 1,
        "the sender holds %d descriptor(s) more than before registering, want 1 (the library's duplicate)", s_now);
  int n = sender_ask_int(&s, NULL, 0, "memfds");
  CHECK(n == 1, "descriptors of the registered memfd in the sender: %d, want 1 (the library's)", n);
  /* Both uses: each exports anew from the library's duplicate (the first
   * skips the cache, so the second is no hit). */
  for (int use = 0; use < 2; use++) {
    vmmipc_options o = default_options();
    o.import_flags = use == 0 ? VMMIPC_IMPORT_NO_CACHE : 0;
    vmmipc_mapping m;
    CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, &o, &m), VMMIPC_OK);
    unsigned char *p = (unsigned char *)(uintptr_t)m.addr;
    uint64_t bad1 = count_mismatches(p, m.size, 0, 1), bad2 = count_mismatches(p, m.size, 0, 2);
    CHECK(bad1 == 0, "use %d: %llu bytes differ from the registered file (%llu from the file now at its number)", use,
          (unsigned long long)bad1, (unsigned long long)bad2);
    p[4097] = (unsigned char)(0x30 + use);
    CHECK(child_ask(&s, reply, sizeof reply, "peek 4097") == 0 && atoi(reply) == 0x30 + use,
          "use %d: the sender's mapping of the registered file sees %s, not our write", use, reply);
    p[4097] = pattern(4097, 1);
    CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  }
  CHECK(sender_fds(&s, 0, &s_now, &s_peak) == 0 && s_now == 0,
        "after the last use the sender holds %d descriptor(s) more than before registering", s_now);
  CHECK(s_peak <= 8, "sender peak %d extra fds", s_peak);
  n = sender_ask_int(&s, NULL, 0, "memfds");
  CHECK(n == 0, "the library kept %d descriptor(s) of the memfd after its registration ended", n);
  child_end(&s);
  return 0;
}

/* expect_refused_file registers fd expecting VMMIPC_EINVAL with a message
 * holding every needle (NULL-terminated). */
static int expect_refused_file(const char *what, int fd, uint64_t size, uint64_t chunk, const vmmipc_options *o,
                               int *released, const char *const *needles) {
  vmmipc_ticket t;
  int rc = vmmipc_register_host_file(fd, size, chunk, on_release, released, o, &t);
  if (rc == VMMIPC_OK) vmmipc_unregister(&t);
  CHECK(rc == VMMIPC_EINVAL, "%s: returned %d (%s): %s", what, rc, vmmipc_strerror(rc), vmmipc_last_error());
  for (; needles && *needles; needles++)
    CHECK(strstr(vmmipc_last_error(), *needles), "%s: the message lacks \"%s\": %s", what, *needles,
          vmmipc_last_error());
  printf("  %-28s -> %s\n", what, vmmipc_last_error());
  return 0;
}

#define NEEDLES(...) ((const char *const[]){__VA_ARGS__, NULL})

/* vmmipc_register_host_file refuses what it cannot serve safely, saying
 * why, and takes nothing: no descriptor, no registration, no release_fn. */
static int test_host_file_refused(void) {
  enum { SIZE = 16 * 4096 };
  int released = 0, base = count_fds(0);
  uint64_t live0 = 0, live1 = 0;
  CHECK_RC(vmmipc_live_registrations(&live0), VMMIPC_OK);
  vmmipc_options o = default_options();

  char disk[] = "/tmp/vmmipc-test-XXXXXX";
  int fd = mkstemp(disk);
  CHECK(fd >= 0 && ftruncate(fd, SIZE) == 0, "%s", disk);
  unlink(disk);
  if (expect_refused_file("a disk file", fd, SIZE, 4096, &o, &released, NEEDLES("cannot be sealed"))) return 1;
  close(fd);
  fd = memfd_create("vmmipc-test-unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  CHECK(fd >= 0 && ftruncate(fd, SIZE) == 0, "memfd");
  if (expect_refused_file("an unsealed memfd", fd, SIZE, 4096, &o, &released,
                          NEEDLES("not sealed against shrinking", "F_SEAL_SHRINK")))
    return 1;
  close(fd);
  fd = memfd_create("vmmipc-test-unsealable", MFD_CLOEXEC);
  CHECK(fd >= 0 && ftruncate(fd, SIZE) == 0, "memfd");
  if (expect_refused_file("a memfd without sealing", fd, SIZE, 4096, &o, &released,
                          NEEDLES("can no longer be", "MFD_ALLOW_SEALING")))
    return 1;
  close(fd);
  int pipefd[2];
  CHECK(pipe2(pipefd, O_CLOEXEC) == 0, "pipe");
  if (expect_refused_file("a pipe", pipefd[0], SIZE, 4096, &o, &released, NEEDLES("not a regular file"))) return 1;
  close(pipefd[0]);
  close(pipefd[1]);
  if (expect_refused_file("fd -1", -1, SIZE, 4096, &o, &released, NULL)) return 1;
  if (expect_refused_file("a closed fd", 1000, SIZE, 4096, &o, &released, NEEDLES("fd 1000"))) return 1;

  fd = own_memfd(SIZE, 1);
  CHECK(fd >= 0, "memfd");
  if (expect_refused_file("size 0", fd, 0, 4096, &o, &released, NULL)) return 1;
  if (expect_refused_file("a size beyond the file", fd, SIZE + 4096, 4096, &o, &released, NEEDLES("fewer than")))
    return 1;
  if (expect_refused_file("chunk size 0", fd, SIZE, 0, &o, &released, NULL)) return 1;
  if (expect_refused_file("chunk size off the page size", fd, SIZE, 4096 + 512, &o, &released, NEEDLES("page size")))
    return 1;
  if (expect_refused_file("more than VMMIPC_MAX_CHUNKS", fd, (VMMIPC_MAX_CHUNKS + 1) * 4096, 4096, &o, &released,
                          NEEDLES("limit")))
    return 1;
  o.ttl_ms = VMMIPC_MAX_TTL_MS + 1;
  if (expect_refused_file("ttl above VMMIPC_MAX_TTL_MS", fd, SIZE, 4096, &o, &released, NEEDLES("ttl_ms"))) return 1;
  CHECK_RC(vmmipc_register_host_file(fd, SIZE, 4096, NULL, NULL, NULL, NULL), VMMIPC_EINVAL);
  close(fd);
  /* A tmpfs file is not a memfd, and can never be sealed (the kernel reports
   * F_SEAL_SEAL for it): the message must say so, not call it a memfd. */
  o = default_options();
  char shm[] = "/dev/shm/vmmipc-test-XXXXXX";
  fd = mkstemp(shm);
  CHECK(fd >= 0 && ftruncate(fd, SIZE) == 0, "%s", shm);
  unlink(shm);
  if (expect_refused_file("a /dev/shm file", fd, SIZE, 4096, &o, &released, NEEDLES("cannot be sealed", "/dev/shm", "memfd_create")))
    return 1;
  close(fd);

  CHECK(released == 0, "release_fn ran %d times for refused registrations", released);
  CHECK_RC(vmmipc_live_registrations(&live1), VMMIPC_OK);
  CHECK(live1 == live0, "live registrations %llu -> %llu", (unsigned long long)live0, (unsigned long long)live1);
  CHECK(count_fds(0) == base, "fds %d, baseline %d: a refused registration kept a descriptor", count_fds(0), base);
  return 0;
}

/* Registering the same memfd again while it is registered gives a ticket of
 * the same identity (a cache hit in the receiver) and takes no descriptor;
 * the library's one duplicate closes when the last registration ends. */
static int test_host_file_same_memfd(void) {
  START_CACHED(s, t0, addr, size, "file", 64, 4096, 0, -1, 0);
  int s_now, s_peak;
  CHECK(sender_fds(&s, 1, &s_now, &s_peak) == 0 && s_now == 1, "sender: %d descriptor(s) for one registration", s_now);
  char err[700];
  vmmipc_ticket t1;
  CHECK(sender_ask_ticket(&s, &t1, err, sizeof err, "file-again 1 0") == 0, "registering the memfd again: %s", err);
  CHECK(sender_fds(&s, 1, &s_now, &s_peak) == 0 && s_now == 1,
        "registering the same memfd again took a descriptor: %d held", s_now);
  int n = sender_ask_int(&s, NULL, 0, "memfds");
  CHECK(n == 2, "descriptors of the memfd in the sender: %d, want 2 (its own and the library's one)", n);
  CHECK(sender_ask_int(&s, NULL, 0, "live") == 2, "the sender does not have two live registrations");
  if (expect_hit(&t1, addr, "the same memfd registered again")) return 1;
  CHECK(sender_ask_int(&s, NULL, 0, "released 1") == 1, "the used-up registration was not released once");
  CHECK(sender_fds(&s, 1, &s_now, &s_peak) == 0 && s_now == 1,
        "with the first registration still live the sender holds %d descriptor(s), want 1", s_now);
  CHECK_SENDER_RC(&s, VMMIPC_OK, NULL, "unregister 0");
  CHECK(sender_fds(&s, 0, &s_now, &s_peak) == 0 && s_now == 0,
        "after the last registration ended the sender holds %d descriptor(s)", s_now);
  n = sender_ask_int(&s, NULL, 0, "memfds");
  CHECK(n == 1, "descriptors of the memfd in the sender: %d, want 1 (its own)", n);
  double took = 0;
  CHECK(WAIT_UNTIL(!maps_has_range(addr, size), 2000, &took), "the cached mapping outlived the buffer by 2 s");
  printf("  the cached mapping was invalidated %.0f ms after the buffer ended\n", took);
  child_end(&s);
  return 0;
}

/* Host chunks from an export_fn must be sealed memfds: receivers refuse
 * others with VMMIPC_EINVAL, naming the chunk, and undo everything. In
 * lockstep (window 1) the receiver refuses chunk 0 before it asks for the
 * next, so not every chunk was sent and the use comes back. (With a wider
 * window the sender may have sent all 8 by then: the use is then spent.) */
static int test_unsealed_export_refused(void) {
  START_SENDER(s, t, "unsealed", 8, 4096, 1, -1, 0);
  int base = count_fds(0);
  static maps_snapshot before;
  maps_take(&before);
  vmmipc_options o = default_options();
  o.window = 1;
  for (int attempt = 0; attempt < 2; attempt++) {
    vmmipc_mapping m = {0};
    int rc = vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, &o, &m);
    CHECK(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "chunk 0 of 8") &&
              strstr(vmmipc_last_error(), "not sealed against shrinking"),
          "attempt %d: import of unsealed chunks returned %d: %s", attempt, rc, vmmipc_last_error());
    CHECK(m.addr == 0, "mapping_out touched on failure");
    if (attempt == 0) printf("  %s\n", vmmipc_last_error());
  }
  vmmipc_stream *st = NULL;
  CHECK_RC(vmmipc_open(&t, &o, &st), VMMIPC_OK); /* the use is still there */
  CHECK_RC(vmmipc_close(st), VMMIPC_OK);
  CHECK(count_fds(0) == base, "fds %d, baseline %d", count_fds(0), base);
  CHECK(maps_new_reservations(&before, 8 * 4096) == 0, "a failed import left its reservation mapped");
  CHECK(maps_memfd_count() == 0, "memfd mappings left");
  child_end(&s);
  return 0;
}

/* The option bounds are the header's VMMIPC_MAX_* macros: one above is
 * refused with a message naming the field, the bound itself is accepted. */
static int test_option_bounds(void) {
  CHECK(VMMIPC_MAX_WINDOW == 1024 && VMMIPC_MAX_ACCESS_DEVICES == 64 && VMMIPC_MAX_TTL_MS == 1ull << 40 &&
            VMMIPC_MAX_CHUNKS == 1ull << 26,
        "the header's bounds changed");
  START_SENDER(s, t, "file", 4, 4096, 0, -1, 0);
  vmmipc_stream *st = NULL;
  vmmipc_mapping m = {0};
  vmmipc_options o = default_options();
  o.window = VMMIPC_MAX_WINDOW + 1;
  int rc = vmmipc_open(&t, &o, &st);
  CHECK(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "window 1025"), "window 1025: %d %s", rc, vmmipc_last_error());
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, &o, &m), VMMIPC_EINVAL);
  o.window = VMMIPC_MAX_WINDOW;
  CHECK_RC(vmmipc_open(&t, &o, &st), VMMIPC_OK);
  CHECK_RC(vmmipc_close(st), VMMIPC_OK);

  int32_t access[VMMIPC_MAX_ACCESS_DEVICES + 1] = {0};
  o = default_options();
  o.access_devices = access;
  o.access_device_count = VMMIPC_MAX_ACCESS_DEVICES + 1;
  rc = vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, &o, &m);
  CHECK(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "limit of 64"), "65 access devices: %d %s", rc,
        vmmipc_last_error());
  o.access_device_count = VMMIPC_MAX_ACCESS_DEVICES; /* within the bound: refused for another reason */
  rc = vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, &o, &m);
  CHECK(rc == VMMIPC_EINVAL && !strstr(vmmipc_last_error(), "limit") && strstr(vmmipc_last_error(), "CUDA memory only"),
        "64 access devices on a host ticket: %d %s", rc, vmmipc_last_error());
  o.access_devices = NULL;
  o.access_device_count = 1;
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, &o, &m), VMMIPC_EINVAL);

  uint64_t sizes[1] = {4096};
  vmmipc_ticket r;
  o = default_options();
  o.ttl_ms = VMMIPC_MAX_TTL_MS + 1;
  rc = vmmipc_register(sizes, 1, export_memfd, NULL, NULL, &o, &r);
  CHECK(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "ttl_ms"), "ttl_ms 2^40+1: %d %s", rc, vmmipc_last_error());
  o.ttl_ms = VMMIPC_MAX_TTL_MS;
  CHECK_RC(vmmipc_register(sizes, 1, export_memfd, NULL, NULL, &o, &r), VMMIPC_OK);
  CHECK_RC(vmmipc_unregister(&r), VMMIPC_OK);
  o = default_options();
  o.memory_kind = 3;
  rc = vmmipc_register(sizes, 1, export_memfd, NULL, NULL, &o, &r);
  CHECK(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "memory_kind 3"), "memory_kind 3: %d %s", rc,
        vmmipc_last_error());
  /* A count above the bound is refused before the array is read (it holds
   * one element: reading 2^26 + 1 would fault). */
  rc = vmmipc_register(sizes, VMMIPC_MAX_CHUNKS + 1, export_memfd, NULL, NULL, NULL, &r);
  CHECK(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "limit"), "count 2^26+1: %d %s", rc, vmmipc_last_error());
  uint64_t handles[1] = {1};
  CHECK_RC(vmmipc_register_cuda_handles(handles, sizes, VMMIPC_MAX_CHUNKS + 1, NULL, NULL, NULL, &r), VMMIPC_EINVAL);

  /* A caller built against a struct that ends before import_flags: the
   * field is not read, whatever follows in memory. */
  vmmipc_options old;
  memset(&old, 0xFF, sizeof old);
  CHECK_RC(vmmipc_options_init(&old, offsetof(vmmipc_options, import_flags)), VMMIPC_OK);
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, &old, &m), VMMIPC_OK);
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  CHECK_SENDER_RC(&s, VMMIPC_OK, NULL, "unregister 0");
  child_end(&s);
  return 0;
}

/* vmmipc_strerror names every status, the new ones included, and never
 * returns NULL. */
static int test_status_names(void) {
  static const struct {
    int status;
    const char *name;
  } names[] = {
      {VMMIPC_OK, "VMMIPC_OK"},           {VMMIPC_END, "VMMIPC_END"},         {VMMIPC_EINVAL, "VMMIPC_EINVAL"},
      {VMMIPC_EBADF, "VMMIPC_EBADF"},     {VMMIPC_EAUTH, "VMMIPC_EAUTH"},     {VMMIPC_ENOENT, "VMMIPC_ENOENT"},
      {VMMIPC_EIO, "VMMIPC_EIO"},         {VMMIPC_EEXPORT, "VMMIPC_EEXPORT"}, {VMMIPC_ECUDA, "VMMIPC_ECUDA"},
      {VMMIPC_ENFILE, "VMMIPC_ENFILE"},   {VMMIPC_EFORK, "VMMIPC_EFORK"},     {VMMIPC_EINTERNAL, "VMMIPC_EINTERNAL"},
      {VMMIPC_ENOMEM, "VMMIPC_ENOMEM"},   {VMMIPC_ETIMEDOUT, "VMMIPC_ETIMEDOUT"}, {VMMIPC_ECONFIG, "VMMIPC_ECONFIG"},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    const char *s = vmmipc_strerror(names[i].status);
    size_t n = strlen(names[i].name);
    CHECK(s && strncmp(s, names[i].name, n) == 0 && s[n] == ':' && strlen(s) > n + 2, "strerror(%d) = \"%s\"",
          names[i].status, s ? s : "(null)");
    printf("  %4d %s\n", names[i].status, s);
  }
  const char *u = vmmipc_strerror(-99);
  CHECK(u && strstr(u, "UNKNOWN"), "strerror(-99) = \"%s\"", u ? u : "(null)");
  return 0;
}
/* A bad argument is refused with a message that says which argument and
 * what is wrong with the value given: "opts is NULL" or "size is 4", never
 * "opts is NULL or size 4 is too small"; "count is 0" or "count N is above
 * the limit", never "count 0 is 0 or above the limit". Nothing is
 * registered. */
static int test_argument_messages(void) {
  uint64_t live0 = 0, live1 = 0;
  CHECK_RC(vmmipc_live_registrations(&live0), VMMIPC_OK);
  vmmipc_options o;
  CHECK_SAYS(vmmipc_options_init(NULL, sizeof o), VMMIPC_EINVAL, "vmmipc_options_init: opts is NULL", " or ");
  CHECK_SAYS(vmmipc_options_init(&o, 4), VMMIPC_EINVAL,
             "vmmipc_options_init: size is 4, smaller than the 8 bytes of struct_size and uses", "NULL");
  o = default_options();
  o.struct_size = 0; /* a struct that vmmipc_options_init never filled */
  uint64_t sizes[2] = {4096, 4096}, handles[2] = {1, 2};
  vmmipc_ticket t;
  CHECK_SAYS(vmmipc_register(sizes, 2, export_memfd, NULL, NULL, &o, &t), VMMIPC_EINVAL,
             "opts->struct_size is 0, smaller than the 4 bytes of struct_size itself", NULL);
  CHECK(strstr(vmmipc_last_error(), "vmmipc_options_init"), "the message does not say to call vmmipc_options_init");
  /* Fields a register call does not use are checked all the same (vmmipc.h,
   * vmmipc_options). */
  o = default_options();
  o.access_device_count = 1;
  CHECK_SAYS(vmmipc_register(sizes, 2, export_memfd, NULL, NULL, &o, &t), VMMIPC_EINVAL,
             "access_devices is NULL but access_device_count is 1", NULL);
  CHECK_SAYS(vmmipc_register(sizes, 0, export_memfd, NULL, NULL, NULL, &t), VMMIPC_EINVAL,
             "vmmipc_register: count is 0: register at least one chunk", "limit");
  CHECK_SAYS(vmmipc_register(NULL, 0, export_memfd, NULL, NULL, NULL, &t), VMMIPC_EINVAL,
             "vmmipc_register: count is 0", "NULL");
  CHECK_SAYS(vmmipc_register(sizes, VMMIPC_MAX_CHUNKS + 1, export_memfd, NULL, NULL, NULL, &t), VMMIPC_EINVAL,
             "vmmipc_register: count 67108865 is above the limit of 67108864 chunks", "is 0");
  CHECK_SAYS(vmmipc_register(NULL, 2, export_memfd, NULL, NULL, NULL, &t), VMMIPC_EINVAL,
             "vmmipc_register: sizes is NULL", "count");
  CHECK_SAYS(vmmipc_register_cuda_handles(handles, sizes, 0, NULL, NULL, NULL, &t), VMMIPC_EINVAL,
             "vmmipc_register_cuda_handles: count is 0", "limit");
  CHECK_SAYS(vmmipc_register_cuda_handles(handles, NULL, 2, NULL, NULL, NULL, &t), VMMIPC_EINVAL,
             "vmmipc_register_cuda_handles: sizes is NULL", NULL);
  vmmipc_stream *st = NULL;
  vmmipc_ticket_info info;
  CHECK_SAYS(vmmipc_open(NULL, NULL, &st), VMMIPC_EINVAL, "vmmipc_open: ticket is NULL", NULL);
  CHECK_SAYS(vmmipc_ticket_decode(NULL, &info), VMMIPC_EINVAL, "vmmipc_ticket_decode: ticket is NULL", NULL);
  CHECK_SAYS(vmmipc_confirm(NULL, NULL), VMMIPC_EINVAL, "vmmipc_confirm: ticket is NULL", NULL);
  CHECK_SAYS(vmmipc_confirm_many(NULL, 1, NULL, NULL), VMMIPC_EINVAL,
             "vmmipc_confirm_many: tickets is NULL", NULL);
  CHECK_RC(vmmipc_confirm_many(NULL, 0, NULL, NULL), VMMIPC_OK);
  CHECK_SAYS(vmmipc_wait(NULL, 0), VMMIPC_EINVAL, "vmmipc_wait: ticket is NULL", NULL);
  CHECK_RC(vmmipc_live_registrations(&live1), VMMIPC_OK);
  CHECK(live1 == live0, "live registrations %llu -> %llu", (unsigned long long)live0, (unsigned long long)live1);
  return 0;
}

/* vmmipc_last_error (Conventions): "" before this thread's first failure;
 * after one, its detail, which successful calls (VMMIPC_OK and VMMIPC_END)
 * and other threads' failures leave as it was and only this thread's next
 * failure replaces; the same pointer throughout. */
static void *fail_on_another_thread(void *arg) {
  *(int *)arg = vmmipc_last_error()[0] == '\0'; /* a new thread starts with "" */
  return (void *)(intptr_t)vmmipc_import_stream(NULL, VMMIPC_DEVICE_HOST, NULL, NULL);
}

static int test_last_error_kept(void) {
  CHECK_RC(vmmipc_live_registrations(NULL), VMMIPC_EINVAL);
  const char *p = vmmipc_last_error();
  char first[2048];
  snprintf(first, sizeof first, "%s", p);
  CHECK(strstr(first, "NULL") != NULL, "the failure's detail: \"%s\"", first);
  uint64_t n = 0;
  CHECK_RC(vmmipc_live_registrations(&n), VMMIPC_OK);
  vmmipc_cache_info ci;
  CHECK_RC(vmmipc_cache_get_info(&ci, sizeof ci), VMMIPC_OK);
  START_SENDER(s, t, "file", 2, 4096, 1, -1, 0);
  vmmipc_stream *st = NULL;
  CHECK_RC(vmmipc_open(&t, NULL, &st), VMMIPC_OK);
  vmmipc_chunk ch;
  for (int i = 0; i < 2; i++) {
    CHECK_RC(vmmipc_pull_next(st, &ch), VMMIPC_OK);
    close(ch.fd);
  }
  CHECK_RC(vmmipc_pull_next(st, &ch), VMMIPC_END);
  CHECK_RC(vmmipc_close(st), VMMIPC_OK);
  child_end(&s);
  pthread_t th;
  void *other = NULL;
  int fresh = 0;
  CHECK(pthread_create(&th, NULL, fail_on_another_thread, &fresh) == 0, "pthread_create");
  pthread_join(th, &other);
  CHECK(fresh, "a new thread's last error was not \"\" before its first failure");
  CHECK((int)(intptr_t)other == VMMIPC_EINVAL, "the other thread's import: %d", (int)(intptr_t)other);
  CHECK(vmmipc_last_error() == p, "the pointer changed after successful calls");
  CHECK(strcmp(p, first) == 0, "successful calls or another thread changed it: \"%s\", was \"%s\"", p, first);
  CHECK_RC(vmmipc_import_stream(NULL, VMMIPC_DEVICE_HOST, NULL, NULL), VMMIPC_EINVAL);
  CHECK(vmmipc_last_error() == p, "the pointer changed after a failure");
  CHECK(strcmp(p, first) != 0 && strstr(p, "import_stream") != NULL, "the next failure did not replace it: \"%s\"", p);
  printf("  kept: \"%s\"\n  replaced by: \"%s\"\n", first, p);
  return 0;
}
#endif
