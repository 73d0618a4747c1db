/* The arena calls (vmmipc.h, "Arenas"): plain C, callable in a child made
 * by fork() of a process that loaded the library, where every other call
 * is VMMIPC_EFORK. Included by test_vmmipc.c. */
#include <sys/mman.h>
#include <sys/wait.h>

#include "testutil.h"

/* A worker forked after the library started claims a region, fills and
 * sends a block; the parent receives it (the bytes), frees it, and the
 * next child gets the same block back, a new generation; a stale or
 * damaged block is refused; the dead child's region is reaped. */
static int test_arena_across_fork(void) {
  uint64_t size, n;
  CHECK_RC(vmmipc_live_registrations(&n), VMMIPC_OK); /* the Go runtime runs here */
  CHECK_RC(vmmipc_arena_size(1, 8, 1 << 16, &size), VMMIPC_OK);
  void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  CHECK(base != MAP_FAILED, "mmap");
  CHECK_RC(vmmipc_arena_format(base, size, 1, 8, 1 << 16), VMMIPC_OK);
  CHECK_SAYS(vmmipc_arena_format(base, size, 1, 8, 1 << 16), VMMIPC_EINVAL, "formatted already", NULL);
  vmmipc_arena_block got[2];
  for (int round = 0; round < 2; round++) {
    int p[2];
    CHECK(pipe(p) == 0, "pipe");
    pid_t pid = fork();
    if (pid == 0) {
      uint32_t region;
      vmmipc_arena_block b;
      int ok = vmmipc_options_init(NULL, 0) == VMMIPC_EFORK && /* Go is not here */
               vmmipc_arena_claim(base, size, (uint32_t)getpid(), &region) == VMMIPC_OK &&
               vmmipc_arena_alloc(base, size, region, 1000, &b) == VMMIPC_OK;
      if (ok) {
        memset((char *)base + b.offset, 'a' + round, b.nbytes);
        ok = vmmipc_arena_send(base, size, &b) == VMMIPC_OK &&
             vmmipc_arena_send(base, size, &b) == VMMIPC_ENOENT; /* once */
      }
      ok = ok && write(p[1], &b, sizeof b) == (ssize_t)sizeof b;
      _exit(ok ? 0 : 1); /* no leave: the region's owner is dead */
    }
    close(p[1]);
    int st;
    CHECK(read(p[0], &got[round], sizeof got[round]) == (ssize_t)sizeof got[round], "the child's block");
    close(p[0]);
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %#x", st);
    vmmipc_arena_block b = got[round];
    b.offset = 0; /* the table says where, not the message */
    CHECK_RC(vmmipc_arena_receive(base, size, &b), VMMIPC_OK);
    CHECK(b.offset == got[round].offset && b.nbytes == 1000, "offset %llu", (unsigned long long)b.offset);
    CHECK(((char *)base)[b.offset] == 'a' + round && ((char *)base)[b.offset + 999] == 'a' + round, "bytes");
    CHECK_SAYS(vmmipc_arena_receive(base, size, &b), VMMIPC_ENOENT, "received already", NULL);
    CHECK_RC(vmmipc_arena_free(base, size, &b), VMMIPC_OK);
    CHECK_RC(vmmipc_arena_free(base, size, &b), VMMIPC_ENOENT);
  }
  /* The second child took the first one's dead region over, and its block again. */
  CHECK(got[1].region == got[0].region && got[1].offset == got[0].offset &&
            got[1].generation == got[0].generation + 1,
        "reused: region %u/%u offset %llu/%llu", got[0].region, got[1].region,
        (unsigned long long)got[0].offset, (unsigned long long)got[1].offset);
  vmmipc_arena_block bad = got[1];
  bad.slot = 8;
  CHECK_SAYS(vmmipc_arena_receive(base, size, &bad), VMMIPC_EINVAL, "out of range", NULL);
  CHECK_SAYS(vmmipc_arena_receive(base, size - 4096, &got[1]), VMMIPC_EINVAL, "not an arena", NULL);
  uint32_t reaped;
  CHECK_RC(vmmipc_arena_reap(base, size, (uint32_t)getpid(), &reaped), VMMIPC_OK);
  CHECK(reaped == 1, "reaped %u", reaped);
  vmmipc_arena_info info;
  CHECK_RC(vmmipc_arena_get_info(base, size, &info, sizeof info), VMMIPC_OK);
  CHECK(info.regions_owned == 0 && info.blocks_held == 0 && info.blocks_sent == 0 && info.blocks_free == 1 &&
            info.takeovers == 2,
        "owned %u held %llu free %llu takeovers %llu", info.regions_owned, (unsigned long long)info.blocks_held,
        (unsigned long long)info.blocks_free, (unsigned long long)info.takeovers);
  munmap(base, size);
  return 0;
}
