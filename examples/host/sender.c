/* host_sender: shares 64 MiB of host memory, in 1024 chunks of 64 KiB, with
 * one receiver, which imports it one descriptor at a time.
 *
 *   host_sender | host_receiver
 *
 * Byte i of the buffer is i % 251 (a prime, so no two chunks look alike);
 * the receiver checks every byte. The ticket goes to stdout as one line of
 * hex, messages to stderr. The memory is served from this process, so the
 * sender stays until the receiver has pulled every chunk, or gives up after
 * a minute. Exit status 0 once the receiver has it all. */

/* readme-snippet: host-sender */
#define _GNU_SOURCE /* memfd_create */
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>
#include <vmmipc.h>

/* From examples/common.h: status_ok says on stderr which call failed and
 * why (vmmipc_strerror, vmmipc_last_error) unless rc is VMMIPC_OK;
 * print_ticket prints a ticket as 512 hex digits. */
int status_ok(int rc, const char *call);
void print_ticket(const vmmipc_ticket *ticket);

/* make_memfd creates `size` bytes of shared memory that receivers accept: a
 * memfd sealed against shrinking (a file that could shrink under a
 * receiver's mapping could kill it with SIGBUS). Returns the fd, or -1. */
int make_memfd(uint64_t size) {
  int fd = memfd_create("vmmipc-example", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    perror("memfd_create");
    return -1;
  }
  if (ftruncate(fd, (off_t)size) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    perror("sizing and sealing the memfd");
    close(fd);
    return -1;
  }
  return fd;
}

/* serve registers bytes [0, size) of the memfd in chunks of chunk_size bytes
 * (a multiple of the page size) for one receiver, prints the ticket, and
 * waits until the receiver has pulled every chunk. */
int serve(int fd, uint64_t size, uint64_t chunk_size) {
  vmmipc_options opts;
  vmmipc_options_init(&opts, sizeof opts);
  opts.uses = 1; /* one receiver may import it (0 = until unregistered) */
  vmmipc_ticket ticket;
  int rc = vmmipc_register_host_file(fd, size, chunk_size, NULL, NULL, &opts, &ticket);
  if (!status_ok(rc, "vmmipc_register_host_file")) return 1;
  /* The library keeps its own duplicate of fd: yours stays yours. Hand the
   * ticket to the receiver any way you like; here, one line of hex. */
  print_ticket(&ticket);
  printf("\n");
  fflush(stdout);
  /* The server lives in this process: stay until the receiver has it all. */
  return status_ok(vmmipc_wait(&ticket, 60000), "vmmipc_wait") ? 0 : 1;
}
/* end readme-snippet */

#include "../common.h" /* after the excerpt: _GNU_SOURCE comes first */

enum { CHUNK_SIZE = 64 << 10, CHUNKS = 1024 };

int main(void) {
  const uint64_t size = (uint64_t)CHUNKS * CHUNK_SIZE;
  int fd = make_memfd(size);
  if (fd < 0) return 1;
  unsigned char *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mem == MAP_FAILED) {
    perror("mmap of the memfd");
    close(fd);
    return 1;
  }
  for (uint64_t i = 0; i < size; i++) mem[i] = (unsigned char)(i % 251);
  munmap(mem, size);

  int status = serve(fd, size, CHUNK_SIZE);
  close(fd);
  if (status == 0) fprintf(stderr, "host_sender: the receiver pulled all %d chunks\n", CHUNKS);
  return status;
}
