/* cuda_sender: shares 64 MiB of GPU memory, made of cuMemCreate allocations
 * of the device's allocation granularity (2 MiB on most GPUs) mapped side by
 * side, with one receiver, which imports it one descriptor at a time.
 *
 *   cuda_sender | cuda_receiver        (examples/cuda/run.sh builds and runs it)
 *
 * GPU 0 of this process; byte i of the buffer is i % 251; the receiver
 * checks every byte. The ticket goes to stdout as one line of hex, messages
 * to stderr. The sender stays until the receiver has pulled every chunk, or
 * gives up after a minute. Exit status 0 once the receiver has it all. */
#include "cuda_check.h"

/* readme-snippet: cuda-sender */
#include <stdio.h>
#include <cuda.h>
#include <vmmipc.h>

/* From examples/common.h: status_ok says on stderr which call failed and
 * why (vmmipc_strerror, vmmipc_last_error) unless rc is VMMIPC_OK;
 * print_ticket prints a ticket as 512 hex digits. */
int status_ok(int rc, const char *call);
void print_ticket(const vmmipc_ticket *ticket);

/* serve registers the CUDA VMM range [dptr, dptr + size) for one receiver,
 * prints the ticket, and waits until the receiver has pulled every chunk.
 * The range must be mapped from cuMemCreate allocations that allow
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, and start and end on allocation
 * boundaries. */
int serve(CUdeviceptr dptr, size_t size) {
  vmmipc_options opts;
  vmmipc_options_init(&opts, sizeof opts);
  opts.uses = 1; /* one receiver may import it (0 = until unregistered) */
  vmmipc_ticket ticket;
  int rc = vmmipc_register_cuda(dptr, size, &opts, &ticket);
  if (!status_ok(rc, "vmmipc_register_cuda")) return 1;
  /* The library holds its own reference to every allocation: the caller may
   * unmap and release its buffer now. Hand the ticket to the receiver any
   * way you like; here, one line of hex. */
  print_ticket(&ticket);
  printf("\n");
  fflush(stdout);
  /* The server lives in this process: stay until the receiver has it all. */
  return status_ok(vmmipc_wait(&ticket, 60000), "vmmipc_wait") ? 0 : 1;
}
/* end readme-snippet */

#include "../common.h"

enum { CHUNKS = 32 };

/* A range of CHUNKS allocations, each chunk_size bytes, mapped side by side. */
typedef struct gpu_buffer {
  CUdeviceptr base;
  size_t chunk_size, size;
  CUmemGenericAllocationHandle handles[CHUNKS];
  int mapped; /* handles[0 .. mapped-1] exist and are mapped */
} gpu_buffer;

/* free_buffer unmaps and releases what alloc_buffer made, however far it got. */
static void free_buffer(gpu_buffer *b) {
  for (int i = 0; i < b->mapped; i++) {
    cuMemUnmap(b->base + (CUdeviceptr)i * b->chunk_size, b->chunk_size);
    cuMemRelease(b->handles[i]);
  }
  if (b->base) cuMemAddressFree(b->base, b->size);
  b->mapped = 0;
  b->base = 0;
}

/* alloc_buffer makes CHUNKS exportable allocations on dev, maps them side
 * by side and gives dev read-write access. Returns 0, or -1 after saying
 * what failed (with nothing left allocated). */
static int alloc_buffer(CUdevice dev, gpu_buffer *b) {
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; /* what vmmipc exports */
  *b = (gpu_buffer){0};
  if (!cuda_ok(cuMemGetAllocationGranularity(&b->chunk_size, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
               "cuMemGetAllocationGranularity"))
    return -1;
  b->size = CHUNKS * b->chunk_size;
  if (!cuda_ok(cuMemAddressReserve(&b->base, b->size, 0, 0, 0), "cuMemAddressReserve")) {
    b->base = 0;
    return -1;
  }
  for (int i = 0; i < CHUNKS; i++) {
    CUmemGenericAllocationHandle h;
    if (!cuda_ok(cuMemCreate(&h, b->chunk_size, &prop, 0), "cuMemCreate")) break;
    if (!cuda_ok(cuMemMap(b->base + (CUdeviceptr)i * b->chunk_size, b->chunk_size, 0, h, 0), "cuMemMap")) {
      cuMemRelease(h);
      break;
    }
    b->handles[b->mapped++] = h;
  }
  CUmemAccessDesc access = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  if (b->mapped < CHUNKS || !cuda_ok(cuMemSetAccess(b->base, b->size, &access, 1), "cuMemSetAccess")) {
    free_buffer(b);
    return -1;
  }
  return 0;
}

int main(void) {
  CUdevice dev;
  CUcontext ctx;
  if (retain_primary(0, &dev, &ctx) != 0) return 1;
  int status = 1;
  gpu_buffer b;
  if (cuda_ok(cuCtxSetCurrent(ctx), "cuCtxSetCurrent") && alloc_buffer(dev, &b) == 0) {
    if (fill_pattern(b.base, b.size) == 0) status = serve(b.base, b.size);
    free_buffer(&b);
  }
  cuDevicePrimaryCtxRelease(dev);
  if (status == 0) fprintf(stderr, "cuda_sender: the receiver pulled all %d chunks\n", CHUNKS);
  return status;
}
