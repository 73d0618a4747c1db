/* A profiling stand-in for libcuda.so.1: every entry point libvmmipc looks
 * up forwards to the real driver and adds up the calls and the time spent
 * in them. At exit it prints one JSON line on stdout:
 *
 *   {"approach":"driver_profile","pid":P,"cmdline":"...","calls":{"cuMemMap":[count,ms],...}}
 *
 * Load it into libvmmipc (and only there) with VMMIPC_LIBCUDA=path/to/it.so:
 * then wall time minus driver time is what the transport costs, per process.
 * Built by bench/run.sh; never part of the library. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;

static void *real_lib;
static void *real(const char *name) {
  if (!real_lib) real_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  return real_lib ? dlsym(real_lib, name) : NULL;
}

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

enum { MAX_ENTRIES = 32 };
static struct { const char *name; uint64_t count; double us; } stats[MAX_ENTRIES];
static int nstats;

static pthread_mutex_t slot_mu = PTHREAD_MUTEX_INITIALIZER;
static int slot(const char *name) {
  pthread_mutex_lock(&slot_mu);
  int i = 0;
  while (i < nstats && strcmp(stats[i].name, name)) i++;
  if (i == nstats) stats[nstats++].name = name;
  pthread_mutex_unlock(&slot_mu);
  return i;
}

/* FORWARD defines name(params) that calls the real name(args) and times it.
 * The count is atomic; the time is not (libvmmipc makes each kind of call
 * from one thread at a time per transfer). */
#define FORWARD(name, params, args)                                        \
  CUresult name params {                                                   \
    static CUresult(*fn) params;                                           \
    static int idx = -1;                                                   \
    if (!fn) fn = (CUresult(*) params)real(#name);                         \
    if (idx < 0) idx = slot(#name);                                        \
    if (!fn) return 3; /* CUDA_ERROR_NOT_INITIALIZED */                    \
    double t0_ = now_us();                                                 \
    CUresult r_ = fn args;                                                 \
    double d_ = now_us() - t0_;                                            \
    __atomic_add_fetch(&stats[idx].count, 1, __ATOMIC_RELAXED);            \
    double old = stats[idx].us; /* a lost update only blurs the profile */ \
    stats[idx].us = old + d_;                                              \
    return r_;                                                             \
  }

typedef unsigned long long U64;
typedef void *P;
FORWARD(cuInit, (unsigned f), (f))
FORWARD(cuDeviceGet, (int *d, int o), (d, o))
FORWARD(cuDeviceGetCount, (int *n), (n))
FORWARD(cuDeviceGetUuid_v2, (P u, int d), (u, d))
FORWARD(cuDeviceGetUuid, (P u, int d), (u, d))
FORWARD(cuDeviceCanAccessPeer, (int *c, int d, int p), (c, d, p))
FORWARD(cuDevicePrimaryCtxRetain, (P *c, int d), (c, d))
FORWARD(cuCtxGetCurrent, (P *c), (c))
FORWARD(cuCtxPushCurrent_v2, (P c), (c))
FORWARD(cuCtxPopCurrent_v2, (P *c), (c))
FORWARD(cuMemGetAddressRange_v2, (U64 *b, size_t *s, U64 p), (b, s, p))
FORWARD(cuMemRetainAllocationHandle, (U64 *h, P p), (h, p))
FORWARD(cuMemGetAllocationPropertiesFromHandle, (P prop, U64 h), (prop, h))
FORWARD(cuMemGetAllocationGranularity, (size_t *g, const void *prop, int o), (g, prop, o))
FORWARD(cuMemExportToShareableHandle, (P out, U64 h, int t, U64 f), (out, h, t, f))
FORWARD(cuMemImportFromShareableHandle, (U64 *h, P os, int t), (h, os, t))
FORWARD(cuMemAddressReserve, (U64 *p, size_t s, size_t a, U64 hint, U64 f), (p, s, a, hint, f))
FORWARD(cuMemAddressFree, (U64 p, size_t s), (p, s))
FORWARD(cuMemMap, (U64 p, size_t s, size_t o, U64 h, U64 f), (p, s, o, h, f))
FORWARD(cuMemUnmap, (U64 p, size_t s), (p, s))
FORWARD(cuMemSetAccess, (U64 p, size_t s, const void *d, size_t n), (p, s, d, n))
FORWARD(cuMemRelease, (U64 h), (h))

CUresult cuGetErrorName(CUresult r, const char **s) {
  static CUresult (*fn)(CUresult, const char **);
  if (!fn) fn = (CUresult(*)(CUresult, const char **))real("cuGetErrorName");
  return fn ? fn(r, s) : 1;
}

__attribute__((destructor)) static void report(void) {
  if (!nstats) return;
  char cmd[512] = "";
  FILE *f = fopen("/proc/self/cmdline", "r");
  if (f) {
    size_t n = fread(cmd, 1, sizeof cmd - 1, f);
    fclose(f);
    for (size_t i = 0; i < n; i++)
      if ((unsigned char)cmd[i] < 0x20 || cmd[i] == '"' || cmd[i] == '\\') cmd[i] = ' ';
    cmd[n] = 0;
    if (n > 120) cmd[120] = 0; /* the ticket is long and says nothing */
  }
  char line[4096];
  int j = snprintf(line, sizeof line, "{\"approach\":\"driver_profile\",\"pid\":%d,\"cmdline\":\"%s\",\"calls\":{",
                   (int)getpid(), cmd);
  for (int i = 0; i < nstats && j < (int)sizeof line - 128; i++)
    j += snprintf(line + j, sizeof line - j, "%s\"%s\":[%llu,%.3f]", i ? "," : "", stats[i].name,
                  (unsigned long long)stats[i].count, stats[i].us / 1e3);
  snprintf(line + j, sizeof line - j, "}}\n");
  fflush(stdout);
  if (write(1, line, strlen(line)) < 0) return;
}
