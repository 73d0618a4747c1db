/* host_receiver: imports the host buffer of host_sender's ticket, one
 * descriptor at a time, and checks every byte (byte i is i % 251).
 *
 *   host_sender | host_receiver        (or: host_receiver TICKET_HEX)
 *
 * Exit status 0 when every byte is right. */
/* readme-snippet: host-receiver */
#include <stdint.h>
#include <stdio.h>
#include <vmmipc.h>

/* From examples/common.h: status_ok says on stderr which call failed and
 * why (vmmipc_strerror, vmmipc_last_error) unless rc is VMMIPC_OK. */
int status_ok(int rc, const char *call);

/* receive maps the host buffer named by the ticket into this process (a
 * MAP_SHARED mapping of the sender's very pages), checks it, and unmaps it. */
int receive(const vmmipc_ticket *ticket) {
  vmmipc_mapping m;
  int rc = vmmipc_import_stream(ticket, VMMIPC_DEVICE_HOST, NULL, &m);
  if (!status_ok(rc, "vmmipc_import_stream")) return 1;
  const unsigned char *bytes = (const unsigned char *)(uintptr_t)m.addr;
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < m.size; i++) wrong += bytes[i] != (unsigned char)(i % 251);
  printf("host_receiver: %llu bytes imported, %llu wrong\n", (unsigned long long)m.size,
         (unsigned long long)wrong);
  if (!status_ok(vmmipc_unmap(&m), "vmmipc_unmap")) return 1;
  return wrong != 0;
}
/* end readme-snippet */

#include "../common.h"

int main(int argc, char **argv) {
  vmmipc_ticket ticket;
  if (read_ticket(argc, argv, &ticket) != 0) return 2;
  return receive(&ticket);
}
