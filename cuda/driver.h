/* Our own minimal view of the CUDA driver API: just the types and entry
 * points libvmmipc calls, with the layouts of cuda.h (CUDA 12 and 13). No
 * CUDA toolkit is needed to build; libcuda.so.1 is opened at run time and
 * each entry point is found with dlsym (see driver.c). */
#ifndef VMMIPC_CUDA_DRIVER_H
#define VMMIPC_CUDA_DRIVER_H

#include <stddef.h>
#include <stdint.h>

#define VCU_HIDDEN __attribute__((visibility("hidden")))

typedef int CUresult; /* CUDA_SUCCESS = 0 */
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr; /* CUdeviceptr_v2 on 64-bit hosts */
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct {
  unsigned char bytes[16];
} CUuuid;

enum {
  VCU_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1, /* CUmemAllocationHandleType */
  VCU_LOCATION_TYPE_DEVICE = 0x1,              /* CUmemLocationType */
  VCU_ALLOCATION_TYPE_PINNED = 0x1,            /* CUmemAllocationType */
  VCU_ACCESS_PROT_READWRITE = 0x3,             /* CUmemAccess_flags */
  VCU_GRANULARITY_MINIMUM = 0x0,               /* CUmemAllocationGranularity_flags */
  VCU_ERROR_OUT_OF_MEMORY = 2,                 /* CUresult CUDA_ERROR_OUT_OF_MEMORY */
};

typedef struct {
  int type; /* CUmemLocationType */
  int id;   /* device ordinal for VCU_LOCATION_TYPE_DEVICE */
} CUmemLocation;

typedef struct {
  int type;                   /* CUmemAllocationType */
  int requestedHandleTypes;   /* CUmemAllocationHandleType bit mask */
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct {
  CUmemLocation location;
  int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

/* Loading. vcu_load opens the library at path, finds every entry point and
 * calls cuInit(0). It returns one of VCU_LOAD_* and, on failure, writes what
 * went wrong to err. Safe to call again after a failure. */
enum {
  VCU_LOAD_OK = 0,
  VCU_LOAD_DLOPEN = 1, /* err: dlerror() */
  VCU_LOAD_DLSYM = 2,  /* err: the missing symbol and dlerror() */
  VCU_LOAD_INIT = 3,   /* *init_result: what cuInit returned */
};
VCU_HIDDEN int vcu_load(const char *path, char *err, size_t errlen, CUresult *init_result);

/* The name of a CUresult ("CUDA_ERROR_OUT_OF_MEMORY"), or NULL if the
 * driver does not know it. */
VCU_HIDDEN const char *vcu_error_name(CUresult r);

/* One wrapper per entry point, same arguments as in cuda.h. Call only after
 * vcu_load returned VCU_LOAD_OK. Contexts cross to Go as uintptr_t. */
VCU_HIDDEN CUresult vcu_device_get(CUdevice *dev, int ordinal);
VCU_HIDDEN CUresult vcu_device_get_count(int *count);
VCU_HIDDEN CUresult vcu_device_get_uuid(CUuuid *uuid, CUdevice dev);
VCU_HIDDEN CUresult vcu_device_can_access_peer(int *can, CUdevice dev, CUdevice peer);
VCU_HIDDEN CUresult vcu_primary_ctx_retain(uintptr_t *ctx, CUdevice dev);
VCU_HIDDEN CUresult vcu_ctx_get_current(uintptr_t *ctx);
VCU_HIDDEN CUresult vcu_ctx_push(uintptr_t ctx);
VCU_HIDDEN CUresult vcu_ctx_pop(uintptr_t *ctx);
VCU_HIDDEN CUresult vcu_mem_get_address_range(CUdeviceptr *base, size_t *size, CUdeviceptr p);
VCU_HIDDEN CUresult vcu_mem_retain_allocation_handle(CUmemGenericAllocationHandle *h, CUdeviceptr p);
VCU_HIDDEN CUresult vcu_mem_get_allocation_properties(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h);
VCU_HIDDEN CUresult vcu_mem_get_granularity(size_t *gran, int device_ordinal);
VCU_HIDDEN CUresult vcu_mem_export_fd(int *fd, CUmemGenericAllocationHandle h);
VCU_HIDDEN CUresult vcu_mem_import_fd(CUmemGenericAllocationHandle *h, int fd);
VCU_HIDDEN CUresult vcu_mem_address_reserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr hint);
VCU_HIDDEN CUresult vcu_mem_address_free(CUdeviceptr p, size_t size);
VCU_HIDDEN CUresult vcu_mem_map(CUdeviceptr p, size_t size, CUmemGenericAllocationHandle h);
VCU_HIDDEN CUresult vcu_mem_unmap(CUdeviceptr p, size_t size);
VCU_HIDDEN CUresult vcu_mem_set_access_rw(CUdeviceptr p, size_t size, const int *ordinals, size_t count);
VCU_HIDDEN CUresult vcu_mem_release(CUmemGenericAllocationHandle h);
/* The pool's (cuda/pool.go): a device allocation of size bytes that allows
 * POSIX-fd export; the device's memory; waiting for the current context. */
VCU_HIDDEN CUresult vcu_mem_create_exportable(CUmemGenericAllocationHandle *h, size_t size, int device_ordinal);
VCU_HIDDEN CUresult vcu_device_total_mem(size_t *bytes, CUdevice dev);
VCU_HIDDEN CUresult vcu_ctx_synchronize(void);

#endif
