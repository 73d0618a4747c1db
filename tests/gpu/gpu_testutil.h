/* Helpers shared by the single-file GPU tests (vmmipc_fault_test.c,
 * vmmipc_peer_test.c): a CUDA call check, PASS/FAIL lines with their counts,
 * buffers of 2 MiB chunks holding a known pattern, the primary context of a
 * device, tickets as hex on command lines, and starting this program again
 * in another role (posix_spawn: the library does not survive fork). Build
 * each test with tests/gpu/build.sh. */
#ifndef VMMIPC_GPU_TESTUTIL_H
#define VMMIPC_GPU_TESTUTIL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <cuda.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "vmmipc.h"

extern char **environ;

#define MIB (1ull << 20)
#define CHUNK (2 * MIB)

/* CU ends the process with a FAIL line when a driver call fails: the test
 * cannot go on without it. */
#define CU(call)                                                     \
  do {                                                               \
    CUresult r_ = (call);                                            \
    if (r_ != CUDA_SUCCESS) {                                        \
      const char *n_ = "?";                                          \
      cuGetErrorName(r_, &n_);                                       \
      printf("FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, n_); \
      exit(1);                                                       \
    }                                                                \
  } while (0)

static int passed, failed; /* PASS and FAIL lines this process printed */

/* check prints "PASS what" or "FAIL what", with ": detail" if detail is
 * not NULL, and counts it. */
static inline void check(int ok, const char *what, const char *detail) {
  printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", what, detail ? ": " : "", detail ? detail : "");
  fflush(stdout);
  ok ? passed++ : failed++;
}

/* pattern is the byte at offset off of a buffer filled with seed. */
static inline unsigned char pattern(uint64_t off, unsigned seed) {
  return (unsigned char)((off * 0x9E3779B97F4A7C15ull + seed) >> 56);
}

/* map_chunks reserves n chunks of device 0, backs each with its own
 * POSIX-fd shareable allocation and gives device 0 read-write access. With
 * keep, the allocation handles are stored there (the caller exports and
 * releases them); without, they are released at once (the mapping keeps
 * the memory). */
static inline CUdeviceptr map_chunks(uint64_t n, CUmemGenericAllocationHandle *keep) {
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUdeviceptr base;
  CU(cuMemAddressReserve(&base, n * CHUNK, 0, 0, 0));
  for (uint64_t i = 0; i < n; i++) {
    CUmemGenericAllocationHandle h;
    CU(cuMemCreate(&h, CHUNK, &prop, 0));
    CU(cuMemMap(base + i * CHUNK, CHUNK, 0, h, 0));
    if (keep) keep[i] = h;
    else CU(cuMemRelease(h));
  }
  CUmemAccessDesc a = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CU(cuMemSetAccess(base, n * CHUNK, &a, 1));
  return base;
}

/* fill writes the pattern of seed over [base, base + size), a chunk at a
 * time, through the current context. */
static inline void fill(CUdeviceptr base, uint64_t size, unsigned seed) {
  unsigned char *h = malloc(CHUNK);
  for (uint64_t off = 0; off < size; off += CHUNK) {
    for (uint64_t i = 0; i < CHUNK; i++) h[i] = pattern(off + i, seed);
    CU(cuMemcpyHtoD(base + off, h, CHUNK));
  }
  free(h);
}

/* count_wrong copies [base, base + size) back a chunk at a time and counts
 * the bytes that differ from the pattern of seed. */
static inline uint64_t count_wrong(CUdeviceptr base, uint64_t size, unsigned seed) {
  unsigned char *h = malloc(CHUNK);
  uint64_t bad = 0;
  for (uint64_t off = 0; off < size; off += CHUNK) {
    CU(cuMemcpyDtoH(h, base + off, CHUNK));
    for (uint64_t i = 0; i < CHUNK; i++) bad += h[i] != pattern(off + i, seed);
  }
  free(h);
  return bad;
}

/* use_device makes the primary context of device ordinal current on this
 * thread and returns it (cuInit must have run). */
static inline CUcontext use_device(int ordinal) {
  CUdevice d;
  CUcontext c;
  CU(cuDeviceGet(&d, ordinal));
  CU(cuDevicePrimaryCtxRetain(&c, d));
  CU(cuCtxSetCurrent(c));
  return c;
}

/* A ticket on a command line: 2 * VMMIPC_TICKET_SIZE hex digits. */
static inline void ticket_to_hex(const vmmipc_ticket *t, char out[2 * VMMIPC_TICKET_SIZE + 1]) {
  for (int i = 0; i < VMMIPC_TICKET_SIZE; i++) sprintf(out + 2 * i, "%02x", t->bytes[i]);
}

static inline void ticket_from_hex(const char *s, vmmipc_ticket *t) {
  for (int i = 0; i < VMMIPC_TICKET_SIZE; i++) sscanf(s + 2 * i, "%2hhx", &t->bytes[i]);
}

/* spawn_self starts this program with argv and envp (NULL: ours). With
 * stdout_fd, the child's stdout is a pipe whose read end is left there.
 * Returns the child's pid, or -1. */
static inline pid_t spawn_self(char *const argv[], char *const envp[], int *stdout_fd) {
  int p[2] = {-1, -1};
  if (stdout_fd && pipe(p)) return -1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (stdout_fd) {
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    posix_spawn_file_actions_addclose(&fa, p[0]);
  }
  pid_t pid;
  int rc = posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, envp ? envp : environ);
  posix_spawn_file_actions_destroy(&fa);
  if (stdout_fd) {
    close(p[1]);
    if (rc) close(p[0]);
    else *stdout_fd = p[0];
  }
  return rc ? -1 : pid;
}

#endif
