/* Tests of the import cache (vmmipc_import_stream, vmmipc_cache_set_limit,
 * vmmipc_cache_get_info, VMMIPC_CACHE_BYTES) through the header only: the
 * API itself, the environment variable, eviction under the byte bound and
 * invalidation when the sender unregisters or dies. Part of test_vmmipc.c. */
#ifndef VMMIPC_CACHE_TESTS_H
#define VMMIPC_CACHE_TESTS_H

#include "contract_tests.h"
#include "sender.h"
#include "testutil.h"

#define KIB 1024ull

/* The API: NULL refused, a smaller size writes no byte past it, the limit
 * is set and read back, unknown import_flags bits are refused before any
 * use is spent. */
static int test_cache_api(void) {
  CHECK_RC(vmmipc_cache_get_info(NULL, sizeof(vmmipc_cache_info)), VMMIPC_EINVAL);
  vmmipc_cache_info full = cache_info();
  if (!getenv("VMMIPC_CACHE_BYTES"))
    CHECK(full.limit_bytes == 32ull << 30, "default limit %llu, the header says 32 GiB",
          (unsigned long long)full.limit_bytes);
  struct {
    vmmipc_cache_info i;
    unsigned char after[64];
  } buf;
  const size_t sizes[] = {0, sizeof(uint64_t), offsetof(vmmipc_cache_info, hits), sizeof(vmmipc_cache_info) - 1};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    memset(&buf, 0xAB, sizeof buf);
    CHECK_RC(vmmipc_cache_get_info(&buf.i, sizes[k]), VMMIPC_OK);
    const unsigned char *b = (const unsigned char *)&buf;
    for (size_t j = sizes[k]; j < sizeof buf; j++)
      CHECK(b[j] == 0xAB, "size %zu: byte %zu past it was written", sizes[k], j);
    if (sizes[k] >= sizeof(uint64_t))
      CHECK(buf.i.limit_bytes == full.limit_bytes, "size %zu: limit %llu, want %llu", sizes[k],
            (unsigned long long)buf.i.limit_bytes, (unsigned long long)full.limit_bytes);
  }
  CHECK_RC(vmmipc_cache_set_limit(12345), VMMIPC_OK);
  CHECK(cache_info().limit_bytes == 12345, "limit %llu after setting 12345",
        (unsigned long long)cache_info().limit_bytes);
  CHECK_RC(vmmipc_cache_set_limit(full.limit_bytes), VMMIPC_OK);

  START_SENDER(s, t, "file", 4, 4096, 1, -1, 0);
  const uint32_t bad_flags[] = {0x8, 0x7, 0x80000000u};
  for (size_t k = 0; k < sizeof bad_flags / sizeof bad_flags[0]; k++) {
    vmmipc_options o = default_options();
    o.import_flags = bad_flags[k];
    vmmipc_mapping m = {0};
    int rc = vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, &o, &m);
    CHECK(rc == VMMIPC_EINVAL && strstr(vmmipc_last_error(), "import_flags") && m.addr == 0,
          "import_flags %#x: %d %s", bad_flags[k], rc, vmmipc_last_error());
  }
  vmmipc_mapping m;
  if (import_verify(&t, 1, &m)) return 1; /* the refusals spent nothing */
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  child_end(&s);
  return 0;
}

/* vmmipc_confirm spends one use and receives nothing: the sender's
 * registration made from a mapped buffer ends (its release_fn runs) with
 * no export and no descriptor here; a used-up ticket is ENOENT, a forged
 * one EAUTH (spending nothing). VMMIPC_IMPORT_CONFIRM_LATER: a hit returns
 * at once with no descriptor opened, even while the sender is stopped and
 * could answer nothing, and the use is spent by a library thread once it
 * runs again (confirms_pending drops to 0; the sender's registration ends). */
static int test_confirm(void) {
  enum { N = 8, CS = 4096 };
  START_CACHED(s, t0, addr, size, "callback", N, CS, 0, -1, 0);
  char err[700];
  vmmipc_ticket t1, t2;
  CHECK(sender_ask_ticket(&s, &t1, err, sizeof err, "again 0 1 0") == 0, "register_again: %s", err);
  vmmipc_ticket forged = t1;
  forged.bytes[VMMIPC_TICKET_SIZE - 1] ^= 1;
  int rc = vmmipc_confirm(&forged, NULL);
  CHECK(rc == VMMIPC_EAUTH || rc == VMMIPC_EINVAL, "confirm of a forged ticket: %d %s", rc, vmmipc_last_error());
  CHECK_SENDER_RC(&s, VMMIPC_ETIMEDOUT, "still live", "wait 1 0");
  int base = count_fds(0);
  CHECK_RC(vmmipc_confirm(&t1, NULL), VMMIPC_OK);
  CHECK(count_fds(0) == base, "confirm left %d descriptors", count_fds(0) - base);
  CHECK_SENDER_RC(&s, VMMIPC_OK, NULL, "wait 1 2000");
  CHECK(sender_ask_int(&s, NULL, 0, "released 1") == 1, "release_fn of the confirmed registration did not run once");
  rc = vmmipc_confirm(&t1, NULL);
  CHECK(rc == VMMIPC_ENOENT, "confirm of a used-up ticket: %d %s", rc, vmmipc_last_error());
  CHECK_RC(vmmipc_confirm(NULL, NULL), VMMIPC_EINVAL);

  CHECK(sender_ask_ticket(&s, &t2, err, sizeof err, "again 0 1 0") == 0, "register_again: %s", err);
  vmmipc_options o = default_options();
  o.import_flags = VMMIPC_IMPORT_CONFIRM_LATER;
  vmmipc_cache_info c0 = cache_info();
  vmmipc_mapping m;
  fd_sampler fs;
  fd_sampler_start(&fs, 0);
  CHECK(kill(s.pid, SIGSTOP) == 0, "SIGSTOP: %s", strerror(errno));
  double t_hit = now_ms();
  rc = vmmipc_import_stream(&t2, VMMIPC_DEVICE_HOST, &o, &m);
  t_hit = now_ms() - t_hit;
  int queued = (int)cache_info().confirms_pending;
  CHECK(kill(s.pid, SIGCONT) == 0, "SIGCONT: %s", strerror(errno));
  int peak = fd_sampler_stop(&fs);
  CHECK(rc == VMMIPC_OK, "deferred hit: %d %s", rc, vmmipc_last_error());
  CHECK(t_hit < 1000 && queued >= 1, "a deferred hit with the sender stopped took %.0f ms, %d confirmations queued",
        t_hit, queued);
  CHECK(m.addr == addr && cache_info().hits == c0.hits + 1, "a deferred hit is at %#llx (cached at %#llx)",
        (unsigned long long)m.addr, (unsigned long long)addr);
  CHECK(peak - base <= 2, "the deferred hit and its confirmation took %d descriptors", peak - base);
  CHECK_SENDER_RC(&s, VMMIPC_OK, NULL, "wait 2 5000");
  vmmipc_cache_info c1 = cache_info();
  for (int i = 0; i < 200 && c1.confirms_pending; i++, usleep(10000)) c1 = cache_info();
  CHECK(c1.confirms_pending == 0 && c1.confirms_failed == c0.confirms_failed, "confirmations pending %llu, failed %llu",
        (unsigned long long)c1.confirms_pending, (unsigned long long)(c1.confirms_failed - c0.confirms_failed));
  CHECK(count_mismatches((const unsigned char *)(uintptr_t)m.addr, m.size, 0, 1) == 0, "bytes differ");
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  CHECK(sender_ask_int(&s, NULL, 0, "exports") == N, "confirmations exported chunks");
  child_end(&s);
  return 0;
}

/* Role cache_env_receiver HEX: prints "limit N", imports the ticket and
 * prints "import RC MESSAGE", then (after unmapping) "kept ENTRIES". */
static int cache_env_receiver_main(int argc, char **argv) {
  vmmipc_ticket t;
  if (argc < 3 || hex_decode(argv[2], t.bytes, sizeof t.bytes)) return 2;
  printf("limit %llu\n", (unsigned long long)cache_info().limit_bytes);
  vmmipc_mapping m;
  int rc = vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &m);
  printf("import %d %s\n", rc, rc ? vmmipc_last_error() : "");
  if (rc == VMMIPC_OK) {
    vmmipc_unmap(&m);
    printf("kept %llu\n", (unsigned long long)cache_info().entries);
  }
  return 0;
}

/* VMMIPC_CACHE_BYTES, read in a child: byte counts with K/M/G suffixes,
 * 0 = off, and a bad value refused at import with a message naming it. */
static int test_cache_env(void) {
  enum { TOTAL = 64 * 1024 };
  START_SENDER(s, t, "file", 16, 4096, 0, -1, 0);
  char hex[2 * VMMIPC_TICKET_SIZE + 1];
  hex_encode(t.bytes, sizeof t.bytes, hex);
  static const struct {
    const char *value;    /* NULL: unset */
    long long limit;      /* -1: a bad value */
    int kept;             /* entries after the unmap */
  } cases[] = {
      {NULL, 32ll << 30, 1},    {"0", 0, 0},          {"65536", 65536, 1},  {"64K", 65536, 1},
      {"1MiB", 1 << 20, 1},     {"8G", 8ll << 30, 1}, {"32768", 32768, 0},  {"lots", -1, 0},
      {"-1", -1, 0},            {"12Q", -1, 0},       {"", -1, 0},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    char var[128];
    char **env = env_with("VMMIPC_CACHE_BYTES", cases[k].value, var, sizeof var);
    char *argv[] = {"vmmipc-test-cache-env", "cache_env_receiver", hex, NULL};
    child c;
    child_opts o = {.envp = env};
    int rc = child_spawn_with(&c, "/proc/self/exe", argv, &o);
    free(env);
    CHECK(rc == 0, "spawn");
    char l1[128] = "", l2[700] = "", l3[64] = "";
    int got = fgets(l1, sizeof l1, c.out) && fgets(l2, sizeof l2, c.out);
    if (got && atoi(l2 + 7) == VMMIPC_OK && !fgets(l3, sizeof l3, c.out)) got = 0;
    int st = child_end(&c);
    l1[strcspn(l1, "\n")] = l2[strcspn(l2, "\n")] = l3[strcspn(l3, "\n")] = 0;
    const char *shown = cases[k].value ? cases[k].value : "(unset)";
    CHECK(got && WIFEXITED(st) && WEXITSTATUS(st) == 0, "VMMIPC_CACHE_BYTES=%s: child said \"%s\" \"%s\", status %#x",
          shown, l1, l2, st);
    unsigned long long limit = strtoull(l1 + 6, NULL, 10);
    int import_rc = atoi(l2 + 7);
    printf("  VMMIPC_CACHE_BYTES=%-8s -> %s; %s %s\n", shown, l1, l2, l3);
    if (cases[k].limit < 0) {
      CHECK(import_rc == VMMIPC_ECONFIG && strstr(l2, "VMMIPC_CACHE_BYTES"),
            "a bad value %s: import said \"%s\", want VMMIPC_ECONFIG naming the variable", shown, l2);
      continue;
    }
    CHECK(limit == (unsigned long long)cases[k].limit, "VMMIPC_CACHE_BYTES=%s: limit %llu, want %lld", shown, limit,
          cases[k].limit);
    CHECK(import_rc == VMMIPC_OK, "VMMIPC_CACHE_BYTES=%s: import said \"%s\"", shown, l2);
    CHECK(atoi(l3 + 5) == cases[k].kept, "VMMIPC_CACHE_BYTES=%s: %s after unmapping a %d-byte mapping, want %d", shown,
          l3, TOTAL, cases[k].kept);
  }
  child_end(&s);
  return 0;
}

/* Unreferenced mappings stay within the byte bound, least recently used
 * first out; a mapping larger than the bound is not kept; 0 turns the cache
 * off. The address space they hold is what the counters say. */
static int test_cache_eviction(void) {
  enum { B = 5, N = 64, CS = 4096 };
  const uint64_t size = N * CS;
  child s;
  vmmipc_ticket t[B];
  unsigned seed[B] = {1, 11, 12, 13, 14};
  CHECK(sender_start(&s, &t[0], "file", N, CS, 0, -1, 0) == 0, "sender did not start");
  char err[700];
  for (int i = 1; i < B; i++)
    CHECK(sender_ask_ticket(&s, &t[i], err, sizeof err, "newfile %u 0", seed[i]) == 0, "newfile: %s", err);
  uint64_t limit0 = cache_info().limit_bytes, bound = 3 * size + size / 2;
  CHECK_RC(vmmipc_cache_set_limit(bound), VMMIPC_OK);
  vmmipc_cache_info c0 = cache_info();
  /* Each buffer is its own memfd: its inode tells whether it is still
   * mapped anywhere (an evicted mapping's addresses may be reused). */
  uint64_t addr[B];
  unsigned long ino[B];
  vmmipc_mapping m;
  for (int i = 0; i < B; i++) {
    if (import_verify(&t[i], seed[i], &m)) return 1;
    addr[i] = m.addr;
    ino[i] = maps_inode_at(m.addr);
    CHECK(ino[i] != 0, "buffer %d: no file mapped at %#llx", i, (unsigned long long)m.addr);
    CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  }
  vmmipc_cache_info c1 = cache_info();
  CHECK(c1.misses == c0.misses + B && c1.evictions == c0.evictions + 2 && c1.entries == 3 &&
            c1.unreferenced_bytes == 3 * size && c1.referenced_bytes == 0,
        "after %d imports under a %llu-byte bound: misses +%llu, evictions +%llu, entries %llu, unreferenced %llu", B,
        (unsigned long long)bound, (unsigned long long)(c1.misses - c0.misses),
        (unsigned long long)(c1.evictions - c0.evictions), (unsigned long long)c1.entries,
        (unsigned long long)c1.unreferenced_bytes);
  uint64_t held = 0;
  for (int i = 0; i < B; i++) {
    int mapped = maps_has_inode(ino[i]);
    CHECK(mapped == (i >= 2), "buffer %d is %s, want %s", i, mapped ? "mapped" : "unmapped", i >= 2 ? "kept" : "evicted");
    held += mapped ? size : 0;
  }
  CHECK(held <= bound && held == c1.unreferenced_bytes, "cached mappings hold %llu bytes of address space, bound %llu",
        (unsigned long long)held, (unsigned long long)bound);
  printf("  5 x %llu KiB under a %llu KiB bound: 2 evicted, %llu KiB kept mapped\n", (unsigned long long)(size / KIB),
         (unsigned long long)(bound / KIB), (unsigned long long)(held / KIB));

  /* A hit on the newest, then a miss on the evicted oldest: the least
   * recently used of the rest (buffer 2) makes room. */
  CHECK_RC(vmmipc_import_stream(&t[4], VMMIPC_DEVICE_HOST, NULL, &m), VMMIPC_OK);
  CHECK(m.addr == addr[4], "a kept mapping was not hit");
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  if (import_verify(&t[0], seed[0], &m)) return 1;
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  vmmipc_cache_info c2 = cache_info();
  CHECK(c2.hits == c1.hits + 1 && c2.misses == c1.misses + 1 && c2.evictions == c1.evictions + 1 && c2.entries == 3,
        "hit +%llu miss +%llu evictions +%llu entries %llu", (unsigned long long)(c2.hits - c1.hits),
        (unsigned long long)(c2.misses - c1.misses), (unsigned long long)(c2.evictions - c1.evictions),
        (unsigned long long)c2.entries);
  CHECK(!maps_has_inode(ino[2]) && maps_has_inode(ino[3]) && maps_has_inode(ino[4]) && maps_has_inode(ino[0]),
        "the least recently used mapping was not the one evicted");

  /* A smaller bound undoes what no longer fits before it returns. */
  CHECK_RC(vmmipc_cache_set_limit(size / 2), VMMIPC_OK);
  CHECK(cache_info().entries == 0, "%llu entries kept under a bound smaller than each",
        (unsigned long long)cache_info().entries);
  CHECK(!maps_has_inode(ino[3]) && !maps_has_inode(ino[4]) && !maps_has_inode(ino[0]),
        "mappings beyond the new bound are still mapped");
  if (import_verify(&t[1], seed[1], &m)) return 1;
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  CHECK(!maps_has_inode(ino[1]) && cache_info().entries == 0, "a mapping larger than the bound was kept");
  CHECK_RC(vmmipc_cache_set_limit(0), VMMIPC_OK);
  if (import_verify(&t[1], seed[1], &m)) return 1;
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  CHECK(!maps_has_inode(ino[1]) && cache_info().entries == 0, "a mapping was kept with the cache off");
  CHECK_RC(vmmipc_cache_set_limit(limit0), VMMIPC_OK);
  child_end(&s);
  return 0;
}

/* expect_invalidated waits up to 1 s for the cached mapping at addr to be
 * undone (the cache polls every 250 ms) and checks the counters. */
static int expect_invalidated(uint64_t addr, uint64_t size, const vmmipc_cache_info *before, const char *why) {
  double took = 0;
  int gone = WAIT_UNTIL(!maps_has_range(addr, size) && cache_info().entries + 1 == before->entries, 1000, &took);
  vmmipc_cache_info now = cache_info();
  CHECK(gone, "%s: the cached mapping is still %s after 1 s (entries %llu -> %llu)", why,
        maps_has_range(addr, size) ? "mapped" : "counted", (unsigned long long)before->entries,
        (unsigned long long)now.entries);
  CHECK(now.invalidations == before->invalidations + 1, "%s: invalidations %llu -> %llu", why,
        (unsigned long long)before->invalidations, (unsigned long long)now.invalidations);
  printf("  %s: cached mapping undone after %.0f ms\n", why, took);
  return 0;
}

/* When the sender unregisters, its buffer's cached mapping is undone within
 * about a second; a mapping still referenced stays valid until unmapped. */
static int test_cache_invalidation_unregister(void) {
  START_CACHED(s, t0, addr, size, "file", 64, 4096, 0, -1, 0);
  usleep(600 * 1000); /* two polls: the exporter says the buffer lives */
  CHECK(maps_has_range(addr, size) == 1, "the mapping of a live buffer was undone");
  vmmipc_cache_info c0 = cache_info();
  CHECK_SENDER_RC(&s, VMMIPC_OK, NULL, "unregister 0");
  if (expect_invalidated(addr, size, &c0, "unregistered")) return 1;
  if (try_open(&t0, VMMIPC_ENOENT, "unregistered")) return 1;

  /* Referenced while the registration ends. */
  char err[700];
  vmmipc_ticket t1;
  CHECK(sender_ask_ticket(&s, &t1, err, sizeof err, "file-again 0 0") == 0, "register: %s", err);
  vmmipc_mapping m;
  if (import_verify(&t1, 1, &m)) return 1;
  CHECK_SENDER_RC(&s, VMMIPC_OK, NULL, "unregister 1");
  usleep(600 * 1000);
  unsigned char *p = (unsigned char *)(uintptr_t)m.addr;
  CHECK(count_mismatches(p, m.size, 0, 1) == 0, "the referenced mapping changed after the registration ended");
  p[100] = 0x77;
  char reply[64];
  CHECK(child_ask(&s, reply, sizeof reply, "peek 100") == 0 && atoi(reply) == 0x77, "the sender sees %s", reply);
  p[100] = pattern(100, 1);
  addr = m.addr;
  c0 = cache_info();
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  double took = 0;
  CHECK(WAIT_UNTIL(!maps_has_range(addr, size) && cache_info().entries + 1 == c0.entries, 1000, &took),
        "the mapping of an ended buffer outlived its last reference by 1 s");
  child_end(&s);
  return 0;
}

/* When the sender dies, its cached mappings are undone within about a
 * second; a referenced one stays valid, and importing the ticket again is
 * refused (a stale hit is impossible), not answered from the cache. */
static int test_cache_invalidation_killed(void) {
  enum { N = 64, CS = 4096 };
  START_CACHED(s, t, addr, size, "file", N, CS, 0, -1, 0);
  vmmipc_cache_info c0 = cache_info();
  kill(s.pid, SIGKILL);
  child_end(&s);
  if (expect_invalidated(addr, size, &c0, "sender killed")) return 1;

  CHECK(sender_start(&s, &t, "file", N, CS, 0, -1, 0) == 0, "sender did not start");
  vmmipc_mapping m;
  if (import_verify(&t, 1, &m)) return 1;
  kill(s.pid, SIGKILL);
  child_end(&s);
  unsigned char *p = (unsigned char *)(uintptr_t)m.addr;
  CHECK(count_mismatches(p, m.size, 0, 1) == 0, "the referenced mapping changed when the sender died");
  p[5] = 0x42;
  CHECK(p[5] == 0x42, "the mapping is not writable any more");
  vmmipc_mapping again = {0};
  int rc = vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &again);
  CHECK(rc == VMMIPC_EIO && strstr(vmmipc_last_error(), "has exited") && again.addr == 0,
        "importing a dead sender's ticket with its mapping cached: %d %s", rc, vmmipc_last_error());
  addr = m.addr;
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  double took = 0;
  CHECK(WAIT_UNTIL(!maps_has_range(addr, size), 1000, &took), "a dead sender's mapping outlived its last reference by 1 s");
  return 0;
}
#endif
