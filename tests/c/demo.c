/* vmmipc_demo: two processes share one buffer of many chunks through
 * libvmmipc, one descriptor at a time, and check every byte.
 *
 *   vmmipc_demo [--host | --cuda] [--chunks N] [--chunk-size BYTES]
 *
 * Without --host/--cuda it uses the GPU when the CUDA driver and a device
 * are present (4096 chunks of 2 MiB), host memory otherwise (4096 chunks
 * of 64 KiB in one memfd). The sender registers the buffer and starts the
 * receiver (this program again, with posix_spawn); the receiver imports it
 * with vmmipc_import_stream, verifies it byte for byte, writes a marker the
 * sender then checks, and both print what they measured: the import call's
 * time (it maps the sender's memory: no byte is copied, so it is no
 * bandwidth), the bytes verified and the time that took, the whole
 * transfer's time as the sender saw it (receiver started to receiver
 * exited), and the extra descriptors each held: the most that a thread
 * reading /proc/self/fd in a loop saw during the transfer (a sample: a
 * descriptor that lives for microseconds may be missed, so it varies from
 * run to run) and, for the receiver, how many it still holds once it has
 * unmapped (exact). */
#define _GNU_SOURCE
#include <sys/mman.h>

#include "cuda_dlopen.h"
#include "testutil.h"

static int use_cuda = -1;
static uint64_t chunks = 4096, chunk_size = 0;

static void usage(void) {
  fprintf(stderr, "usage: vmmipc_demo [--host | --cuda] [--chunks N] [--chunk-size BYTES]\n");
  exit(2);
}

static int fail(const char *what, int rc) {
  fprintf(stderr, "vmmipc_demo: %s: %s: %s\n", what, vmmipc_strerror(rc), vmmipc_last_error());
  return 1;
}

/* ---- receiver ---- */

static int receive(const char *hex) {
  vmmipc_ticket t;
  if (hex_decode(hex, t.bytes, sizeof t.bytes)) return fail("bad ticket argument", VMMIPC_EINVAL);
  vmmipc_ticket_info info;
  int rc = vmmipc_ticket_decode(&t, &info);
  if (rc) return fail("vmmipc_ticket_decode", rc);
  int cuda = info.memory_kind == VMMIPC_MEMORY_CUDA;
  if (cuda && (!cuda_load() || cuda_use_device(0))) return fail("CUDA unavailable in the receiver", VMMIPC_ECUDA);

  int base = count_fds(0);
  fd_sampler fs;
  fd_sampler_start(&fs, 0);
  vmmipc_mapping m;
  double t0 = now_ms();
  rc = vmmipc_import_stream(&t, cuda ? VMMIPC_DEVICE_SAME : VMMIPC_DEVICE_HOST, NULL, &m);
  double ms = now_ms() - t0;
  int peak = fd_sampler_stop(&fs) - base;
  long samples = fs.samples;
  if (rc) return fail("vmmipc_import_stream", rc);

  /* Verify every byte, chunk by chunk (on the GPU: copied back first). */
  double v0 = now_ms();
  uint64_t bad = 0, step = info.total_size / info.chunk_count;
  unsigned char *buf = cuda ? malloc(step) : NULL;
  for (uint64_t off = 0; off < m.size; off += step) {
    uint64_t n = m.size - off < step ? m.size - off : step;
    const unsigned char *p = (const unsigned char *)(uintptr_t)(m.addr + off);
    if (cuda) {
      CUresult r = cu.DtoH(buf, m.addr + off, n);
      if (r) return fprintf(stderr, "cuMemcpyDtoH: %s\n", cu_err(r)), 1;
      p = buf;
    }
    for (uint64_t i = 0; i < n; i++) bad += p[i] != pattern(off + i, 3);
  }
  double verify_ms = now_ms() - v0;
  unsigned char marker = 0xA5;
  if (cuda)
    cu.HtoD(m.addr + m.size / 2, &marker, 1);
  else
    ((unsigned char *)(uintptr_t)m.addr)[m.size / 2] = marker;
  free(buf);
  uint64_t size = m.size;
  rc = vmmipc_unmap(&m);
  if (rc) return fail("vmmipc_unmap", rc);
  printf("receiver: imported %llu chunks, %llu bytes (%s) in %.1f ms: one vmmipc_import_stream call, "
         "which maps the sender's memory (no byte copied)\n",
         (unsigned long long)info.chunk_count, (unsigned long long)size, cuda ? "CUDA" : "host", ms);
  printf("receiver: verified %llu bytes in %.1f ms%s: %llu differ\n", (unsigned long long)size, verify_ms,
         cuda ? " (copied back to the host first)" : "", (unsigned long long)bad);
  printf("receiver: extra fds: at most %d seen while importing (%ld samples of /proc/self/fd), "
         "%d still open after vmmipc_unmap\n",
         peak, samples, count_fds(0) - base);
  return bad != 0;
}

/* ---- sender ---- */

/* make_cuda_buffer creates n chunks of size bytes with cuMemCreate (POSIX fd
 * shareable), maps them contiguously and fills them with the pattern. */
static int make_cuda_buffer(uint64_t n, uint64_t size, CUdeviceptr *base_out) {
  CUmemAllocationProp prop = {0};
  prop.type = 1;
  prop.requestedHandleTypes = 1;
  prop.location.type = 1;
  prop.location.id = 0;
  size_t gran = 0;
  CUresult r = cu.Granularity(&gran, &prop, 0);
  if (r || size % gran) return fprintf(stderr, "granularity %zu: %s\n", gran, cu_err(r)), 1;
  CUdeviceptr base;
  if ((r = cu.AddressReserve(&base, n * size, 0, 0, 0))) return fprintf(stderr, "cuMemAddressReserve: %s\n", cu_err(r)), 1;
  for (uint64_t i = 0; i < n; i++) {
    CUmemGenericAllocationHandle h;
    if ((r = cu.MemCreate(&h, size, &prop, 0)) || (r = cu.MemMap(base + i * size, size, 0, h, 0)))
      return fprintf(stderr, "chunk %llu: cuMemCreate/cuMemMap: %s\n", (unsigned long long)i, cu_err(r)), 1;
    cu.MemRelease(h); /* the mapping keeps it */
  }
  CUmemAccessDesc acc = {{1, 0}, 3};
  if ((r = cu.SetAccess(base, n * size, &acc, 1))) return fprintf(stderr, "cuMemSetAccess: %s\n", cu_err(r)), 1;
  unsigned char *host = malloc(size);
  for (uint64_t i = 0; i < n; i++) {
    for (uint64_t j = 0; j < size; j++) host[j] = pattern(i * size + j, 3);
    if ((r = cu.HtoD(base + i * size, host, size))) return fprintf(stderr, "cuMemcpyHtoD: %s\n", cu_err(r)), 1;
  }
  free(host);
  *base_out = base;
  return 0;
}

static int send_buffer(const char *self) {
  uint64_t total = chunks * chunk_size;
  vmmipc_ticket t;
  int rc;
  CUdeviceptr dbase = 0;
  unsigned char *host = NULL;
  if (use_cuda) {
    if (cuda_use_device(0) || make_cuda_buffer(chunks, chunk_size, &dbase)) return 1;
    rc = vmmipc_register_cuda(dbase, total, NULL, &t);
  } else {
    int fd = memfd_create("vmmipc-demo", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, (off_t)total)) return perror("memfd"), 1;
    host = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    for (uint64_t i = 0; i < total; i++) host[i] = pattern(i, 3);
    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK);
    rc = vmmipc_register_host_file(fd, total, chunk_size, NULL, NULL, NULL, &t);
    close(fd); /* the library keeps its own duplicate; our mapping keeps the memory */
  }
  if (rc) return fail("register", rc);
  printf("sender:   registered %llu chunks of %llu bytes (%s), %llu bytes in all; %s\n",
         (unsigned long long)chunks, (unsigned long long)chunk_size, use_cuda ? "CUDA VMM" : "host memfd",
         (unsigned long long)total,
         use_cuda ? "no descriptor opened" : "no descriptor per chunk (the library keeps one of the memfd)");
  fflush(stdout);

  char hex[2 * VMMIPC_TICKET_SIZE + 1];
  hex_encode(t.bytes, sizeof t.bytes, hex);
  int base = count_fds(0);
  fd_sampler fs;
  fd_sampler_start(&fs, 0);
  char *argv[] = {(char *)self, "--receive", hex, NULL};
  pid_t pid;
  double t0 = now_ms();
  if (posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ)) return perror("posix_spawn"), 1;
  int st = 0;
  waitpid(pid, &st, 0);
  double ms = now_ms() - t0;
  int peak = fd_sampler_stop(&fs) - base;
  long samples = fs.samples;
  unsigned char seen = 0;
  if (use_cuda)
    cu.DtoH(&seen, dbase + total / 2, 1);
  else
    seen = host[total / 2];
  printf("sender:   whole transfer %.1f ms (receiver process started, imported, verified, unmapped, "
         "exited); receiver's write %s\n",
         ms, seen == 0xA5 ? "visible here" : "NOT visible");
  printf("sender:   extra fds: at most %d seen while serving (%ld samples of /proc/self/fd)\n", peak, samples);
  int ok = WIFEXITED(st) && WEXITSTATUS(st) == 0 && seen == 0xA5;
  printf("demo: %s\n", ok ? "OK, every byte verified" : "FAILED");
  return !ok;
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--receive") && i + 1 < argc) return receive(argv[i + 1]);
    if (!strcmp(argv[i], "--host")) use_cuda = 0;
    else if (!strcmp(argv[i], "--cuda")) use_cuda = 1;
    else if (!strcmp(argv[i], "--chunks") && i + 1 < argc) chunks = strtoull(argv[++i], 0, 0);
    else if (!strcmp(argv[i], "--chunk-size") && i + 1 < argc) chunk_size = strtoull(argv[++i], 0, 0);
    else usage();
  }
  int have_gpu = use_cuda != 0 && cuda_load();
  if (use_cuda == 1 && !have_gpu) {
    fprintf(stderr, "vmmipc_demo: --cuda: no CUDA driver or device\n");
    return 1;
  }
  use_cuda = have_gpu;
  if (!chunk_size) chunk_size = use_cuda ? 2 << 20 : 64 << 10;
  if (!use_cuda) printf("demo: no GPU here; sharing host memory (use --cuda on a GPU host)\n");
  return send_buffer(argv[0]);
}
