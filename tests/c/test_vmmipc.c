/* End-to-end tests of libvmmipc through its C header only. The test process
 * is the receiver; most tests spawn a sender process (this binary in the
 * "sender" role, see sender.h); other roles are started the same way. Run
 * with a test name, or "all". Prints PASS/FAIL per test and "N passed, M
 * failed". After each test the runner checks that it left nothing behind:
 * descriptors, memfd mappings, cached mappings, live registrations.
 *
 * The suite is one translation unit (CMake builds this file): the tests of
 * the 0.2 contract, the import cache and load live in the headers below. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "arena_tests.h"
#include "cache_tests.h"
#include "contract_tests.h"
#include "load_tests.h"
#include "sender.h"
#include "testutil.h"

/* pull_all pulls every chunk of a ticket with vmmipc_pull_next under a
 * 64-descriptor limit, verifies each, and checks descriptor counts: the
 * sender's library holds exactly one duplicate of a registered memfd while
 * the registration lives (none for export_fn) and closes it at the end. */
static int pull_all(const char *mode, uint64_t chunks, uint64_t chunk_size) {
  int file = strcmp(mode, "file") == 0;
  START_SENDER(s, t, mode, chunks, chunk_size, 1, -1, 0);
  int s_now, s_peak;
  CHECK(sender_fds(&s, file, &s_now, &s_peak) == 0, "sender gone");
  CHECK(s_now == file, "sender holds %d descriptor(s) for its live registration, want %d", s_now, file);
  if (file) {
    int n = sender_ask_int(&s, NULL, 0, "memfds");
    CHECK(n == 2, "the sender has %d descriptors of its memfd while registered, want 2 (its own and the library's one duplicate)", n);
  }
  int base = count_fds(0);
  rlim_t old = set_nofile(64);
  fd_sampler fs;
  fd_sampler_start(&fs, 0);
  vmmipc_options o = default_options();
  vmmipc_stream *st = NULL;
  double t0 = now_ms();
  CHECK_RC(vmmipc_open(&t, &o, &st), VMMIPC_OK);
  uint64_t count = 0, total = 0, n = 0, bad = 0;
  CHECK_RC(vmmipc_stream_info(st, &count, &total), VMMIPC_OK);
  CHECK(count == chunks && total == chunks * chunk_size, "info %llu/%llu", (unsigned long long)count, (unsigned long long)total);
  vmmipc_chunk c;
  int rc;
  while ((rc = vmmipc_pull_next(st, &c)) == VMMIPC_OK) {
    if (c.index != n || !verify_chunk_fd(&c)) bad++;
    close(c.fd);
    n++;
  }
  CHECK(rc == VMMIPC_END, "pull_next ended with %d: %s", rc, vmmipc_last_error());
  CHECK_RC(vmmipc_close(st), VMMIPC_OK);
  double ms = now_ms() - t0;
  int peak = fd_sampler_stop(&fs);
  set_nofile(old);
  CHECK(n == chunks && bad == 0, "%llu chunks, %llu bad", (unsigned long long)n, (unsigned long long)bad);
  CHECK(sender_fds(&s, 0, &s_now, &s_peak) == 0, "sender gone");
  char reply[128];
  CHECK(child_ask(&s, reply, sizeof reply, "released") == 0 && atoi(reply) == 1, "release callback did not run once: %s", reply);
  printf("  %s: %llu chunks in %.1f ms; extra fds: receiver peak %d, sender peak %d (%ld samples)\n", mode,
         (unsigned long long)n, ms, peak - base, s_peak, fs.samples);
  CHECK(peak - base <= 8, "receiver peak %d extra fds", peak - base);
  CHECK(s_peak <= 8, "sender peak %d extra fds", s_peak);
  CHECK(s_now == 0, "the used-up registration left %d descriptor(s) in the sender, want 0", s_now);
  if (file) {
    int m = sender_ask_int(&s, NULL, 0, "memfds");
    CHECK(m == 1, "the sender has %d descriptors of its memfd after the registration ended, want 1 (its own)", m);
  }
  CHECK(count_fds(0) == base, "receiver fds %d, baseline %d", count_fds(0), base);
  child_end(&s);
  return 0;
}

static int test_pull_4096_callback(void) { return pull_all("callback", 4096, 4096); }
static int test_pull_4096_file(void) { return pull_all("file", 4096, 4096); }

/* import_all imports a host-file registration with vmmipc_import_stream
 * under a 64-descriptor limit, verifies every byte, writes back, checks the
 * sender sees the write, unmaps and checks nothing is left. */
static int import_all(uint64_t chunks, uint64_t chunk_size) {
  START_SENDER(s, t, "file", chunks, chunk_size, 1, -1, 0);
  int base = count_fds(0), maps_base = maps_memfd_count();
  rlim_t old = set_nofile(64);
  fd_sampler fs;
  fd_sampler_start(&fs, 0);
  vmmipc_mapping m;
  double t0 = now_ms();
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &m), VMMIPC_OK);
  double ms = now_ms() - t0;
  int peak = fd_sampler_stop(&fs);
  set_nofile(old);
  CHECK(m.size == chunks * chunk_size && m.memory_kind == VMMIPC_MEMORY_HOST && m.device == VMMIPC_DEVICE_HOST, "mapping fields");
  const unsigned char *p = (const unsigned char *)(uintptr_t)m.addr;
  uint64_t bad = 0;
  for (uint64_t i = 0; i < m.size; i++) bad += p[i] != pattern(i, 1);
  CHECK(bad == 0, "%llu bytes differ", (unsigned long long)bad);
  uint64_t at = m.size - 12345;
  ((unsigned char *)(uintptr_t)m.addr)[at] = (unsigned char)~pattern(at, 1);
  char reply[128];
  CHECK(child_ask(&s, reply, sizeof reply, "peek %llu", (unsigned long long)at) == 0, "sender gone");
  CHECK(atoi(reply) == (unsigned char)~pattern(at, 1), "sender sees %s, not our write", reply);
  int s_now, s_peak;
  CHECK(sender_fds(&s, 0, &s_now, &s_peak) == 0, "sender gone");
  CHECK(s_now == 0, "the used-up registration left %d descriptor(s) in the sender (the library's duplicate of the memfd must close at its end)", s_now);
  uint64_t addr = m.addr, size = m.size;
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  CHECK(!maps_has_range(addr, size), "range still mapped after vmmipc_unmap");
  CHECK(maps_memfd_count() == maps_base, "memfd mappings left");
  vmmipc_mapping stale = {.addr = addr, .size = size};
  CHECK_RC(vmmipc_unmap(&stale), VMMIPC_EINVAL);
  printf("  import: %llu chunks, %llu bytes in %.1f ms; extra fds: receiver peak %d, sender peak %d\n",
         (unsigned long long)chunks, (unsigned long long)size, ms, peak - base, s_peak);
  CHECK(peak - base <= 8, "receiver peak %d extra fds", peak - base);
  CHECK(s_peak <= 8, "sender peak %d extra fds", s_peak);
  CHECK(count_fds(0) == base, "receiver fds %d, baseline %d", count_fds(0), base);
  child_end(&s);
  return 0;
}

static int test_import_4096(void) { return import_all(4096, 4096); }
static int test_import_300(void) { return import_all(300, 16384); } /* > SCM_MAX_FD (253) */

static int test_pull_300(void) { return pull_all("callback", 300, 8192); }

/* The sender's export_fn fails at chunk k. */
static int test_export_fails_at_k(void) {
  const int64_t k = 1717;
  START_SENDER(s, t, "callback", 4096, 4096, 1, k, 0);
  int base = count_fds(0);
  static maps_snapshot before;
  maps_take(&before);
  vmmipc_mapping m = {0};
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &m), VMMIPC_EEXPORT);
  const char *e = vmmipc_last_error();
  printf("  error: %s\n", e);
  CHECK(strstr(e, "chunk 1717 of 4096") != NULL, "message does not name chunk 1717: %s", e);
  CHECK(m.addr == 0, "mapping_out touched on failure");
  CHECK(maps_new_reservations(&before, 4096ull * 4096) == 0, "the failed import left its reservation mapped");
  CHECK(maps_memfd_count() == 0, "memfd mappings left");
  CHECK(count_fds(0) == base, "fds %d, baseline %d", count_fds(0), base);
  /* The failed import gave its use back: the same failure again, not ENOENT. */
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &m), VMMIPC_EEXPORT);
  child_end(&s);
  return 0;
}

static int test_bad_tickets(void) {
  START_SENDER(s, good, "file", 16, 4096, 1, -1, 0);
  vmmipc_ticket t;
  srand(42);
  for (size_t i = 0; i < sizeof t.bytes; i++) t.bytes[i] = (unsigned char)rand();
  if (try_open(&t, VMMIPC_EINVAL, "wrong magic")) return 1;
  t = good;
  t.bytes[0] ^= 1;
  if (try_open(&t, VMMIPC_EINVAL, "wrong magic")) return 1;
  t = good;
  t.bytes[8] = 9; /* format version */
  if (try_open(&t, VMMIPC_EINVAL, "format version 9")) return 1;
  t.bytes[8] = 1; /* an old format: refused naming both versions */
  if (try_open(&t, VMMIPC_EINVAL, "format version 1, this libvmmipc reads version")) return 1;
  t = good;
  memset(t.bytes + 64, 0, sizeof t.bytes - 64); /* truncated: only the first 64 bytes arrived */
  if (try_open(&t, VMMIPC_EINVAL, "ticket")) return 1;
  t = good;
  /* A secret byte: the exporter cannot prove it knows this secret, and the
   * receiver says so (protocol 2: the secret never crosses the socket). */
  t.bytes[TICKET_OFF_SECRET] ^= 0x10;
  if (try_open(&t, VMMIPC_EAUTH, "could not prove that it knows this ticket's secret")) return 1;
  vmmipc_ticket_info info;
  CHECK_RC(vmmipc_ticket_decode(&good, &info), VMMIPC_OK);
  CHECK(info.chunk_count == 16 && info.total_size == 16 * 4096 && info.memory_kind == VMMIPC_MEMORY_HOST &&
            (pid_t)info.exporter_pid == s.pid,
        "ticket info");
  CHECK_RC(vmmipc_ticket_decode(NULL, &info), VMMIPC_EINVAL);
  /* First use works, the second of a uses=1 ticket is refused. */
  vmmipc_mapping m;
  CHECK_RC(vmmipc_import_stream(&good, VMMIPC_DEVICE_HOST, NULL, &m), VMMIPC_OK);
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  if (try_open(&good, VMMIPC_ENOENT, "used up")) return 1;
  child_end(&s);

  /* An unregistered ticket. */
  CHECK(sender_start(&s, &good, "file", 16, 4096, 0, -1, 0) == 0, "sender did not start");
  char reply[256];
  CHECK(child_ask(&s, reply, sizeof reply, "unregister") == 0 && atoi(reply) == 0, "unregister: %s", reply);
  CHECK(child_ask(&s, reply, sizeof reply, "released") == 0 && atoi(reply) == 1, "release after unregister: %s", reply);
  if (try_open(&good, VMMIPC_ENOENT, "unregistered")) return 1;
  /* A ticket for a process that has exited: refused at once (its pid is
   * gone), before any connection. */
  child_end(&s);
  double t0 = now_ms();
  if (try_open(&good, VMMIPC_EIO, "has exited")) return 1;
  CHECK(now_ms() - t0 < 1000, "took %.0f ms to see that the exporter has exited", now_ms() - t0);
  /* Wrong device for the memory kind. */
  CHECK_RC(vmmipc_import_stream(&good, 0, NULL, &m), VMMIPC_EINVAL);
  return 0;
}

static int test_ttl_expires(void) {
  START_SENDER(s, t, "file", 4, 4096, 0, -1, 100);
  char reply[64];
  CHECK(child_ask(&s, reply, sizeof reply, "released") == 0 && atoi(reply) == 1, "ttl did not release");
  if (try_open(&t, VMMIPC_ENOENT, "expired")) return 1;
  child_end(&s);
  return 0;
}

/* uses = 2 from one process: the second import is a cache hit, another
 * reference to the same mapping; the mapping lives until both are dropped,
 * and goes with the last one (the registration is used up: nothing to keep). */
static int test_two_uses(void) {
  START_SENDER(s, t, "file", 64, 4096, 2, -1, 0);
  int base = count_fds(0);
  vmmipc_cache_info c0 = cache_info();
  vmmipc_mapping a, b;
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &a), VMMIPC_OK);
  fd_sampler fs;
  fd_sampler_start(&fs, 0);
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &b), VMMIPC_OK);
  int peak = fd_sampler_stop(&fs);
  vmmipc_cache_info c1 = cache_info();
  CHECK(a.addr == b.addr && a.size == b.size && b.size == 64 * 4096, "second import at %#llx, first at %#llx: not a cache hit",
        (unsigned long long)b.addr, (unsigned long long)a.addr);
  CHECK(c1.hits == c0.hits + 1 && c1.misses == c0.misses + 1 && c1.entries == c0.entries + 1,
        "cache: hits %llu->%llu misses %llu->%llu entries %llu->%llu, want one miss then one hit of one entry",
        (unsigned long long)c0.hits, (unsigned long long)c1.hits, (unsigned long long)c0.misses,
        (unsigned long long)c1.misses, (unsigned long long)c0.entries, (unsigned long long)c1.entries);
  CHECK(c1.referenced_bytes == c0.referenced_bytes + 64 * 4096, "referenced bytes %llu, want %llu more",
        (unsigned long long)c1.referenced_bytes, 64ull * 4096);
  /* A hit that the sender's grant table vouches for opens nothing on the
   * caller's path; its use is spent right after on one short connection
   * (one socket; during its handshake, for a moment, also the netlink
   * socket that asks the kernel which socket is its peer), and no
   * descriptor arrives. */
  CHECK(c1.table_hits == c0.table_hits + 1, "the hit was not vouched for by the sender's table");
  CHECK(peak - base <= 2, "the cache hit took %d extra descriptors (a socket and a netlink socket at most)", peak - base);
  /* The use was spent right after the hit: the ticket is used up. */
  for (int i = 0; i < 500 && cache_info().confirms_pending; i++) usleep(10000);
  if (try_open(&t, VMMIPC_ENOENT, "used up")) return 1;
  uint64_t addr = a.addr, size = a.size;
  CHECK_RC(vmmipc_unmap(&a), VMMIPC_OK);
  CHECK(a.addr == 0, "vmmipc_unmap did not zero the mapping");
  /* One reference left: still mapped, and shared with the sender. */
  CHECK(maps_has_range(addr, size) == 1, "the mapping went with its first reference");
  volatile unsigned char *p = (volatile unsigned char *)(uintptr_t)b.addr;
  CHECK(count_mismatches((const unsigned char *)p, size, 0, 1) == 0, "bytes differ after the first unmap");
  p[777] = 0x5a;
  char reply[64];
  CHECK(child_ask(&s, reply, sizeof reply, "peek 777") == 0 && atoi(reply) == 0x5a, "the sender sees %s, not our write", reply);
  CHECK(child_ask(&s, reply, sizeof reply, "poke 778 165") == 0 && atoi(reply) == 1, "poke");
  CHECK(p[778] == 165, "the remaining reference does not see the sender's write (%d)", p[778]);
  CHECK_RC(vmmipc_unmap(&b), VMMIPC_OK);
  CHECK(!maps_has_range(addr, size), "still mapped after the last reference of a used-up registration went");
  CHECK(cache_info().entries == c0.entries, "the cache still holds the used-up registration's mapping");
  child_end(&s);

  /* The same with VMMIPC_IMPORT_NO_CACHE: two distinct mappings of the
   * same memory, each undone by its own unmap, and the cache untouched. */
  CHECK(sender_start(&s, &t, "file", 64, 4096, 2, -1, 0) == 0, "sender did not start");
  vmmipc_options o = default_options();
  o.import_flags = VMMIPC_IMPORT_NO_CACHE;
  c0 = cache_info();
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, &o, &a), VMMIPC_OK);
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, &o, &b), VMMIPC_OK);
  c1 = cache_info();
  CHECK(a.addr != b.addr, "two uncached imports share an address");
  CHECK(c1.hits == c0.hits && c1.misses == c0.misses + 2, "uncached imports: hits %llu->%llu misses %llu->%llu",
        (unsigned long long)c0.hits, (unsigned long long)c1.hits, (unsigned long long)c0.misses,
        (unsigned long long)c1.misses);
  ((volatile unsigned char *)(uintptr_t)a.addr)[777] = 0x5a;
  CHECK(((volatile unsigned char *)(uintptr_t)b.addr)[777] == 0x5a, "second mapping does not see the first's write");
  uint64_t a_addr = a.addr;
  CHECK_RC(vmmipc_unmap(&a), VMMIPC_OK);
  CHECK(!maps_has_range(a_addr, size), "an uncached mapping outlived its only reference");
  CHECK(count_mismatches((const unsigned char *)(uintptr_t)b.addr + 778, size - 778, 778, 1) == 0,
        "the other mapping changed when the first was unmapped");
  uint64_t b_addr = b.addr;
  CHECK_RC(vmmipc_unmap(&b), VMMIPC_OK);
  CHECK(!maps_has_range(b_addr, size), "an uncached mapping outlived its only reference");
  if (try_open(&t, VMMIPC_ENOENT, "used up")) return 1;
  child_end(&s);
  return 0;
}

/* A stream that has every chunk has spent its use: when another receiver
 * then spends the last use and the registration ends, the first still gets
 * VMMIPC_END (the exporter confirms its use), not a cut connection. */
static int test_spent_stream_survives_end(void) {
  enum { N = 8 };
  child s;
  vmmipc_ticket t;
  CHECK(sender_start(&s, &t, "file", N, 4096, 2, -1, 0) == 0, "sender did not start");
  int base = count_fds(0);
  vmmipc_stream *a = NULL;
  vmmipc_chunk c;
  CHECK_RC(vmmipc_open(&t, NULL, &a), VMMIPC_OK);
  for (int i = 0; i < N; i++) {
    CHECK_RC(vmmipc_pull_next(a, &c), VMMIPC_OK);
    int ok = verify_chunk_fd(&c);
    close(c.fd);
    CHECK(ok, "chunk %d differs", i);
  }
  vmmipc_mapping m;
  vmmipc_cache_info c0 = cache_info();
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &m), VMMIPC_OK); /* the last use */
  CHECK(cache_info().table_imports == c0.table_imports + 1, "the import was not mapped from the file the sender's table names");
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  char reply[64];
  CHECK(child_ask(&s, reply, sizeof reply, "released") == 0 && atoi(reply) == 1, "the used-up registration was not released");
  int rc = vmmipc_pull_next(a, &c);
  CHECK(rc == VMMIPC_END, "the stream that had every chunk got %d (%s) once the registration ended: %s", rc,
        vmmipc_strerror(rc), vmmipc_last_error());
  CHECK_RC(vmmipc_close(a), VMMIPC_OK);
  /* The import was mapped from the file the sender's table names (the
   * stream brought the table): its use is spent on a short connection just
   * after, which is closed once it is no longer pending. */
  WAIT_UNTIL(cache_info().confirms_pending == 0, 5000, NULL);
  CHECK(count_fds(0) == base, "fds %d, baseline %d", count_fds(0), base);
  child_end(&s);
  return 0;
}

/* Closing a stream early gives the use back; handles are checked. */
static int test_handles_and_early_close(void) {
  START_SENDER(s, t, "callback", 32, 4096, 1, -1, 0);
  vmmipc_stream *st;
  vmmipc_chunk c;
  CHECK_RC(vmmipc_open(&t, NULL, &st), VMMIPC_OK);
  CHECK_RC(vmmipc_pull_next(st, &c), VMMIPC_OK);
  close(c.fd);
  CHECK_RC(vmmipc_close(st), VMMIPC_OK);
  /* Each EBADF says which of NULL, closed or unknown the handle is. */
  CHECK_SAYS(vmmipc_close(st), VMMIPC_EBADF, "vmmipc_close: stream 0x", "NULL");
  CHECK(strstr(vmmipc_last_error(), "is closed (vmmipc_close was called on it)"), "closed twice: %s", vmmipc_last_error());
  CHECK_SAYS(vmmipc_pull_next(st, &c), VMMIPC_EBADF, "vmmipc_pull_next: stream 0x", "NULL");
  CHECK(strstr(vmmipc_last_error(), "is closed"), "pull after close: %s", vmmipc_last_error());
  CHECK_SAYS(vmmipc_pull_next(NULL, &c), VMMIPC_EBADF, "vmmipc_pull_next: stream is NULL", "closed");
  CHECK_SAYS(vmmipc_stream_info(NULL, NULL, NULL), VMMIPC_EBADF, "vmmipc_stream_info: stream is NULL", "closed");
  CHECK_SAYS(vmmipc_close(NULL), VMMIPC_EBADF, "vmmipc_close: stream is NULL", "closed");
  void *bogus = malloc(16);
  CHECK_SAYS(vmmipc_pull_next((vmmipc_stream *)bogus, &c), VMMIPC_EBADF, "is not a stream of this process", "NULL");
  free(bogus);
  /* Values no pointer could be: EBADF, and the Go runtime never holds them
   * in a pointer type (it would abort when it moves a stack). */
  for (uintptr_t v = 1; v < 4096; v += 0x1bb) {
    CHECK_RC(vmmipc_pull_next((vmmipc_stream *)v, &c), VMMIPC_EBADF);
    CHECK_RC(vmmipc_stream_info((vmmipc_stream *)v, NULL, NULL), VMMIPC_EBADF);
    CHECK_RC(vmmipc_close((vmmipc_stream *)v), VMMIPC_EBADF);
  }
  CHECK_RC(vmmipc_unmap(NULL), VMMIPC_EINVAL);
  CHECK_SAYS(vmmipc_open(&t, NULL, NULL), VMMIPC_EINVAL, "vmmipc_open: stream_out is NULL", NULL);
  CHECK_RC(vmmipc_register(NULL, 3, NULL, NULL, NULL, NULL, NULL), VMMIPC_EINVAL);
  vmmipc_options o = default_options();
  o.struct_size = 2;
  CHECK_SAYS(vmmipc_open(&t, &o, &st), VMMIPC_EINVAL, "opts->struct_size is 2", NULL);
  /* A caller built against an older, smaller vmmipc_options: the library
   * writes no byte past the size it is given, and reads no field past it. */
  struct {
    vmmipc_options o;
    unsigned char after[64];
  } old;
  memset(&old, 0xAB, sizeof old);
  size_t old_size = offsetof(vmmipc_options, window);
  CHECK_RC(vmmipc_options_init(&old.o, old_size), VMMIPC_OK);
  unsigned char *tail = (unsigned char *)&old.o + old_size;
  for (size_t i = 0; i < sizeof old - old_size; i++) CHECK(tail[i] == 0xAB, "byte %zu past the size was written", i);
  CHECK(old.o.struct_size == old_size && old.o.uses == 1, "struct_size %u uses %u", old.o.struct_size, old.o.uses);
  CHECK_RC(vmmipc_options_init(NULL, sizeof o), VMMIPC_EINVAL);
  CHECK_RC(vmmipc_options_init(&o, 3), VMMIPC_EINVAL);
  /* The early close gave the use back: a full import still works. */
  vmmipc_mapping m;
  CHECK_RC(vmmipc_import_stream(&t, VMMIPC_DEVICE_HOST, NULL, &m), VMMIPC_OK);
  CHECK_RC(vmmipc_unmap(&m), VMMIPC_OK);
  child_end(&s);
  return 0;
}

/* With SIGPIPE at its default, a sender that vanishes mid-stream gives the
 * receiver VMMIPC_EIO and does not kill it. */
static int test_peer_vanishes_sigpipe_default(void) {
  signal(SIGPIPE, SIG_DFL);
  START_SENDER(s, t, "callback", 2048, 4096, 1, -1, 0);
  int base = count_fds(0);
  vmmipc_options o = default_options();
  o.window = 1;
  o.timeout_ms = 5000;
  vmmipc_stream *st;
  vmmipc_chunk c;
  CHECK_RC(vmmipc_open(&t, &o, &st), VMMIPC_OK);
  CHECK_RC(vmmipc_pull_next(st, &c), VMMIPC_OK);
  close(c.fd);
  kill(s.pid, SIGKILL);
  child_end(&s);
  base -= 2; /* the pipes to the sender are closed now */
  double t0 = now_ms();
  int rc;
  while ((rc = vmmipc_pull_next(st, &c)) == VMMIPC_OK) close(c.fd);
  CHECK(rc == VMMIPC_EIO, "got %d: %s", rc, vmmipc_last_error());
  CHECK(now_ms() - t0 < 1000, "took %.0f ms to notice", now_ms() - t0);
  CHECK_RC(vmmipc_pull_next(st, &c), VMMIPC_EIO); /* sticky */
  CHECK_RC(vmmipc_close(st), VMMIPC_OK);
  CHECK(count_fds(0) == base, "fds %d, baseline %d", count_fds(0), base);
  return 0;
}

/* After fork(), the child gets VMMIPC_EFORK at once from every entry point. */
static int test_fork_child_gets_efork(void) {
  char version[64];
  snprintf(version, sizeof version, "%s", vmmipc_version());
  pid_t pid = fork();
  if (pid == 0) {
    vmmipc_ticket t = {{0}};
    vmmipc_options o;
    uint64_t n;
    int ok = vmmipc_options_init(&o, sizeof o) == VMMIPC_EFORK && vmmipc_open(&t, NULL, NULL) == VMMIPC_EFORK &&
             vmmipc_live_registrations(&n) == VMMIPC_EFORK && strstr(vmmipc_last_error(), "fork") != NULL;
    /* The header's exceptions: these still answer in the child. */
    ok = ok && strcmp(vmmipc_version(), version) == 0 &&
         strstr(vmmipc_strerror(VMMIPC_EFORK), "VMMIPC_EFORK") != NULL &&
         strstr(vmmipc_strerror(VMMIPC_EINVAL), "VMMIPC_UNKNOWN") != NULL;
    _exit(ok ? 0 : 1);
  }
  int st;
  CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %#x", st);
  uint64_t n;
  CHECK_RC(vmmipc_live_registrations(&n), VMMIPC_OK); /* the parent is fine */
  return 0;
}

/* Without a GPU driver the CUDA entry points fail cleanly, naming libcuda. */
static int test_cuda_without_driver(void) {
  setenv("VMMIPC_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
  vmmipc_ticket t;
  int rc = vmmipc_register_cuda(0x10000, 2 << 20, NULL, &t);
  CHECK(rc == VMMIPC_ECUDA, "register_cuda returned %d: %s", rc, vmmipc_last_error());
  CHECK(strstr(vmmipc_last_error(), "libcuda.so.1") != NULL, "message: %s", vmmipc_last_error());
  printf("  %s\n", vmmipc_last_error());
  vmmipc_cuda_range_info info;
  memset(&info, 0xAB, sizeof info);
  rc = vmmipc_cuda_query_range(0x10000, 4096, &info);
  CHECK(rc == VMMIPC_ECUDA && strstr(vmmipc_last_error(), "libcuda.so.1") != NULL,
        "cuda_query_range without a driver returned %d: %s", rc, vmmipc_last_error());
  printf("  %s\n", vmmipc_last_error());
  unsigned char *raw = (unsigned char *)&info;
  for (size_t i = 0; i < sizeof info; i++) CHECK(raw[i] == 0xAB, "info_out byte %zu written on failure", i);
  /* Bad arguments are refused before the driver is needed. */
  CHECK_RC(vmmipc_cuda_query_range(0x10000, 4096, NULL), VMMIPC_EINVAL);
  CHECK_RC(vmmipc_cuda_query_range(0x10000, 0, &info), VMMIPC_EINVAL);
  CHECK_RC(vmmipc_cuda_query_range(~0ull - 100, 4096, &info), VMMIPC_EINVAL);
  /* vmmipc_register_cuda's Returns: dptr 0, size 0 and a range that
   * overflows are VMMIPC_EINVAL, driver or not. */
  CHECK_SAYS(vmmipc_register_cuda(0, 4096, NULL, &t), VMMIPC_EINVAL, "dptr is 0", NULL);
  CHECK_SAYS(vmmipc_register_cuda(0x10000, 0, NULL, &t), VMMIPC_EINVAL, "size is 0", NULL);
  CHECK_SAYS(vmmipc_register_cuda(~0ull - 100, 4096, NULL, &t), VMMIPC_EINVAL, "overflows", NULL);
  unsetenv("VMMIPC_LIBCUDA");
  return 0;
}

/* copy_file copies src to dst, mode 0755. */
static int copy_file(const char *src, const char *dst) {
  int in = open(src, O_RDONLY | O_CLOEXEC), out = open(dst, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0755);
  char buf[65536];
  ssize_t n = 0;
  while (in >= 0 && out >= 0 && (n = read(in, buf, sizeof buf)) > 0)
    if (write(out, buf, (size_t)n) != n) n = -1;
  int ok = in >= 0 && out >= 0 && n == 0 && fchmod(out, 0755) == 0;
  if (in >= 0) close(in);
  if (out >= 0) close(out);
  return ok ? 0 : -1;
}

/* One receiver thread of test_sender_inflight_limit. */
typedef struct inflight_receiver {
  const vmmipc_ticket *ticket;
  const vmmipc_options *opts;
  uint64_t got, bad;
  int rc;
  char err[512];
} inflight_receiver;

static void *inflight_receive(void *arg) {
  inflight_receiver *r = arg;
  vmmipc_stream *st;
  r->rc = vmmipc_open(r->ticket, r->opts, &st);
  if (r->rc == VMMIPC_OK) {
    vmmipc_chunk c;
    while ((r->rc = vmmipc_pull_next(st, &c)) == VMMIPC_OK) {
      r->bad += !verify_chunk_fd(&c);
      close(c.fd);
      r->got++;
    }
    vmmipc_close(st);
  }
  snprintf(r->err, sizeof r->err, "%s", vmmipc_last_error());
  return NULL;
}

/* The kernel charges descriptors in flight in unix sockets to the sending
 * user's RLIMIT_NOFILE (root is exempt). A sender at a low limit serving
 * several receivers, each with a window of descriptors queued, gets
 * ETOOMANYREFS from sendmsg; it must wait for them to drain, not fail. The
 * sender runs as uid 65534 with a soft limit of 32 and 8 receivers pull
 * 256 chunks each with window 16 at once (128 in flight). */
static int test_sender_inflight_limit(void) {
  if (geteuid() != 0 || access("/usr/bin/setpriv", X_OK) != 0) {
    printf("  SKIP: needs root (to start the sender as uid 65534) and /usr/bin/setpriv\n");
    return 77;
  }
  /* uid 65534 may not be able to reach our build directory (a checkout
   * under /root, say): run copies of this binary and the library from a
   * world-readable temporary directory. */
  char dir[] = "/tmp/vmmipc-test-XXXXXX", self[4096], lib[4096];
  CHECK(mkdtemp(dir) && chmod(dir, 0755) == 0, "mkdtemp");
  Dl_info info;
  CHECK(dladdr((void *)vmmipc_version, &info) && info.dli_fname, "dladdr");
  snprintf(self, sizeof self, "%s/test_vmmipc", dir);
  snprintf(lib, sizeof lib, "%s/libvmmipc.so", dir);
  CHECK(copy_file("/proc/self/exe", self) == 0 && copy_file(info.dli_fname, lib) == 0, "copying to %s", dir);
  /* The loader path of the copies, for this one child: the caller's own
   * LD_LIBRARY_PATH (a test run against another build) comes back after. */
  const char *caller_path = getenv("LD_LIBRARY_PATH");
  char *saved_path = caller_path ? strdup(caller_path) : NULL;
  setenv("LD_LIBRARY_PATH", dir, 1);
  setenv("VMMIPC_TEST_SENDER_NOFILE", "32", 1);
  char *argv[] = {"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", self, "sender", "file",
                  "256", "4096", "8", "-1", "0", NULL};
  child s;
  int rc = child_spawn_path(&s, "/usr/bin/setpriv", argv);
  unsetenv("VMMIPC_TEST_SENDER_NOFILE");
  if (saved_path) {
    setenv("LD_LIBRARY_PATH", saved_path, 1);
    free(saved_path);
  } else {
    unsetenv("LD_LIBRARY_PATH");
  }
  CHECK(rc == 0, "spawn setpriv");
  char line[2 * VMMIPC_TICKET_SIZE + 64];
  CHECK(fgets(line, sizeof line, s.out) && strncmp(line, "ticket ", 7) == 0, "sender did not start: %s", line);
  line[strcspn(line, "\n")] = 0;
  vmmipc_ticket t;
  CHECK(hex_decode(line + 7, t.bytes, sizeof t.bytes) == 0, "ticket");
  enum { R = 8 };
  pthread_t th[R];
  inflight_receiver rs[R];
  vmmipc_options o = default_options();
  o.window = 16;
  o.timeout_ms = 20000;
  for (int i = 0; i < R; i++) {
    rs[i] = (inflight_receiver){.ticket = &t, .opts = &o};
    pthread_create(&th[i], NULL, inflight_receive, &rs[i]);
  }
  uint64_t bad = 0;
  for (int i = 0; i < R; i++) {
    pthread_join(th[i], NULL);
    CHECK(rs[i].rc == VMMIPC_END && rs[i].got == 256, "receiver %d: %llu chunks, status %d: %s", i,
          (unsigned long long)rs[i].got, rs[i].rc, rs[i].err);
    bad += rs[i].bad;
  }
  CHECK(bad == 0, "%llu chunks differ", (unsigned long long)bad);
  child_end(&s);
  unlink(self);
  unlink(lib);
  rmdir(dir);
  printf("  8 receivers x 256 chunks, window 16, from a sender at RLIMIT_NOFILE 32 (uid 65534): all verified\n");
  return 0;
}

static const struct {
  const char *name;
  int (*fn)(void);
} tests[] = {
    {"pull_4096_callback", test_pull_4096_callback},
    {"pull_4096_file", test_pull_4096_file},
    {"pull_300", test_pull_300},
    {"import_4096", test_import_4096},
    {"import_300", test_import_300},
    {"export_fails_at_k", test_export_fails_at_k},
    {"bad_tickets", test_bad_tickets},
    {"ticket_corruption_sweep", test_ticket_corruption_sweep},
    {"ttl_expires", test_ttl_expires},
    {"two_uses", test_two_uses},
    {"spent_stream_survives_end", test_spent_stream_survives_end},
    {"handles_and_early_close", test_handles_and_early_close},
    {"peer_vanishes_sigpipe_default", test_peer_vanishes_sigpipe_default},
    {"fork_child_gets_efork", test_fork_child_gets_efork},
    {"arena_across_fork", test_arena_across_fork},
    {"cuda_without_driver", test_cuda_without_driver},
    {"sender_inflight_limit", test_sender_inflight_limit},
    {"register_again", test_register_again},
    {"wait", test_wait},
    {"live_many", test_live_many},
    {"host_file_close_and_reuse", test_host_file_close_and_reuse},
    {"host_file_refused", test_host_file_refused},
    {"host_file_same_memfd", test_host_file_same_memfd},
    {"unsealed_export_refused", test_unsealed_export_refused},
    {"option_bounds", test_option_bounds},
    {"status_names", test_status_names},
    {"last_error_kept", test_last_error_kept},
    {"argument_messages", test_argument_messages},
    {"cache_api", test_cache_api},
    {"confirm", test_confirm},
    {"cache_env", test_cache_env},
    {"cache_eviction", test_cache_eviction},
    {"cache_invalidation_unregister", test_cache_invalidation_unregister},
    {"cache_invalidation_killed", test_cache_invalidation_killed},
    {"rlimit_as_sweep", test_rlimit_as_sweep},
    {"connection_storm_1024", test_connection_storm},
    {"idle_connections_300", test_idle_connections},
};

/* Roles: this binary started by a test (posix_spawn) to play a part. */
static const struct {
  const char *name;
  int (*main)(int argc, char **argv);
} roles[] = {
    {"sender", sender_main},
    {"as_receiver", as_receiver_main},
    {"storm_receiver", storm_receiver_main},
    {"cache_env_receiver", cache_env_receiver_main},
    {"wait_foreign", wait_foreign_main},
};

/* leaks_after checks that a test that passed left nothing behind in this
 * process: descriptors, cached or referenced mappings, memfd mappings,
 * registrations, a changed cache limit. The server and the cache's poller
 * finish asynchronously (a poll every 250 ms): wait a little for them. */
static int leaks_after(int fds0, uint64_t limit0) {
  int bad = 0;
  if (!WAIT_UNTIL(count_fds(0) == fds0, 3000, NULL)) {
    printf("  leak: %d descriptor(s) more than before the test\n", count_fds(0) - fds0);
    bad = 1;
  }
  vmmipc_cache_info ci;
  if (!WAIT_UNTIL((ci = cache_info()).entries == 0, 3000, NULL)) {
    printf("  leak: the import cache still holds %llu mapping(s) (%llu bytes referenced, %llu not)\n",
           (unsigned long long)ci.entries, (unsigned long long)ci.referenced_bytes,
           (unsigned long long)ci.unreferenced_bytes);
    bad = 1;
  }
  if (ci.limit_bytes != limit0) {
    printf("  leak: the cache limit is %llu, was %llu\n", (unsigned long long)ci.limit_bytes,
           (unsigned long long)limit0);
    bad = 1;
  }
  uint64_t live = 0;
  if (!WAIT_UNTIL(vmmipc_live_registrations(&live) == VMMIPC_OK && live == 0, 3000, NULL)) {
    printf("  leak: %llu registration(s) of this process still live\n", (unsigned long long)live);
    bad = 1;
  }
  int mm = maps_memfd_count();
  if (mm != 0) {
    printf("  leak: %d memfd mapping(s) in /proc/self/maps\n", mm);
    bad = 1;
  }
  return bad;
}

int main(int argc, char **argv) {
  for (size_t i = 0; argc > 1 && i < sizeof roles / sizeof roles[0]; i++)
    if (strcmp(argv[1], roles[i].name) == 0) return roles[i].main(argc, argv);
  const char *only = argc > 1 ? argv[1] : "all";
  /* The Go runtime inside the library opens its poller's descriptors
   * (epoll, eventfd) at the first socket, and this process's server its
   * listener at the first registration; both stay for the life of the
   * process. Open them now, so every test's baseline includes them. */
  int before = count_fds(0);
  vmmipc_ticket none;
  vmmipc_stream *st;
  memset(&none, 0, sizeof none);
  vmmipc_open(&none, NULL, &st); /* EINVAL: opens nothing */
  child warm;
  vmmipc_ticket wt;
  if (sender_start(&warm, &wt, "file", 1, 4096, 1, -1, 0) == 0) {
    vmmipc_unregister(&wt); /* ENOENT here (not ours); it only warms up */
    int rc = vmmipc_open(&wt, NULL, &st);
    if (rc == VMMIPC_OK) vmmipc_close(st);
    child_end(&warm);
  }
  uint64_t page = 4096;
  if (vmmipc_register(&page, 1, export_memfd, NULL, NULL, NULL, &wt) == VMMIPC_OK) vmmipc_unregister(&wt);
  printf("library holds %d descriptor(s) after first use (Go's poller, this process's server)\n",
         count_fds(0) - before);
  uint64_t limit0 = cache_info().limit_bytes;
  int passed = 0, failed = 0, skipped = 0, found = 0;
  for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
    if (strcmp(only, "all") && strcmp(only, tests[i].name)) continue;
    found = 1;
    printf("RUN  %s\n", tests[i].name);
    fflush(stdout);
    /* The previous test's table hits spend their uses on short connections
     * just after: count from when they are done. */
    WAIT_UNTIL(cache_info().confirms_pending == 0, 5000, NULL);
    int fds0 = count_fds(0);
    double t0 = now_ms();
    int bad = tests[i].fn();
    if (bad == 77) {
      printf("SKIP %s\n", tests[i].name);
      skipped++;
      if (strcmp(only, "all")) return 77; /* ctest: SKIP_RETURN_CODE */
      continue;
    }
    if (!bad) bad = leaks_after(fds0, limit0); /* a failed test may not have cleaned up */
    printf("%s %s (%.1f s)\n", bad ? "FAIL" : "PASS", tests[i].name, (now_ms() - t0) / 1e3);
    fflush(stdout);
    bad ? failed++ : passed++;
  }
  if (!found) {
    fprintf(stderr, "no test named %s\n", only);
    return 2;
  }
  printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return failed ? 1 : 0;
}
