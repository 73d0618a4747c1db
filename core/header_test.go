package core

import (
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestHeaderMatchesCore reads include/vmmipc.h and checks that every value
// core mirrors (statuses, bounds, sizes, devices, memory kinds) is the one
// the header promises, so the two cannot drift apart.
func TestHeaderMatchesCore(t *testing.T) {
	h, err := os.ReadFile("../include/vmmipc.h")
	if err != nil {
		t.Fatal(err)
	}
	defs := map[string]int64{}
	re := regexp.MustCompile(`(?m)^#define (VMMIPC_[A-Z_]+) \(?(-?(?:0x[0-9a-fA-F]+|[0-9]+))(ull|u)?(?: << ([0-9]+))?\)?`)
	for _, m := range re.FindAllStringSubmatch(string(h), -1) {
		v, err := strconv.ParseInt(m[2], 0, 64)
		if err != nil {
			t.Fatalf("%s: %v", m[1], err)
		}
		if m[4] != "" {
			shift, _ := strconv.Atoi(m[4])
			v <<= shift
		}
		defs[m[1]] = v
	}
	statuses := 0
	for _, c := range Codes() {
		name, _, _ := strings.Cut(c.String(), ":")
		v, ok := defs[name]
		if !ok || v != int64(c) {
			t.Errorf("core's %s is %d; vmmipc.h has %d (defined: %v)", name, c, v, ok)
		}
		statuses++
	}
	for name := range defs {
		if strings.HasPrefix(name, "VMMIPC_E") || name == "VMMIPC_OK" || name == "VMMIPC_END" {
			statuses--
		}
	}
	if statuses != 0 {
		t.Errorf("vmmipc.h and core differ in the number of statuses (core minus header: %d)", statuses)
	}
	want := map[string]int64{
		"VMMIPC_MAX_WINDOW": MaxWindow, "VMMIPC_MAX_ACCESS_DEVICES": MaxAccessDevices,
		"VMMIPC_MAX_TTL_MS": int64(MaxTTL / time.Millisecond), "VMMIPC_MAX_CHUNKS": MaxChunks,
		"VMMIPC_TICKET_SIZE": TicketSize, "VMMIPC_DEVICE_HOST": int64(DeviceHost),
		"VMMIPC_DEVICE_SAME": int64(DeviceSame), "VMMIPC_MEMORY_HOST": int64(MemoryHost),
		"VMMIPC_MEMORY_CUDA": int64(MemoryCUDA), "VMMIPC_IMPORT_NO_CACHE": int64(ImportNoCache),
		"VMMIPC_IMPORT_CONFIRM_LATER": int64(ImportConfirmLater),
	}
	for name, v := range want {
		if got, ok := defs[name]; !ok || got != v {
			t.Errorf("vmmipc.h's %s is %d (defined: %v); core's is %d", name, got, ok, v)
		}
	}
}
