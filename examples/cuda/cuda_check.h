/* cuda_check.h: what both CUDA example programs need of the driver API
 * beside vmmipc: a check that says which call failed, and the primary
 * context of a device. */
#ifndef VMMIPC_EXAMPLE_CUDA_CHECK_H
#define VMMIPC_EXAMPLE_CUDA_CHECK_H

#include <stdio.h>
#include <cuda.h>

/* cuda_ok returns 1 if r is CUDA_SUCCESS; otherwise it says on stderr which
 * call failed and why, and returns 0. */
static int cuda_ok(CUresult r, const char *call) {
  if (r == CUDA_SUCCESS) return 1;
  const char *name = NULL;
  cuGetErrorName(r, &name);
  fprintf(stderr, "%s: %s\n", call, name ? name : "unknown CUDA error");
  return 0;
}

/* retain_primary initializes the driver and retains the primary context of
 * GPU `ordinal` (give it back with cuDevicePrimaryCtxRelease(*dev)).
 * Returns 0, or -1 after saying what failed. */
static int retain_primary(int ordinal, CUdevice *dev, CUcontext *ctx) {
  if (!cuda_ok(cuInit(0), "cuInit") || !cuda_ok(cuDeviceGet(dev, ordinal), "cuDeviceGet") ||
      !cuda_ok(cuDevicePrimaryCtxRetain(ctx, *dev), "cuDevicePrimaryCtxRetain"))
    return -1;
  return 0;
}

#endif
