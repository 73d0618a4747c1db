/* The CUDA driver entry points the demo (tests/c/demo.c) and the benchmark
 * (bench/vmmipc_bench.c) call, loaded with dlopen so that they build without
 * the CUDA toolkit and fall back to host memory on machines without a GPU.
 * Layouts follow cuda.h (CUDA 12 and 13). */
#ifndef VMMIPC_BENCH_CUDA_H
#define VMMIPC_BENCH_CUDA_H
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
  int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1 */
  CUmemLocation location;   /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType, gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

#define BCU_POSIX_FD 1
#define BCU_PROT_READWRITE 3

static struct {
  CUresult (*Init)(unsigned);
  CUresult (*DeviceGetCount)(int *);
  CUresult (*DeviceGet)(CUdevice *, int);
  CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*CtxSynchronize)(void);
  CUresult (*Granularity)(size_t *, const CUmemAllocationProp *, int);
  CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
  CUresult (*AddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*AddressFree)(CUdeviceptr, size_t);
  CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*MemUnmap)(CUdeviceptr, size_t);
  CUresult (*MemRelease)(CUmemGenericAllocationHandle);
  CUresult (*SetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*Export)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
  CUresult (*Import)(CUmemGenericAllocationHandle *, void *, int);
  CUresult (*MemsetD8)(CUdeviceptr, unsigned char, size_t);
  CUresult (*DtoH)(void *, CUdeviceptr, size_t);
  CUresult (*HtoD)(CUdeviceptr, const void *, size_t);
  CUresult (*GetErrorName)(CUresult, const char **);
} cu;

/* cuda_load loads the driver and reports whether a GPU can be used. */
static int cuda_load(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return 0;
#define SYM(field, name) if (!(*(void **)&cu.field = dlsym(h, name))) return 0
  SYM(Init, "cuInit");
  SYM(DeviceGetCount, "cuDeviceGetCount");
  SYM(DeviceGet, "cuDeviceGet");
  SYM(PrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  SYM(CtxSetCurrent, "cuCtxSetCurrent");
  SYM(CtxSynchronize, "cuCtxSynchronize");
  SYM(Granularity, "cuMemGetAllocationGranularity");
  SYM(MemCreate, "cuMemCreate");
  SYM(AddressReserve, "cuMemAddressReserve");
  SYM(AddressFree, "cuMemAddressFree");
  SYM(MemMap, "cuMemMap");
  SYM(MemUnmap, "cuMemUnmap");
  SYM(MemRelease, "cuMemRelease");
  SYM(SetAccess, "cuMemSetAccess");
  SYM(Export, "cuMemExportToShareableHandle");
  SYM(Import, "cuMemImportFromShareableHandle");
  SYM(MemsetD8, "cuMemsetD8_v2");
  SYM(DtoH, "cuMemcpyDtoH_v2");
  SYM(HtoD, "cuMemcpyHtoD_v2");
  SYM(GetErrorName, "cuGetErrorName");
#undef SYM
  int n = 0;
  return cu.Init(0) == 0 && cu.DeviceGetCount(&n) == 0 && n > 0;
}

static const char *cu_err(CUresult r) {
  const char *s = "CUDA_ERROR_UNKNOWN";
  if (cu.GetErrorName) cu.GetErrorName(r, &s);
  return s;
}

/* cuda_use_device makes the device's primary context current. */
static int cuda_use_device(int ordinal) {
  CUdevice d;
  CUcontext c;
  return cu.DeviceGet(&d, ordinal) || cu.PrimaryCtxRetain(&c, d) || cu.CtxSetCurrent(c);
}
#endif
