/* big_chunks_receiver: imports what big_chunks_sender shares (the 1 GiB
 * chunk under its buffer) onto the exporter's GPU and checks every byte of
 * the buffer at its offset (byte i is i % 251).
 *
 *   big_chunks_sender | big_chunks_receiver    (or: big_chunks_receiver "TICKET_HEX OFFSET SIZE")
 *
 * Exit status 0 when every byte is right and the ticket named one chunk. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "cuda_check.h"

int main(int argc, char **argv) {
  char line[2 * VMMIPC_TICKET_SIZE + 64];
  const char *text = argc > 1 ? argv[1] : fgets(line, sizeof line, stdin);
  unsigned long long offset = 0, size = 0;
  char *hex_end = text ? strchr(text, ' ') : NULL;
  if (hex_end == NULL || sscanf(hex_end, "%llu %llu", &offset, &size) != 2) {
    fprintf(stderr, "%s: want one line \"<ticket hex> <offset> <size>\" (did the sender fail?)\n", argv[0]);
    return 2;
  }
  char hex[2 * VMMIPC_TICKET_SIZE + 1];
  size_t digits = (size_t)(hex_end - text) < sizeof hex - 1 ? (size_t)(hex_end - text) : sizeof hex - 1;
  memcpy(hex, text, digits);
  hex[digits] = '\0';
  char *args[] = {argv[0], hex};
  vmmipc_ticket ticket;
  if (read_ticket(2, args, &ticket) != 0) return 2;
  vmmipc_ticket_info info;
  int rc = vmmipc_ticket_decode(&ticket, &info);
  vmmipc_mapping m;
  if (rc == VMMIPC_OK) rc = vmmipc_import_stream(&ticket, VMMIPC_DEVICE_SAME, NULL, &m);
  if (!status_ok(rc, "import")) return 1;
  int status = 1;
  CUdevice dev;
  CUcontext ctx;
  unsigned char *bytes = malloc(size);
  if (offset + size > m.size || bytes == NULL) {
    fprintf(stderr, "big_chunks_receiver: [%llu, +%llu) does not fit the %llu bytes mapped\n", offset, size,
            (unsigned long long)m.size);
  } else if (retain_primary(m.device, &dev, &ctx) == 0) {
    if (cuda_ok(cuCtxPushCurrent(ctx), "cuCtxPushCurrent")) {
      if (cuda_ok(cuMemcpyDtoH(bytes, (CUdeviceptr)(m.addr + offset), size), "cuMemcpyDtoH")) {
        uint64_t wrong = 0;
        for (uint64_t i = 0; i < size; i++) wrong += bytes[i] != (unsigned char)(i % 251);
        printf("big_chunks_receiver: %llu bytes at offset %llu of %llu chunk(s), %llu MiB mapped, %llu wrong\n",
               size, offset, (unsigned long long)info.chunk_count, (unsigned long long)(m.size >> 20),
               (unsigned long long)wrong);
        status = wrong != 0 || info.chunk_count != 1;
      }
      cuCtxPopCurrent(NULL);
    }
    cuDevicePrimaryCtxRelease(dev);
  }
  free(bytes);
  if (vmmipc_unmap(&m) != VMMIPC_OK) status = 1;
  return status;
}
