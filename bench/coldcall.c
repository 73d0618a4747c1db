/* coldcall: what one call into the library costs a C thread, back to back
 * and after the thread was away for a while, against a plain system call.
 *
 *   make test-c        # or any build of the C tests; then
 *   build/cmake/vmmipc_coldcall [--gap-us G] [--calls N]
 *
 * The call is vmmipc_live_registrations, which does almost nothing in Go:
 * what it costs is the crossing. Each row is the median and the 90th
 * percentile of N calls, microseconds, on CLOCK_MONOTONIC:
 *
 *   back-to-back     calls in a tight loop;
 *   after sleep      each call after nanosleep(G us) (default 250: about
 *                    the time between a re-send loop's calls);
 *   after spin       each after G us of spinning (the thread never slept);
 *   getpid sleep     getpid() after nanosleep(G us), for the floor.
 *
 * Why the call after a pause costs more (bench/results/
 * 2026-12-06-coldcalls-cpu.md): a call from a C thread runs on a P (the Go
 * runtime's processor) that the thread keeps when it returns to C, but the
 * call never goes through the scheduler, so that P looks to the runtime's
 * monitor (sysmon) like one running the same goroutine for over 10 ms, and
 * it takes the P back at its next look; the next call then takes an idle P
 * and wakes the monitor.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "vmmipc.h"

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

enum pause { NONE, SLEEP, SPIN };

static void pause_for(enum pause how, uint64_t gap_ns) {
  if (how == SLEEP) {
    struct timespec t = {(time_t)(gap_ns / 1000000000u), (long)(gap_ns % 1000000000u)};
    nanosleep(&t, NULL);
  } else if (how == SPIN) {
    uint64_t end = now_ns() + gap_ns;
    while (now_ns() < end) {
    }
  }
}

static int row(const char *name, enum pause how, int library, uint64_t gap_ns, uint64_t *t, int n) {
  uint64_t live;
  for (int i = 0; i < n; i++) {
    pause_for(how, gap_ns);
    uint64_t t0 = now_ns();
    if (library) {
      if (vmmipc_live_registrations(&live) != VMMIPC_OK) {
        fprintf(stderr, "coldcall: vmmipc_live_registrations: %s\n", vmmipc_last_error());
        return 1;
      }
    } else {
      (void)getpid();
    }
    t[i] = now_ns() - t0;
  }
  qsort(t, (size_t)n, sizeof t[0], by_value);
  printf("%-14s median %6.2f us  p90 %6.2f us\n", name, t[n / 2] / 1e3, t[n * 9 / 10] / 1e3);
  return 0;
}

int main(int argc, char **argv) {
  long gap_us = 250, n = 2000;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--gap-us") == 0) {
      gap_us = atol(argv[i + 1]);
    } else if (strcmp(argv[i], "--calls") == 0) {
      n = atol(argv[i + 1]);
    } else {
      fprintf(stderr, "usage: coldcall [--gap-us G] [--calls N]\n");
      return 2;
    }
  }
  if (argc % 2 == 0 || gap_us < 0 || n < 10 || n > 1000000) {
    fprintf(stderr, "usage: coldcall [--gap-us G >= 0] [--calls N, 10..1000000]\n");
    return 2;
  }
  uint64_t *t = malloc((size_t)n * sizeof *t);
  if (t == NULL) {
    perror("coldcall: malloc");
    return 1;
  }
  uint64_t gap = (uint64_t)gap_us * 1000u;
  printf("coldcall: %ld calls, gap %ld us\n", n, gap_us);
  int rc = row("back-to-back", NONE, 1, 0, t, (int)n) || row("after sleep", SLEEP, 1, gap, t, (int)n) ||
           row("after spin", SPIN, 1, gap, t, (int)n) || row("getpid sleep", SLEEP, 0, gap, t, (int)n);
  free(t);
  return rc;
}
