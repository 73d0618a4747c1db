/* The public vmmipc_* symbols. Each one refuses to run in a child after
 * fork() (the Go runtime does not survive fork) before entering Go, then
 * calls the hidden Go export vmmipcgo_*. Including vmmipc.h here makes the
 * compiler check every definition against the contract. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "abi.h"
#include "_cgo_export.h"

/* ---- host state: saved before the Go runtime starts, restored after ---- */

#define VMMIPC_NSIG 65
static struct sigaction saved_actions[VMMIPC_NSIG];
static int saved_action_ok[VMMIPC_NSIG];
static struct rlimit saved_nofile;
static int saved_nofile_ok;
static pid_t load_pid;

/* Runs before the Go runtime's own constructor (prioritized .init_array
 * entries run before plain ones), so it sees the host as it was. */
__attribute__((constructor(101))) static void vmmipc_abi_save_host(void) {
  load_pid = getpid();
  saved_nofile_ok = getrlimit(RLIMIT_NOFILE, &saved_nofile) == 0;
  for (int sig = 1; sig < VMMIPC_NSIG; sig++)
    saved_action_ok[sig] = sigaction(sig, NULL, &saved_actions[sig]) == 0;
}

static void restore_signals(void) {
  for (int sig = 1; sig < VMMIPC_NSIG; sig++) {
    if (!saved_action_ok[sig] || sig == SIGKILL || sig == SIGSTOP) continue;
    struct sigaction now;
    if (sigaction(sig, NULL, &now) != 0) continue;
    if (now.sa_handler != saved_actions[sig].sa_handler ||
        now.sa_flags != saved_actions[sig].sa_flags)
      sigaction(sig, &saved_actions[sig], NULL);
  }
}

void vmmipc_abi_restore_host(void) {
  if (saved_nofile_ok) setrlimit(RLIMIT_NOFILE, &saved_nofile);
  restore_signals();
}

/* Runs after the Go runtime's constructor, which installed its signal
 * handlers synchronously. */
__attribute__((constructor)) static void vmmipc_abi_after_go(void) {
  restore_signals();
}

/* ---- errors ---- */

static __thread char last_error[2048];

void vmmipc_abi_set_error(const char *msg, size_t len) {
  if (len >= sizeof last_error) len = sizeof last_error - 1;
  memcpy(last_error, msg, len);
  last_error[len] = '\0';
}

static int set_error_str(int status, const char *msg) {
  vmmipc_abi_set_error(msg, strlen(msg));
  return status;
}

#define FORK_GUARD(name)                                                      \
  do {                                                                        \
    if (getpid() != load_pid)                                                 \
      return set_error_str(VMMIPC_EFORK,                                      \
                           name ": called in a child after fork(); libvmmipc " \
                                "cannot run there: exec a new program, or "    \
                                "use the spawn/forkserver start methods");    \
  } while (0)

/* ---- trampolines ---- */

int vmmipc_abi_call_export(vmmipc_export_fn fn, void *user, uint64_t index, int *fd_out) {
  return fn(user, index, fd_out);
}

void vmmipc_abi_call_release(vmmipc_release_fn fn, void *user) { fn(user); }

/* ---- public API ---- */

int vmmipc_options_init(vmmipc_options *opts) {
  FORK_GUARD("vmmipc_options_init");
  return vmmipcgo_options_init(opts);
}

int vmmipc_register(const uint64_t *sizes, uint64_t count, vmmipc_export_fn export_fn,
                    vmmipc_release_fn release_fn, void *user, const vmmipc_options *opts,
                    vmmipc_ticket *ticket_out) {
  FORK_GUARD("vmmipc_register");
  return vmmipcgo_register((uint64_t *)sizes, count, export_fn, release_fn, user,
                           (vmmipc_options *)opts, ticket_out);
}

int vmmipc_register_host_file(int fd, uint64_t size, uint64_t chunk_size,
                              vmmipc_release_fn release_fn, void *user,
                              const vmmipc_options *opts, vmmipc_ticket *ticket_out) {
  FORK_GUARD("vmmipc_register_host_file");
  return vmmipcgo_register_host_file(fd, size, chunk_size, release_fn, user,
                                     (vmmipc_options *)opts, ticket_out);
}

int vmmipc_register_cuda(uint64_t dptr, uint64_t size, const vmmipc_options *opts,
                         vmmipc_ticket *ticket_out) {
  FORK_GUARD("vmmipc_register_cuda");
  return vmmipcgo_register_cuda(dptr, size, (vmmipc_options *)opts, ticket_out);
}

int vmmipc_register_cuda_handles(const uint64_t *handles, const uint64_t *sizes,
                                 uint64_t count, vmmipc_release_fn release_fn, void *user,
                                 const vmmipc_options *opts, vmmipc_ticket *ticket_out) {
  FORK_GUARD("vmmipc_register_cuda_handles");
  return vmmipcgo_register_cuda_handles((uint64_t *)handles, (uint64_t *)sizes, count,
                                        release_fn, user, (vmmipc_options *)opts,
                                        ticket_out);
}

int vmmipc_unregister(const vmmipc_ticket *ticket) {
  FORK_GUARD("vmmipc_unregister");
  return vmmipcgo_unregister((vmmipc_ticket *)ticket);
}

int vmmipc_live_registrations(uint64_t *count_out) {
  FORK_GUARD("vmmipc_live_registrations");
  return vmmipcgo_live_registrations(count_out);
}

int vmmipc_ticket_decode(const vmmipc_ticket *ticket, vmmipc_ticket_info *info_out) {
  FORK_GUARD("vmmipc_ticket_decode");
  return vmmipcgo_ticket_decode((vmmipc_ticket *)ticket, info_out);
}

int vmmipc_open(const vmmipc_ticket *ticket, const vmmipc_options *opts,
                vmmipc_stream **stream_out) {
  FORK_GUARD("vmmipc_open");
  return vmmipcgo_open((vmmipc_ticket *)ticket, (vmmipc_options *)opts, stream_out);
}

int vmmipc_stream_info(const vmmipc_stream *stream, uint64_t *count_out,
                       uint64_t *total_size_out) {
  FORK_GUARD("vmmipc_stream_info");
  return vmmipcgo_stream_info((vmmipc_stream *)stream, count_out, total_size_out);
}

int vmmipc_pull_next(vmmipc_stream *stream, vmmipc_chunk *chunk_out) {
  FORK_GUARD("vmmipc_pull_next");
  return vmmipcgo_pull_next(stream, chunk_out);
}

int vmmipc_close(vmmipc_stream *stream) {
  FORK_GUARD("vmmipc_close");
  return vmmipcgo_close(stream);
}

int vmmipc_import_stream(const vmmipc_ticket *ticket, int device, const vmmipc_options *opts,
                         vmmipc_mapping *mapping_out) {
  FORK_GUARD("vmmipc_import_stream");
  return vmmipcgo_import_stream((vmmipc_ticket *)ticket, device, (vmmipc_options *)opts,
                                mapping_out);
}

int vmmipc_unmap(vmmipc_mapping *mapping) {
  FORK_GUARD("vmmipc_unmap");
  return vmmipcgo_unmap(mapping);
}

const char *vmmipc_strerror(int status) {
  /* Also after fork: it touches no runtime state beyond a read. */
  if (getpid() == load_pid) {
    const char *s = vmmipcgo_strerror(status);
    if (s) return s;
  }
  switch (status) {
  case VMMIPC_EFORK: return "VMMIPC_EFORK: called in a child after fork()";
  default: return "VMMIPC_UNKNOWN: unknown status";
  }
}

const char *vmmipc_last_error(void) { return last_error; }

#define STR_(x) #x
#define STR(x) STR_(x)
const char *vmmipc_version(void) {
  return STR(VMMIPC_VERSION_MAJOR) "." STR(VMMIPC_VERSION_MINOR) "." STR(VMMIPC_VERSION_PATCH);
}
