/*
 * no_pidfd_getfd: run a command under a seccomp filter that refuses the
 * pidfd_getfd system call with EPERM, the way the default seccomp profile
 * of a container without CAP_SYS_PTRACE does. Every other call is allowed.
 * The filter is inherited by every process the command starts (spawned
 * children, forkserver), and cannot be removed by them.
 *
 *   sh tests/gpu/no_pidfd_getfd.sh python3 tests/gpu/test_torch.py
 *
 * (the script builds build/tests/no_pidfd_getfd from this file first).
 *
 * x86-64 only (pidfd_getfd is system call 438 there); on another
 * architecture it refuses to run rather than filter nothing.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#ifndef __x86_64__
#error "no_pidfd_getfd filters the x86-64 system call number of pidfd_getfd"
#endif

#define NR_PIDFD_GETFD 438 /* x86-64 */

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s COMMAND [ARG...]\n"
                    "runs COMMAND with pidfd_getfd refused (EPERM)\n", argv[0]);
    return 2;
  }
  struct sock_filter filter[] = {
      /* Calls made through another ABI (i386's int 0x80) have other
       * numbers; they pass untouched: the tests run x86-64 code. */
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NR_PIDFD_GETFD, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {
      .len = (unsigned short)(sizeof filter / sizeof filter[0]),
      .filter = filter,
  };
  /* Without CAP_SYS_ADMIN a filter needs no_new_privs (it also keeps a
   * setuid program from running with the filter it did not expect). */
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
    fprintf(stderr, "no_pidfd_getfd: prctl(PR_SET_NO_NEW_PRIVS): %s\n", strerror(errno));
    return 1;
  }
  if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
    fprintf(stderr, "no_pidfd_getfd: prctl(PR_SET_SECCOMP): %s\n", strerror(errno));
    return 1;
  }
  execvp(argv[1], argv + 1);
  fprintf(stderr, "no_pidfd_getfd: cannot run %s: %s\n", argv[1], strerror(errno));
  return 127;
}
