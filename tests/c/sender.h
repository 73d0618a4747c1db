/* The sender role of the C tests: a separate process (spawned with
 * posix_spawn) that registers a buffer, prints "ticket HEX", and then answers
 * commands on stdin, one reply line each:
 *
 *   fds [WANT]          descriptors now and at the peak since the last "fds",
 *                       both relative to the count before the first
 *                       registration (after waiting up to 2 s for WANT, default
 *                       0): "NOW PEAK"
 *   memfds              our descriptors of the registered memfd (file mode)
 *   nosample            stop the descriptor sampler (it spins on a core)
 *   peek OFF / poke OFF VAL   read / write a byte of the registered memfd
 *   exports             export_fn calls so far (callback modes)
 *   live                vmmipc_live_registrations
 *   again SLOT USES TTL vmmipc_register_again of registration SLOT: a new slot
 *   again-forged SLOT   the same with one secret byte of SLOT's ticket flipped
 *   file-again USES TTL vmmipc_register_host_file of the same memfd again
 *   newfile SEED USES   another memfd of the same chunks, filled with pattern
 *                       SEED, registered and closed at once: a new slot
 *   close-reuse         put another memfd, with pattern 2, at our memfd's
 *                       number (closing ours): "same 1" if it worked
 *   unregister [SLOT]   vmmipc_unregister: "RC MESSAGE"
 *   wait SLOT MS        vmmipc_wait: "RC MESSAGE"
 *   released [SLOT]     release_fn calls of SLOT, after waiting up to 5 s for one
 *   released-now SLOT   the same without waiting
 * Registrations are numbered in the order made, 0 = the one made at start;
 * commands that register reply "ticket HEX" or "error RC MESSAGE".
 *
 * Modes: "file" registers one memfd with vmmipc_register_host_file;
 * "callback" registers with vmmipc_register and an export_fn that makes a
 * fresh sealed memfd per chunk (failing at chunk fail_at); "unsealed" is
 * callback mode with memfds that are not sealed (receivers must refuse them). */
#ifndef VMMIPC_TEST_SENDER_H
#define VMMIPC_TEST_SENDER_H
#include <limits.h>
#include <sys/mman.h>

#include "testutil.h"

#define SENDER_MEMFD_NAME "vmmipc-test-buffer"
#define SENDER_GONE INT_MIN /* sender_ask_int: no reply */

typedef struct sender_cfg {
  const char *mode;
  uint64_t chunks, chunk_size;
  uint32_t uses;
  int64_t fail_at; /* export_fn fails at this chunk (-1: never) */
  uint64_t ttl_ms;
} sender_cfg;

static sender_cfg scfg;

/* One registration of the sender and the release_fn calls it got. */
typedef struct sender_reg {
  vmmipc_ticket t;
  int released; /* atomic: release_fn runs on a library thread */
} sender_reg;

static sender_reg sregs[64];
static int nsregs;
static long sexports; /* atomic: export_fn calls */

/* fill_memfd makes a memfd of n bytes holding pattern seed, sealed against
 * shrinking unless unsealed; returns it or -1. */
static int fill_memfd(const char *name, uint64_t n, uint64_t off, unsigned seed, int unsealed) {
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  unsigned char *buf = malloc(n);
  for (uint64_t i = 0; i < n; i++) buf[i] = pattern(off + i, seed);
  ssize_t w = pwrite(fd, buf, n, 0);
  free(buf);
  if (w != (ssize_t)n || (!unsealed && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0)) {
    close(fd);
    return -1;
  }
  return fd;
}

/* export_fn of the callback modes: materializes chunk i as a fresh memfd,
 * so the sender holds no descriptor between requests. */
static int export_memfd(void *user, uint64_t index, int *fd_out) {
  (void)user;
  __atomic_add_fetch(&sexports, 1, __ATOMIC_SEQ_CST);
  if ((int64_t)index == scfg.fail_at) return -5;
  int fd = fill_memfd("vmmipc-test-chunk", scfg.chunk_size, index * scfg.chunk_size, 1,
                      strcmp(scfg.mode, "unsealed") == 0);
  if (fd < 0) return -1;
  *fd_out = fd;
  return 0;
}

static void on_release(void *user) { __atomic_add_fetch((int *)user, 1, __ATOMIC_SEQ_CST); }

/* sender_reply_ticket records a new registration (rc from the call that
 * filled sregs[nsregs].t) and prints its ticket or the error. */
static void sender_reply_ticket(int rc) {
  if (rc) {
    printf("error %d %s\n", rc, vmmipc_last_error());
    return;
  }
  char hex[2 * VMMIPC_TICKET_SIZE + 1];
  hex_encode(sregs[nsregs].t.bytes, sizeof sregs[nsregs].t.bytes, hex);
  nsregs++;
  printf("ticket %s\n", hex);
}

static vmmipc_options sender_options(uint32_t uses, uint64_t ttl_ms) {
  vmmipc_options o = default_options();
  o.uses = uses;
  o.ttl_ms = ttl_ms;
  return o;
}

/* count_fds_to counts our descriptors whose target contains needle. */
static int count_fds_to(const char *needle) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  char path[300], target[256];
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t k = readlink(path, target, sizeof target - 1);
    if (k > 0) {
      target[k] = 0;
      n += strstr(target, needle) != NULL;
    }
  }
  closedir(d);
  return n;
}

static int sender_main(int argc, char **argv) {
  if (argc < 8) return 2;
  scfg.mode = argv[2];
  scfg.chunks = strtoull(argv[3], 0, 0);
  scfg.chunk_size = strtoull(argv[4], 0, 0);
  scfg.uses = (uint32_t)strtoul(argv[5], 0, 0);
  scfg.fail_at = strtoll(argv[6], 0, 0);
  scfg.ttl_ms = strtoull(argv[7], 0, 0);
  int file_mode = strcmp(scfg.mode, "file") == 0;

  const char *nofile = getenv("VMMIPC_TEST_SENDER_NOFILE");
  if (nofile) set_nofile((rlim_t)strtoul(nofile, 0, 10));
  /* Start the server (its listener and Go's poller stay for the process's
   * life) before taking the baseline, so that "fds" shows exactly what the
   * registrations hold. */
  {
    uint64_t one = 4096;
    vmmipc_ticket warm;
    if (vmmipc_register(&one, 1, export_memfd, NULL, NULL, NULL, &warm) || vmmipc_unregister(&warm)) {
      printf("error warming up: %s\n", vmmipc_last_error());
      return 4;
    }
  }
  uint64_t total = scfg.chunks * scfg.chunk_size;
  unsigned char *mem = NULL;
  int fd = -1;
  if (file_mode) {
    fd = fill_memfd(SENDER_MEMFD_NAME, total, 0, 1, 0);
    if (fd < 0) return 3;
    mem = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mem == MAP_FAILED) return 3;
  }
  int base = count_fds(0);
  fd_sampler fs;
  fd_sampler_start(&fs, 0);
  vmmipc_options o = sender_options(scfg.uses, scfg.ttl_ms);
  int rc;
  if (file_mode) {
    rc = vmmipc_register_host_file(fd, total, scfg.chunk_size, on_release, &sregs[0].released, &o, &sregs[0].t);
  } else {
    uint64_t *sizes = malloc(scfg.chunks * sizeof *sizes);
    for (uint64_t i = 0; i < scfg.chunks; i++) sizes[i] = scfg.chunk_size;
    rc = vmmipc_register(sizes, scfg.chunks, export_memfd, on_release, &sregs[0].released, &o, &sregs[0].t);
    free(sizes);
  }
  sender_reply_ticket(rc);
  fflush(stdout);
  if (rc) return 4;

  char line[256];
  while (fgets(line, sizeof line, stdin)) {
    unsigned long long a = 0, b = 0;
    int slot = 0, want = 0;
    if (sscanf(line, "peek %llu", &a) == 1) {
      printf("%d\n", mem && a < total ? mem[a] : -1);
    } else if (sscanf(line, "poke %llu %llu", &a, &b) == 2) {
      if (mem && a < total) mem[a] = (unsigned char)b;
      printf("%d\n", mem && a < total);
    } else if (strncmp(line, "fds", 3) == 0) {
      sscanf(line, "fds %d", &want);
      /* The server closes a finished connection just after acknowledging
       * it: give the count a moment to settle. The sampler stops first (its
       * directory descriptor would count) and starts again after. */
      int sampling = !fs.stop;
      if (sampling) fd_sampler_stop(&fs);
      WAIT_UNTIL(count_fds(0) - base == want, 2000, NULL);
      printf("%d %d\n", count_fds(0) - base, fs.peak - base);
      if (sampling) fd_sampler_start(&fs, 0);
    } else if (strncmp(line, "memfds", 6) == 0) {
      printf("%d\n", count_fds_to("memfd:" SENDER_MEMFD_NAME));
    } else if (strncmp(line, "nosample", 8) == 0) {
      if (!fs.stop) fd_sampler_stop(&fs);
      printf("ok\n");
    } else if (strncmp(line, "exports", 7) == 0) {
      printf("%ld\n", __atomic_load_n(&sexports, __ATOMIC_SEQ_CST));
    } else if (strncmp(line, "live", 4) == 0) {
      uint64_t n = 0;
      rc = vmmipc_live_registrations(&n);
      printf("%llu\n", rc ? ~0ull : (unsigned long long)n);
    } else if (sscanf(line, "again-forged %d", &slot) == 1 && slot >= 0 && slot < nsregs) {
      vmmipc_ticket forged = sregs[slot].t;
      forged.bytes[TICKET_OFF_SECRET + 7] ^= 0x40;
      vmmipc_ticket out;
      rc = vmmipc_register_again(&forged, NULL, NULL, NULL, &out);
      printf("%d %s\n", rc, rc ? vmmipc_last_error() : "");
    } else if (sscanf(line, "again %d %llu %llu", &slot, &a, &b) == 3 && slot >= 0 && slot < nsregs &&
               nsregs < 64) {
      o = sender_options((uint32_t)a, b);
      sender_reply_ticket(vmmipc_register_again(&sregs[slot].t, on_release, &sregs[nsregs].released, &o,
                                                &sregs[nsregs].t));
    } else if (sscanf(line, "file-again %llu %llu", &a, &b) == 2 && file_mode && nsregs < 64) {
      o = sender_options((uint32_t)a, b);
      sender_reply_ticket(vmmipc_register_host_file(fd, total, scfg.chunk_size, on_release,
                                                    &sregs[nsregs].released, &o, &sregs[nsregs].t));
    } else if (sscanf(line, "newfile %llu %llu", &a, &b) == 2 && nsregs < 64) {
      int nfd = fill_memfd("vmmipc-test-other", total, 0, (unsigned)a, 0);
      o = sender_options((uint32_t)b, 0);
      rc = nfd < 0 ? VMMIPC_EINVAL
                   : vmmipc_register_host_file(nfd, total, scfg.chunk_size, on_release, &sregs[nsregs].released,
                                               &o, &sregs[nsregs].t);
      if (nfd >= 0) close(nfd); /* the library keeps its own duplicate */
      sender_reply_ticket(rc);
    } else if (strncmp(line, "close-reuse", 11) == 0 && file_mode) {
      /* Our descriptor's number comes to name another file. dup3 closes
       * the registered memfd and puts the new one at its number in one
       * step: close-then-open would race with the library's own threads,
       * which may take the freed number first. */
      int other = fill_memfd("vmmipc-test-other", total, 0, 2, 0);
      int same = other >= 0 && dup3(other, fd, O_CLOEXEC) == fd;
      if (other >= 0) close(other);
      printf("same %d\n", same);
    } else if (strncmp(line, "unregister", 10) == 0) {
      sscanf(line, "unregister %d", &slot);
      rc = slot >= 0 && slot < nsregs ? vmmipc_unregister(&sregs[slot].t) : VMMIPC_EINVAL;
      printf("%d %s\n", rc, rc ? vmmipc_last_error() : "");
    } else if (sscanf(line, "wait %d %llu", &slot, &a) == 2 && slot >= 0 && slot < nsregs) {
      rc = vmmipc_wait(&sregs[slot].t, (uint32_t)a);
      printf("%d %s\n", rc, rc ? vmmipc_last_error() : "");
    } else if (sscanf(line, "released-now %d", &slot) == 1 && slot >= 0 && slot < nsregs) {
      printf("%d\n", __atomic_load_n(&sregs[slot].released, __ATOMIC_SEQ_CST));
    } else if (strncmp(line, "released", 8) == 0) {
      sscanf(line, "released %d", &slot);
      if (slot < 0 || slot >= nsregs) slot = 0;
      WAIT_UNTIL(__atomic_load_n(&sregs[slot].released, __ATOMIC_SEQ_CST), 5000, NULL);
      printf("%d\n", __atomic_load_n(&sregs[slot].released, __ATOMIC_SEQ_CST));
    } else {
      printf("?\n");
    }
    fflush(stdout);
  }
  if (!fs.stop) fd_sampler_stop(&fs);
  return 0;
}

/* sender_start_env spawns a sender with an environment (NULL: ours) and
 * reads its ticket. */
static int sender_start_env(child *c, vmmipc_ticket *t, const char *mode, uint64_t chunks, uint64_t chunk_size,
                            uint32_t uses, int64_t fail_at, uint64_t ttl_ms, char *const *envp) {
  char a[5][32];
  snprintf(a[0], 32, "%llu", (unsigned long long)chunks);
  snprintf(a[1], 32, "%llu", (unsigned long long)chunk_size);
  snprintf(a[2], 32, "%u", uses);
  snprintf(a[3], 32, "%lld", (long long)fail_at);
  snprintf(a[4], 32, "%llu", (unsigned long long)ttl_ms);
  char *argv[] = {"vmmipc-test-sender", "sender", (char *)mode, a[0], a[1], a[2], a[3], a[4], NULL};
  child_opts o = {.envp = envp};
  if (child_spawn_with(c, "/proc/self/exe", argv, &o)) return -1;
  char line[2 * VMMIPC_TICKET_SIZE + 64];
  if (!fgets(line, sizeof line, c->out)) return -1;
  line[strcspn(line, "\n")] = 0;
  if (strncmp(line, "ticket ", 7) != 0) {
    fprintf(stderr, "  sender said: %s\n", line);
    return -1;
  }
  return hex_decode(line + 7, t->bytes, sizeof t->bytes);
}

/* sender_start spawns a sender and reads its ticket. */
static int sender_start(child *c, vmmipc_ticket *t, const char *mode, uint64_t chunks, uint64_t chunk_size,
                        uint32_t uses, int64_t fail_at, uint64_t ttl_ms) {
  return sender_start_env(c, t, mode, chunks, chunk_size, uses, fail_at, ttl_ms, NULL);
}

/* START_SENDER(s, t, mode, chunks, chunk_size, uses, fail_at, ttl_ms)
 * declares the child s and the ticket t, and starts a sender into them (the
 * arguments are sender_start's), or fails the test if it does not start. */
#define START_SENDER(s, t, ...) \
  child s;                      \
  vmmipc_ticket t;              \
  CHECK(sender_start(&s, &t, __VA_ARGS__) == 0, "sender did not start")

/* START_CACHED is START_SENDER, then one import of its ticket t
 * (import_and_unmap): it declares addr and size, where the import cache
 * keeps that mapping while the registration lives. */
#define START_CACHED(s, t, addr, size, ...) \
  START_SENDER(s, t, __VA_ARGS__);          \
  uint64_t addr, size;                      \
  if (import_and_unmap(&t, &addr, &size)) return 1

/* sender_ask_ticket sends a command that registers and reads the ticket;
 * on "error ..." it copies the reply into err (if not NULL). */
static int sender_ask_ticket(child *c, vmmipc_ticket *t, char *err, size_t errlen, const char *fmt, ...) {
  char line[2 * VMMIPC_TICKET_SIZE + 600];
  va_list ap;
  va_start(ap, fmt);
  int rc = child_vask(c, line, sizeof line, fmt, ap);
  va_end(ap);
  if (rc) return -1;
  if (strncmp(line, "ticket ", 7) != 0) {
    if (err && errlen) {
      size_t k = strlen(line) < errlen ? strlen(line) : errlen - 1;
      memcpy(err, line, k);
      err[k] = 0;
    }
    return -1;
  }
  return hex_decode(line + 7, t->bytes, sizeof t->bytes);
}

/* sender_ask_int sends a command and parses the first integer of the reply
 * (SENDER_GONE if it did not answer); the whole reply goes to buf if given. */
static int sender_ask_int(child *c, char *buf, size_t n, const char *fmt, ...) {
  char local[600];
  if (!buf) buf = local, n = sizeof local;
  va_list ap;
  va_start(ap, fmt);
  int rc = child_vask(c, buf, n, fmt, ap);
  va_end(ap);
  return rc ? SENDER_GONE : atoi(buf);
}

/* sender_fds asks the sender for its descriptors relative to its baseline
 * (waiting up to 2 s for want) and their peak since the last ask. */
static int sender_fds(child *c, int want, int *now, int *peak) {
  char buf[64];
  if (sender_ask_int(c, buf, sizeof buf, "fds %d", want) == SENDER_GONE) return -1;
  return sscanf(buf, "%d %d", now, peak) == 2 ? 0 : -1;
}
#endif
