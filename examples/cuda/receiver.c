/* cuda_receiver: imports the GPU buffer of cuda_sender's ticket onto the
 * exporter's GPU, one descriptor at a time, and checks every byte (byte i
 * is i % 251) by copying it back.
 *
 *   cuda_sender | cuda_receiver        (or: cuda_receiver TICKET_HEX)
 *
 * Exit status 0 when every byte is right. */
#include <stdlib.h>

#include "cuda_check.h"

/* readme-snippet: cuda-receiver */
#include <stdint.h>
#include <stdio.h>
#include <cuda.h>
#include <vmmipc.h>

/* From examples/common.h: status_ok says on stderr which call failed and
 * why (vmmipc_strerror, vmmipc_last_error) unless rc is VMMIPC_OK. */
int status_ok(int rc, const char *call);

/* Defined below: copies [addr, addr + size) back through GPU `device`,
 * counts the bytes that are not what the sender wrote, and prints that. */
int check_on_gpu(CUdeviceptr addr, uint64_t size, int device);

/* receive maps the buffer named by the ticket onto the exporter's GPU
 * (found by UUID, whatever CUDA_VISIBLE_DEVICES says), checks it, and
 * unmaps it. */
int receive(const vmmipc_ticket *ticket) {
  vmmipc_mapping m;
  int rc = vmmipc_import_stream(ticket, VMMIPC_DEVICE_SAME, NULL, &m);
  if (!status_ok(rc, "vmmipc_import_stream")) return 1;
  /* m.addr is a CUdeviceptr, read-write for GPU m.device. */
  int status = check_on_gpu((CUdeviceptr)m.addr, m.size, m.device);
  if (!status_ok(vmmipc_unmap(&m), "vmmipc_unmap")) return 1;
  return status;
}
/* end readme-snippet */

#include "../common.h"

int check_on_gpu(CUdeviceptr addr, uint64_t size, int device) {
  CUdevice dev;
  CUcontext ctx;
  if (retain_primary(device, &dev, &ctx) != 0) return 1;
  int status = 1;
  unsigned char *bytes = malloc(size);
  if (bytes == NULL) {
    fprintf(stderr, "cuda_receiver: out of host memory for %llu bytes\n", (unsigned long long)size);
  } else if (cuda_ok(cuCtxPushCurrent(ctx), "cuCtxPushCurrent")) {
    if (cuda_ok(cuMemcpyDtoH(bytes, addr, size), "cuMemcpyDtoH")) {
      uint64_t wrong = 0;
      for (uint64_t i = 0; i < size; i++) wrong += bytes[i] != (unsigned char)(i % 251);
      printf("cuda_receiver: %llu bytes imported on GPU %d, %llu wrong\n", (unsigned long long)size,
             device, (unsigned long long)wrong);
      status = wrong != 0;
    }
    cuCtxPopCurrent(NULL);
  }
  free(bytes);
  cuDevicePrimaryCtxRelease(dev);
  return status;
}

int main(int argc, char **argv) {
  vmmipc_ticket ticket;
  if (read_ticket(argc, argv, &ticket) != 0) return 2;
  return receive(&ticket);
}
