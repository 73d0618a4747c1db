/* Opens libcuda.so.1 at run time and calls its entry points through the
 * small wrappers declared in driver.h. The Go side (driver.go) serialises
 * vcu_load and calls the wrappers only after it succeeded. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "driver.h"

/* The entry points, by their exact exported names. The unsuffixed names of
 * cuda.h are macros for the _v2 variants where cuda.h says so (CUDA 12 and
 * 13 alike): cuCtxPushCurrent_v2, cuCtxPopCurrent_v2 and
 * cuMemGetAddressRange_v2 (the plain cuMemGetAddressRange takes 32-bit
 * sizes), and cuDeviceTotalMem_v2 (the plain one writes an unsigned int).
 * cuCtxSynchronize is the plain name on purpose: it takes no argument, as
 * declared here; a _v2 of it, where one exists, takes a context. cuDeviceGetUuid_v2 (driver 11.4+; also names MIG instances) is
 * preferred, with the plain name as a fallback for older drivers. */
static struct {
  CUresult (*Init)(unsigned int);
  CUresult (*GetErrorName)(CUresult, const char **);
  CUresult (*DeviceGet)(CUdevice *, int);
  CUresult (*DeviceGetCount)(int *);
  CUresult (*DeviceGetUuid)(CUuuid *, CUdevice);
  CUresult (*DeviceCanAccessPeer)(int *, CUdevice, CUdevice);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*CtxGetCurrent)(CUcontext *);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext *);
  CUresult (*MemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
  CUresult (*MemRetainAllocationHandle)(CUmemGenericAllocationHandle *, void *);
  CUresult (*MemGetAllocationPropertiesFromHandle)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
  CUresult (*MemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
  CUresult (*MemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
  CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
  CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*MemAddressFree)(CUdeviceptr, size_t);
  CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*MemUnmap)(CUdeviceptr, size_t);
  CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*MemRelease)(CUmemGenericAllocationHandle);
  CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
  CUresult (*DeviceTotalMem)(size_t *, CUdevice);
  CUresult (*CtxSynchronize)(void);
} cu;

struct symbol {
  const char *name;
  const char *fallback; /* tried when name is missing; NULL if none */
  void **slot;
};

#define SLOT(f) ((void **)&cu.f)
static const struct symbol symbols[] = {
    {"cuInit", NULL, SLOT(Init)},
    {"cuGetErrorName", NULL, SLOT(GetErrorName)},
    {"cuDeviceGet", NULL, SLOT(DeviceGet)},
    {"cuDeviceGetCount", NULL, SLOT(DeviceGetCount)},
    {"cuDeviceGetUuid_v2", "cuDeviceGetUuid", SLOT(DeviceGetUuid)},
    {"cuDeviceCanAccessPeer", NULL, SLOT(DeviceCanAccessPeer)},
    {"cuDevicePrimaryCtxRetain", NULL, SLOT(DevicePrimaryCtxRetain)},
    {"cuCtxGetCurrent", NULL, SLOT(CtxGetCurrent)},
    {"cuCtxPushCurrent_v2", NULL, SLOT(CtxPushCurrent)},
    {"cuCtxPopCurrent_v2", NULL, SLOT(CtxPopCurrent)},
    {"cuMemGetAddressRange_v2", NULL, SLOT(MemGetAddressRange)},
    {"cuMemRetainAllocationHandle", NULL, SLOT(MemRetainAllocationHandle)},
    {"cuMemGetAllocationPropertiesFromHandle", NULL, SLOT(MemGetAllocationPropertiesFromHandle)},
    {"cuMemGetAllocationGranularity", NULL, SLOT(MemGetAllocationGranularity)},
    {"cuMemExportToShareableHandle", NULL, SLOT(MemExportToShareableHandle)},
    {"cuMemImportFromShareableHandle", NULL, SLOT(MemImportFromShareableHandle)},
    {"cuMemAddressReserve", NULL, SLOT(MemAddressReserve)},
    {"cuMemAddressFree", NULL, SLOT(MemAddressFree)},
    {"cuMemMap", NULL, SLOT(MemMap)},
    {"cuMemUnmap", NULL, SLOT(MemUnmap)},
    {"cuMemSetAccess", NULL, SLOT(MemSetAccess)},
    {"cuMemRelease", NULL, SLOT(MemRelease)},
    {"cuMemCreate", NULL, SLOT(MemCreate)},
    {"cuDeviceTotalMem_v2", NULL, SLOT(DeviceTotalMem)},
    {"cuCtxSynchronize", NULL, SLOT(CtxSynchronize)},
};
#undef SLOT

static void *library; /* kept open for the life of the process once loaded */

/* lookup clears dlerror, calls dlsym and reads dlerror right after, all in
 * this one call on one thread: a NULL from dlsym alone is not an error. */
static void *lookup(void *lib, const char *name, const char **why) {
  dlerror();
  void *p = dlsym(lib, name);
  const char *e = dlerror();
  if (e != NULL) {
    *why = e;
    return NULL;
  }
  if (p == NULL) *why = "the symbol is NULL";
  return p;
}

int vcu_load(const char *path, char *err, size_t errlen, CUresult *init_result) {
  if (library == NULL) {
    dlerror();
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
      const char *e = dlerror();
      snprintf(err, errlen, "%s", e ? e : "dlopen failed");
      return VCU_LOAD_DLOPEN;
    }
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
      const char *why = NULL;
      void *p = lookup(lib, symbols[i].name, &why);
      if (p == NULL && symbols[i].fallback != NULL)
        p = lookup(lib, symbols[i].fallback, &why);
      if (p == NULL) {
        snprintf(err, errlen, "entry point %s not found (%s)", symbols[i].name, why);
        memset(&cu, 0, sizeof cu);
        dlclose(lib); /* nothing of it ran yet */
        return VCU_LOAD_DLSYM;
      }
      *symbols[i].slot = p;
    }
    library = lib;
  }
  /* cuInit may fail (no device, driver/library mismatch) and succeed on a
   * later try; the library stays loaded either way. */
  CUresult r = cu.Init(0);
  if (r != 0) {
    *init_result = r;
    return VCU_LOAD_INIT;
  }
  return VCU_LOAD_OK;
}

const char *vcu_error_name(CUresult r) {
  const char *s = NULL;
  if (cu.GetErrorName == NULL || cu.GetErrorName(r, &s) != 0) return NULL;
  return s;
}

CUresult vcu_device_get(CUdevice *dev, int ordinal) { return cu.DeviceGet(dev, ordinal); }
CUresult vcu_device_get_count(int *count) { return cu.DeviceGetCount(count); }
CUresult vcu_device_get_uuid(CUuuid *uuid, CUdevice dev) { return cu.DeviceGetUuid(uuid, dev); }
CUresult vcu_device_can_access_peer(int *can, CUdevice dev, CUdevice peer) {
  return cu.DeviceCanAccessPeer(can, dev, peer);
}

CUresult vcu_primary_ctx_retain(uintptr_t *ctx, CUdevice dev) {
  CUcontext c = NULL;
  CUresult r = cu.DevicePrimaryCtxRetain(&c, dev);
  *ctx = (uintptr_t)c;
  return r;
}

CUresult vcu_ctx_get_current(uintptr_t *ctx) {
  CUcontext c = NULL;
  CUresult r = cu.CtxGetCurrent(&c);
  *ctx = (uintptr_t)c;
  return r;
}

CUresult vcu_ctx_push(uintptr_t ctx) { return cu.CtxPushCurrent((CUcontext)ctx); }

CUresult vcu_ctx_pop(uintptr_t *ctx) {
  CUcontext c = NULL;
  CUresult r = cu.CtxPopCurrent(&c);
  *ctx = (uintptr_t)c;
  return r;
}

CUresult vcu_mem_get_address_range(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
  return cu.MemGetAddressRange(base, size, p);
}

CUresult vcu_mem_retain_allocation_handle(CUmemGenericAllocationHandle *h, CUdeviceptr p) {
  return cu.MemRetainAllocationHandle(h, (void *)(uintptr_t)p);
}

CUresult vcu_mem_get_allocation_properties(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
  /* Room to spare in case a later driver's struct is larger than ours. */
  union {
    CUmemAllocationProp prop;
    unsigned char room[256];
  } out;
  memset(&out, 0, sizeof out);
  CUresult r = cu.MemGetAllocationPropertiesFromHandle(&out.prop, h);
  *prop = out.prop;
  return r;
}

/* exportable_prop: device memory on device_ordinal that may be exported as
 * a POSIX file descriptor, what vmmipc shares. Every other field zero
 * (win32HandleMetaData must be, allocFlags: no compression, no RDMA). */
static CUmemAllocationProp exportable_prop(int device_ordinal) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = VCU_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = VCU_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = VCU_LOCATION_TYPE_DEVICE;
  prop.location.id = device_ordinal;
  return prop;
}

CUresult vcu_mem_get_granularity(size_t *gran, int device_ordinal) {
  CUmemAllocationProp prop = exportable_prop(device_ordinal);
  return cu.MemGetAllocationGranularity(gran, &prop, VCU_GRANULARITY_MINIMUM);
}

CUresult vcu_mem_create_exportable(CUmemGenericAllocationHandle *h, size_t size, int device_ordinal) {
  /* size: a multiple of the minimum granularity of this same prop (the
   * caller checks); flags: must be 0. */
  CUmemAllocationProp prop = exportable_prop(device_ordinal);
  return cu.MemCreate(h, size, &prop, 0);
}

CUresult vcu_device_total_mem(size_t *bytes, CUdevice dev) { return cu.DeviceTotalMem(bytes, dev); }

CUresult vcu_ctx_synchronize(void) { return cu.CtxSynchronize(); }

CUresult vcu_mem_export_fd(int *fd, CUmemGenericAllocationHandle h) {
  *fd = -1;
  return cu.MemExportToShareableHandle(fd, h, VCU_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
}

CUresult vcu_mem_import_fd(CUmemGenericAllocationHandle *h, int fd) {
  /* For POSIX file descriptors the "OS handle" is the fd itself, passed by
   * value in the pointer argument. The driver does not take the fd over. */
  return cu.MemImportFromShareableHandle(h, (void *)(uintptr_t)fd, VCU_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}

CUresult vcu_mem_address_reserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr hint) {
  return cu.MemAddressReserve(p, size, align, hint, 0);
}

CUresult vcu_mem_address_free(CUdeviceptr p, size_t size) { return cu.MemAddressFree(p, size); }

CUresult vcu_mem_map(CUdeviceptr p, size_t size, CUmemGenericAllocationHandle h) {
  return cu.MemMap(p, size, 0, h, 0);
}

CUresult vcu_mem_unmap(CUdeviceptr p, size_t size) { return cu.MemUnmap(p, size); }

CUresult vcu_mem_set_access_rw(CUdeviceptr p, size_t size, const int *ordinals, size_t count) {
  CUmemAccessDesc desc[128];
  if (count == 0 || count > sizeof desc / sizeof desc[0]) return 1; /* CUDA_ERROR_INVALID_VALUE */
  for (size_t i = 0; i < count; i++) {
    desc[i].location.type = VCU_LOCATION_TYPE_DEVICE;
    desc[i].location.id = ordinals[i];
    desc[i].flags = VCU_ACCESS_PROT_READWRITE;
  }
  return cu.MemSetAccess(p, size, desc, count);
}

CUresult vcu_mem_release(CUmemGenericAllocationHandle h) { return cu.MemRelease(h); }
