/* GPU test of importing onto a device other than the exporter's (issue 7)
 * and of finding the exporter's GPU by UUID. Build and run it with
 * tests/gpu/run_peer.sh after `make lib`.
 *
 * With one GPU it checks what one GPU allows: VMMIPC_DEVICE_SAME in a
 * receiver whose CUDA_VISIBLE_DEVICES names the GPU by UUID, a device
 * ordinal that does not exist, and access-device lists (valid, duplicate,
 * out of range). With two or more GPUs it also maps a 4096-chunk buffer
 * exported from GPU 0 into a receiver on GPU 1 (peer access), checks the
 * data from both sides, and imports with VMMIPC_DEVICE_SAME in a receiver
 * that sees the GPUs in reverse order. Receivers are separate processes
 * (posix_spawn; the library does not survive fork). */
#define _GNU_SOURCE
#include <string.h>
#include <sys/wait.h>

#include "gpu_testutil.h"

/* ---- receiver: recv HEX DEVICE ACCESS(comma list or -) EXPECT(ok|fail) ---- */

static int receiver(char **argv) {
  vmmipc_ticket t;
  ticket_from_hex(argv[2], &t);
  int device = atoi(argv[3]);
  int32_t access[8];
  uint32_t n_access = 0;
  if (strcmp(argv[4], "-"))
    for (char *p = strtok(argv[4], ","); p && n_access < 8; p = strtok(NULL, ",")) access[n_access++] = atoi(p);
  int expect_ok = !strcmp(argv[5], "ok");
  vmmipc_options o;
  vmmipc_options_init(&o, sizeof o);
  o.access_devices = access;
  o.access_device_count = n_access;
  vmmipc_mapping m = {0};
  char what[256];
  snprintf(what, sizeof what, "import onto device %d (CUDA_VISIBLE_DEVICES=%s, access %s)", device,
           getenv("CUDA_VISIBLE_DEVICES") ? getenv("CUDA_VISIBLE_DEVICES") : "unset", argv[4]);
  int rc = vmmipc_import_stream(&t, device, &o, &m);
  if (!expect_ok) {
    char d[1200];
    snprintf(d, sizeof d, "%s -> %s", vmmipc_strerror(rc), vmmipc_last_error());
    check(rc < 0 && m.addr == 0, what, d);
    return 0;
  }
  check(rc == 0, what, rc ? vmmipc_last_error() : NULL);
  if (rc) return 0;
  CU(cuInit(0));
  use_device(m.device);
  uint64_t bad = count_wrong(m.addr, m.size, 1);
  char d[128];
  snprintf(d, sizeof d, "%llu chunks on device %d, %llu bytes differ", (unsigned long long)(m.size / CHUNK),
           m.device, (unsigned long long)bad);
  check(bad == 0, "receiver reads the exporter's data", d);
  fill(m.addr, m.size, 2); /* the sender checks it sees these writes */
  CU(cuCtxSynchronize());
  check(vmmipc_unmap(&m) == 0, "vmmipc_unmap", NULL);
  return 0;
}

/* ---- runner ---- */

static int spawn_receiver(const char *hex, int device, const char *access, const char *visible, const char *expect) {
  char dev[16];
  snprintf(dev, sizeof dev, "%d", device);
  char *argv[] = {"vmmipc_peer_test", "recv", (char *)hex, dev, (char *)access, (char *)expect, NULL};
  char **env = NULL; /* ours */
  char *envbuf[512];
  char vis[256];
  if (visible) {
    int n = 0;
    for (char **e = environ; *e && n < 500; e++)
      if (strncmp(*e, "CUDA_VISIBLE_DEVICES=", 21)) envbuf[n++] = *e;
    snprintf(vis, sizeof vis, "CUDA_VISIBLE_DEVICES=%s", visible);
    envbuf[n++] = vis;
    envbuf[n] = NULL;
    env = envbuf;
  }
  pid_t pid = spawn_self(argv, env, NULL);
  if (pid < 0) return -1;
  int st;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

int main(int argc, char **argv) {
  if (argc > 5 && !strcmp(argv[1], "recv")) return receiver(argv);
  CU(cuInit(0));
  int count = 0;
  CU(cuDeviceGetCount(&count));
  use_device(0);
  CUdevice d0;
  CU(cuDeviceGet(&d0, 0));
  CUuuid u;
  CU(cuDeviceGetUuid(&u, d0));
  char uuid[64];
  snprintf(uuid, sizeof uuid,
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
           u.bytes[0] & 255, u.bytes[1] & 255, u.bytes[2] & 255, u.bytes[3] & 255, u.bytes[4] & 255,
           u.bytes[5] & 255, u.bytes[6] & 255, u.bytes[7] & 255, u.bytes[8] & 255, u.bytes[9] & 255,
           u.bytes[10] & 255, u.bytes[11] & 255, u.bytes[12] & 255, u.bytes[13] & 255, u.bytes[14] & 255,
           u.bytes[15] & 255);
  printf("# %d GPU(s) visible; exporter on device 0 = %s\n", count, uuid);

  uint64_t n = count >= 2 ? 4096 : 64;
  CUdeviceptr base = map_chunks(n, NULL);
  fill(base, n * CHUNK, 1);
  vmmipc_options o;
  vmmipc_options_init(&o, sizeof o);
  o.uses = 0; /* every receiver below */
  vmmipc_ticket t;
  if (vmmipc_register_cuda(base, n * CHUNK, &o, &t)) {
    printf("FAIL register: %s\n", vmmipc_last_error());
    return 1;
  }
  char hex[2 * VMMIPC_TICKET_SIZE + 1];
  ticket_to_hex(&t, hex);

  /* One GPU: the UUID path under a remapped CUDA_VISIBLE_DEVICES. */
  spawn_receiver(hex, VMMIPC_DEVICE_SAME, "-", uuid, "ok");
  check(count_wrong(base, n * CHUNK, 2) == 0, "sender sees the receiver's writes (DEVICE_SAME by UUID)", NULL);
  fill(base, n * CHUNK, 1);
  spawn_receiver(hex, 0, "0", NULL, "ok"); /* access list naming the importing device again */
  fill(base, n * CHUNK, 1);
  spawn_receiver(hex, count, "-", NULL, "fail");      /* an ordinal that does not exist */
  spawn_receiver(hex, 0, "9", NULL, "fail");          /* an access device that does not exist */
  spawn_receiver(hex, VMMIPC_DEVICE_SAME, "-", "NoDevFiles", "fail"); /* exporter's GPU not visible */

  if (count >= 2) {
    /* Exporter on GPU 0, receiver maps onto GPU 1 through peer access. */
    spawn_receiver(hex, 1, "-", NULL, "ok");
    uint64_t bad = count_wrong(base, n * CHUNK, 2);
    char d[96];
    snprintf(d, sizeof d, "%llu bytes differ", (unsigned long long)bad);
    check(bad == 0, "GPU 0 sees the writes GPU 1 made through the imported mapping", d);
    fill(base, n * CHUNK, 1);
    /* Receiver sees the GPUs in reverse order; DEVICE_SAME still finds GPU 0. */
    spawn_receiver(hex, VMMIPC_DEVICE_SAME, "-", "1,0", "ok");
    fill(base, n * CHUNK, 1);
    spawn_receiver(hex, 1, "0", NULL, "ok"); /* GPU 1 plus access for GPU 0 */
  } else {
    printf("SKIP two-GPU checks: only %d GPU visible (needs a machine with 2 GPUs)\n", count);
  }
  vmmipc_unregister(&t);
  return 0;
}
