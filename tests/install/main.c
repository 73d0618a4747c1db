/* Links the installed libvmmipc through find_package and through pkg-config. */
#include <stdio.h>
#include <vmmipc.h>
int main(void) { uint64_t n; int rc = vmmipc_live_registrations(&n); printf("vmmipc %s rc=%d live=%llu\n", vmmipc_version(), rc, (unsigned long long)n); return rc; }
