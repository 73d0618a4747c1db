/* cuda_check.h: what the CUDA example programs need of the driver API
 * beside vmmipc: a check that says which call failed, the primary context
 * of a device, and the byte pattern the senders write. Defined plainly, not
 * static, as in ../common.h: each example is one file, and some use only
 * part of this. */
#ifndef VMMIPC_EXAMPLE_CUDA_CHECK_H
#define VMMIPC_EXAMPLE_CUDA_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <cuda.h>

/* cuda_ok returns 1 if r is CUDA_SUCCESS; otherwise it says on stderr which
 * call failed and why, and returns 0. */
int cuda_ok(CUresult r, const char *call) {
  if (r == CUDA_SUCCESS) return 1;
  const char *name = NULL;
  cuGetErrorName(r, &name);
  fprintf(stderr, "%s: %s\n", call, name ? name : "unknown CUDA error");
  return 0;
}

/* retain_primary initializes the driver and retains the primary context of
 * GPU `ordinal` (give it back with cuDevicePrimaryCtxRelease(*dev)).
 * Returns 0, or -1 after saying what failed. */
int retain_primary(int ordinal, CUdevice *dev, CUcontext *ctx) {
  if (!cuda_ok(cuInit(0), "cuInit") || !cuda_ok(cuDeviceGet(dev, ordinal), "cuDeviceGet") ||
      !cuda_ok(cuDevicePrimaryCtxRetain(ctx, *dev), "cuDevicePrimaryCtxRetain"))
    return -1;
  return 0;
}

/* fill_pattern writes byte i = i % 251 to [dptr, dptr + size) through the
 * current context (what the receivers check). Returns 0, or -1 after saying
 * what failed. */
int fill_pattern(CUdeviceptr dptr, size_t size) {
  unsigned char *pattern = malloc(size);
  if (pattern == NULL) {
    fprintf(stderr, "fill_pattern: out of host memory for %zu bytes\n", size);
    return -1;
  }
  for (size_t i = 0; i < size; i++) pattern[i] = (unsigned char)(i % 251);
  int ok = cuda_ok(cuMemcpyHtoD(dptr, pattern, size), "cuMemcpyHtoD");
  free(pattern);
  return ok ? 0 : -1;
}

#endif
