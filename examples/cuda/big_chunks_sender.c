/* big_chunks_sender: allocates a model's weights in a vmmipc pool of 1 GiB
 * chunks and shares one 256 MiB buffer of them, a sub-range of a chunk,
 * with one receiver, which maps that one chunk and reads the buffer at its
 * offset.
 *
 *   big_chunks_sender | big_chunks_receiver   (examples/cuda/run.sh builds and runs it)
 *
 * GPU 0 of this process; byte i of the shared buffer is i % 251. The sender
 * prints one line, "<ticket hex> <offset> <size>", on stdout (messages on
 * stderr) and stays until the receiver has every chunk, or a minute. */
#include "cuda_check.h"

/* readme-snippet: cuda-big-chunks */
#include <stdint.h>
#include <stdio.h>
#include <cuda.h>
#include <vmmipc.h>

/* From examples/common.h: status_ok says on stderr which call failed and
 * why (vmmipc_strerror, vmmipc_last_error) unless rc is VMMIPC_OK;
 * print_ticket prints a ticket as 512 hex digits. */
int status_ok(int rc, const char *call);
void print_ticket(const vmmipc_ticket *ticket);

/* share_sub_range registers the chunk(s) under [dptr, dptr + size) of pool
 * memory for one receiver, prints the ticket with the buffer's offset in
 * them and its size, and waits until the receiver has pulled every chunk. */
int share_sub_range(uint64_t dptr, uint64_t size) {
  vmmipc_cuda_range_info range; /* the chunks under the buffer: one here */
  int rc = vmmipc_cuda_query_range(dptr, size, &range);
  vmmipc_options opts;
  vmmipc_options_init(&opts, sizeof opts);
  opts.uses = 1;
  vmmipc_ticket ticket;
  if (rc == VMMIPC_OK) rc = vmmipc_register_cuda(range.base, range.size, &opts, &ticket);
  if (rc != VMMIPC_OK) {
    fprintf(stderr, "sharing [%#llx, +%llu): %s: %s\n", (unsigned long long)dptr,
            (unsigned long long)size, vmmipc_strerror(rc), vmmipc_last_error());
    return 1;
  }
  print_ticket(&ticket);
  printf(" %llu %llu\n", (unsigned long long)(dptr - range.base), (unsigned long long)size);
  fflush(stdout);
  /* The server lives in this process: stay until the receiver has it all. */
  return status_ok(vmmipc_wait(&ticket, 60000), "vmmipc_wait") ? 0 : 1;
}

int fill_pattern(CUdeviceptr dptr, size_t size); /* cuda_check.h: byte i = i % 251 */

/* weights allocates a few tensors' worth in a pool of 1 GiB chunks (0: the
 * default chunk size) and shares the second. */
int weights(void) {
  vmmipc_pool *pool;
  if (!status_ok(vmmipc_pool_create(0, 0, 0, &pool), "vmmipc_pool_create")) return 1;
  uint64_t embed = 0, layer = 0;
  uint64_t size = 256u << 20;
  int rc = vmmipc_pool_alloc(pool, 64u << 20, &embed); /* side by side in the first chunk */
  if (rc == VMMIPC_OK) rc = vmmipc_pool_alloc(pool, size, &layer);
  int status = 1;
  if (status_ok(rc, "vmmipc_pool_alloc") && fill_pattern(layer, size) == 0)
    status = share_sub_range(layer, size);
  /* Registered chunks stay alive for the receiver: the pool may free now. */
  if (layer) vmmipc_pool_free(pool, layer);
  if (embed) vmmipc_pool_free(pool, embed);
  vmmipc_pool_destroy(pool);
  return status;
}
/* end readme-snippet */

#include "../common.h"

int main(void) {
  CUdevice dev;
  CUcontext ctx;
  if (retain_primary(0, &dev, &ctx) != 0) return 1;
  int status = 1;
  if (cuda_ok(cuCtxSetCurrent(ctx), "cuCtxSetCurrent")) status = weights();
  cuDevicePrimaryCtxRelease(dev);
  if (status == 0) fprintf(stderr, "big_chunks_sender: the receiver has the buffer\n");
  return status;
}
