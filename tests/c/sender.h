/* The sender role of the C tests: a separate process (spawned with
 * posix_spawn) that registers a buffer of memfd chunks, prints its ticket,
 * and then answers commands on stdin. */
#ifndef VMMIPC_TEST_SENDER_H
#define VMMIPC_TEST_SENDER_H
#include <sys/mman.h>

#include "testutil.h"

typedef struct sender_cfg {
  int file_mode;       /* 1: one memfd, vmmipc_register_host_file; 0: export_fn */
  uint64_t chunks, chunk_size;
  uint32_t uses;
  int64_t fail_at;     /* export_fn fails at this chunk (-1: never) */
  uint64_t ttl_ms;
} sender_cfg;

static sender_cfg scfg;
static volatile int released;

/* export_fn of callback mode: materializes chunk i as a fresh memfd, so the
 * sender holds no descriptor between requests. */
static int export_memfd(void *user, uint64_t index, int *fd_out) {
  (void)user;
  if ((int64_t)index == scfg.fail_at) return -5;
  int fd = memfd_create("vmmipc-test-chunk", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  unsigned char *buf = malloc(scfg.chunk_size);
  for (uint64_t i = 0; i < scfg.chunk_size; i++) buf[i] = pattern(index * scfg.chunk_size + i, 1);
  ssize_t w = pwrite(fd, buf, scfg.chunk_size, 0);
  free(buf);
  if (w != (ssize_t)scfg.chunk_size || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    close(fd);
    return -1;
  }
  *fd_out = fd;
  return 0;
}

static void on_release(void *user) {
  (void)user;
  released++;
}

static int sender_main(int argc, char **argv) {
  if (argc < 8) return 2;
  scfg.file_mode = strcmp(argv[2], "file") == 0;
  scfg.chunks = strtoull(argv[3], 0, 0);
  scfg.chunk_size = strtoull(argv[4], 0, 0);
  scfg.uses = (uint32_t)strtoul(argv[5], 0, 0);
  scfg.fail_at = strtoll(argv[6], 0, 0);
  scfg.ttl_ms = strtoull(argv[7], 0, 0);

  const char *nofile = getenv("VMMIPC_TEST_SENDER_NOFILE");
  if (nofile) set_nofile((rlim_t)strtoul(nofile, 0, 10));
  vmmipc_options o;
  vmmipc_options_init(&o, sizeof o);
  o.uses = scfg.uses;
  o.ttl_ms = scfg.ttl_ms;
  vmmipc_ticket t;
  int rc;
  unsigned char *mem = NULL;
  uint64_t total = scfg.chunks * scfg.chunk_size;
  if (scfg.file_mode) {
    int fd = memfd_create("vmmipc-test-buffer", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, (off_t)total)) return 3;
    mem = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    for (uint64_t i = 0; i < total; i++) mem[i] = pattern(i, 1);
    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK);
    rc = vmmipc_register_host_file(fd, total, scfg.chunk_size, on_release, NULL, &o, &t);
  } else {
    uint64_t *sizes = malloc(scfg.chunks * sizeof *sizes);
    for (uint64_t i = 0; i < scfg.chunks; i++) sizes[i] = scfg.chunk_size;
    rc = vmmipc_register(sizes, scfg.chunks, export_memfd, on_release, NULL, &o, &t);
    free(sizes);
  }
  if (rc) {
    printf("error %d %s\n", rc, vmmipc_last_error());
    fflush(stdout);
    return 4;
  }
  char hex[2 * VMMIPC_TICKET_SIZE + 1];
  hex_encode(t.bytes, sizeof t.bytes, hex);
  int base = count_fds(0);
  fd_sampler fs;
  fd_sampler_start(&fs, 0);
  printf("ticket %s\n", hex);
  fflush(stdout);

  char line[256];
  while (fgets(line, sizeof line, stdin)) {
    unsigned long long arg;
    if (sscanf(line, "peek %llu", &arg) == 1) {
      printf("%d\n", mem && arg < total ? mem[arg] : -1);
    } else if (strncmp(line, "fds", 3) == 0) {
      /* The server closes a finished connection just after acknowledging
       * it: give the count a moment to come back to the baseline. */
      if (!fs.stop) fd_sampler_stop(&fs); /* its directory fd would count */
      double until = now_ms() + 2000;
      while (count_fds(0) != base && now_ms() < until) usleep(1000);
      printf("%d %d\n", count_fds(0) - base, fs.peak - base);
    } else if (strncmp(line, "released", 8) == 0) {
      double until = now_ms() + 5000;
      while (!released && now_ms() < until) usleep(1000);
      printf("%d\n", released);
    } else if (strncmp(line, "unregister", 10) == 0) {
      rc = vmmipc_unregister(&t);
      printf("%d %s\n", rc, rc ? vmmipc_last_error() : "");
    } else {
      printf("?\n");
    }
    fflush(stdout);
  }
  if (!fs.stop) fd_sampler_stop(&fs);
  return 0;
}

/* sender_start spawns a sender and reads its ticket. */
static int sender_start(child *c, vmmipc_ticket *t, const char *mode, uint64_t chunks,
                        uint64_t chunk_size, uint32_t uses, int64_t fail_at, uint64_t ttl_ms) {
  char a[5][32];
  snprintf(a[0], 32, "%llu", (unsigned long long)chunks);
  snprintf(a[1], 32, "%llu", (unsigned long long)chunk_size);
  snprintf(a[2], 32, "%u", uses);
  snprintf(a[3], 32, "%lld", (long long)fail_at);
  snprintf(a[4], 32, "%llu", (unsigned long long)ttl_ms);
  char *argv[] = {"vmmipc-test-sender", "sender", (char *)mode, a[0], a[1], a[2], a[3], a[4], NULL};
  if (child_spawn(c, argv)) return -1;
  char line[2 * VMMIPC_TICKET_SIZE + 64];
  if (!fgets(line, sizeof line, c->out)) return -1;
  line[strcspn(line, "\n")] = 0;
  if (strncmp(line, "ticket ", 7) != 0) {
    fprintf(stderr, "  sender said: %s\n", line);
    return -1;
  }
  return hex_decode(line + 7, t->bytes, sizeof t->bytes);
}
#endif
