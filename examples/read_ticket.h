/* read_ticket.h: how the example receivers get their ticket. The senders
 * print it as one line of 512 hex digits on stdout, so one command runs an
 * example end to end:
 *
 *   host_sender | host_receiver
 *
 * or, from two terminals, `host_receiver <hex>`. A ticket is 256 bytes of
 * plain data: any channel works (a socket, a file, a pickle). */
#ifndef VMMIPC_EXAMPLE_READ_TICKET_H
#define VMMIPC_EXAMPLE_READ_TICKET_H

#include <stdio.h>
#include <string.h>
#include <vmmipc.h>

static int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* read_ticket decodes the ticket given as argv[1] or, without an argument,
 * as one line of stdin. Returns 0, or -1 after saying what is wrong. */
static int read_ticket(int argc, char **argv, vmmipc_ticket *ticket) {
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
