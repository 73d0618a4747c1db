/* common.h: the plumbing every example program shares, so that each shows
 * only what it does with vmmipc: saying why a call failed, and handing the
 * ticket over. The senders print it as one line of 512 hex digits on
 * stdout and the receivers read it from stdin, so one command runs an
 * example end to end:
 *
 *   host_sender | host_receiver
 *
 * or, from two terminals, `host_receiver <hex>`. A ticket is 256 bytes of
 * plain data: any channel works (a socket, a file, a pickle).
 *
 * Each example includes this after its README excerpt, which declares the
 * functions it calls: so they are defined here plainly, not static (each
 * example is one file). */
#ifndef VMMIPC_EXAMPLE_COMMON_H
#define VMMIPC_EXAMPLE_COMMON_H

#include <stdio.h>
#include <string.h>
#include <vmmipc.h>

/* status_ok returns 1 if rc is VMMIPC_OK; otherwise it says on stderr which
 * call failed and why (vmmipc_strerror: the status; vmmipc_last_error: what
 * failed and what to do) and returns 0. */
int status_ok(int rc, const char *call) {
  if (rc == VMMIPC_OK) return 1;
  fprintf(stderr, "%s: %s: %s\n", call, vmmipc_strerror(rc), vmmipc_last_error());
  return 0;
}

/* print_ticket prints the ticket as 512 hex digits on stdout (no newline:
 * the caller ends the line). */
void print_ticket(const vmmipc_ticket *ticket) {
  for (size_t i = 0; i < sizeof ticket->bytes; i++) printf("%02x", ticket->bytes[i]);
}

static int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* read_ticket decodes the ticket given as argv[1] or, without an argument,
 * as one line of stdin. Returns 0, or -1 after saying what is wrong. */
int read_ticket(int argc, char **argv, vmmipc_ticket *ticket) {
  char line[2 * VMMIPC_TICKET_SIZE + 2]; /* the digits, '\n', '\0' */
  const char *hex = argc > 1 ? argv[1] : fgets(line, sizeof line, stdin);
  if (hex == NULL) {
    fprintf(stderr, "%s: no ticket on stdin (did the sender fail?); usage: sender | %s, or %s TICKET_HEX\n",
            argv[0], argv[0], argv[0]);
    return -1;
  }
  size_t digits = strcspn(hex, "\r\n");
  if (digits != 2 * VMMIPC_TICKET_SIZE) {
    fprintf(stderr, "%s: a ticket is %d hex digits, got %zu\n", argv[0], 2 * VMMIPC_TICKET_SIZE, digits);
    return -1;
  }
  for (size_t i = 0; i < VMMIPC_TICKET_SIZE; i++) {
    int high = hex_value(hex[2 * i]), low = hex_value(hex[2 * i + 1]);
    if (high < 0 || low < 0) {
      fprintf(stderr, "%s: the ticket has a non-hex character at position %zu\n", argv[0],
              2 * i + (high < 0 ? 0 : 1));
      return -1;
    }
    ticket->bytes[i] = (unsigned char)(high << 4 | low);
  }
  return 0;
}

#endif
