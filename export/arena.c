/* The arena calls of vmmipc.h ("Arenas"): plain C over memory the caller
 * maps, callable in a child made by fork() (no Go, no allocation, no lock,
 * nothing opened but /proc/<pid>/stat to tell a zombie). One home for the
 * layout: the header, the region headers, the slot tables, the data.
 *
 * A slot's state word is (generation << 8 | state). Only a region's owner
 * moves FREE -> WRITING (with a new generation) and WRITING -> SENT, and
 * writes a slot's offset, capacity and nbytes, which the SENT release store
 * publishes. The arena's owner moves SENT -> HELD -> FREE by
 * compare-and-swap, so a stale or repeated block (a generation gone) is
 * refused, never applied. A takeover (claim or reap) first makes itself the
 * region's owner by compare-and-swap on the owner field, so it never frees
 * what a live writer is writing. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "abi.h"

enum { FREE = 0, WRITING = 1, SENT = 2, HELD = 3 };

#define PAGE 4096ull
#define MAGIC 0x3141524150494d56ull /* "VMIPARA1" little-endian */
#define LARGE_BLOCK (64ull << 10)

typedef struct {
  uint64_t magic;
  uint32_t regions, slots;
  uint64_t region_bytes;
  uint64_t tables_offset; /* regions * slots slots */
  uint64_t data_offset;   /* regions * region_bytes */
  uint64_t size;
} arena_header;

typedef struct {
  uint64_t owner;     /* pid, 0: nobody */
  uint64_t used;      /* slots in use: [0, used) */
  uint64_t top;       /* data bytes carved: [0, top) of the region */
  uint64_t takeovers; /* counted in region 0's header only */
  uint64_t pad[4];
} region_header;

typedef struct {
  uint64_t word; /* generation << 8 | state */
  uint64_t offset; /* from the region's data start */
  uint64_t capacity;
  uint64_t nbytes;
} slot;

#define STATE(w) ((unsigned)((w) & 0xff))
#define GEN(w) ((w) >> 8)
#define WORD(g, s) (((g) << 8) | (uint64_t)(s))

static uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

/* The error's text names no function: the caller's error names it. */
static int fail(int status, const char *fn, const char *msg) {
  (void)fn;
  vmmipc_abi_set_error(msg, strlen(msg));
  return status;
}

static int layout(uint32_t regions, uint32_t slots, uint64_t region_bytes, arena_header *h) {
  if (regions < 1 || regions > 4096 || slots < 1 || slots > (1u << 20) ||
      region_bytes < PAGE || region_bytes % PAGE || region_bytes > (1ull << 46))
    return 0;
  h->magic = MAGIC;
  h->regions = regions;
  h->slots = slots;
  h->region_bytes = region_bytes;
  h->tables_offset = round_up(sizeof(arena_header) + (uint64_t)regions * sizeof(region_header), PAGE);
  h->data_offset = h->tables_offset + round_up((uint64_t)regions * slots * sizeof(slot), PAGE);
  if ((uint64_t)regions * region_bytes > (1ull << 46) - h->data_offset) return 0;
  h->size = h->data_offset + (uint64_t)regions * region_bytes;
  return 1;
}

/* The header at base, checked against size; NULL (error set) if it is not
 * an arena of that size. */
static const arena_header *arena(const void *base, uint64_t size, const char *fn) {
  if (!base || (uintptr_t)base % PAGE) {
    fail(VMMIPC_EINVAL, fn, "NULL or unaligned arena base");
    return NULL;
  }
  const arena_header *h = base;
  arena_header want;
  if (h->magic != MAGIC || !layout(h->regions, h->slots, h->region_bytes, &want) ||
      want.size != h->size || want.data_offset != h->data_offset || h->size != size) {
    fail(VMMIPC_EINVAL, fn, "not an arena of this size (unformatted, damaged, or another size)");
    return NULL;
  }
  return h;
}

static region_header *region_of(const arena_header *h, uint32_t r) {
  return (region_header *)((char *)h + sizeof(arena_header)) + r;
}

static slot *slots_of(const arena_header *h, uint32_t r) {
  return (slot *)((char *)h + h->tables_offset) + (uint64_t)r * h->slots;
}

static uint64_t load(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static void store(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static int cas(uint64_t *p, uint64_t old, uint64_t new_) {
  return __atomic_compare_exchange_n(p, &old, new_, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

/* Whether pid is a live process (a zombie is dead: its memory is gone). */
static int alive(uint64_t pid) {
  if (pid == 0 || pid > 0x7fffffff) return 0;
  if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return 0;
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%llu/stat", (unsigned long long)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno != ENOENT;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 1;
  buf[n] = '\0';
  const char *paren = strrchr(buf, ')'); /* the name may hold spaces and ')' */
  return !(paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X'));
}

/* The new owner of region r frees what nobody will receive. */
static void reclaim(const arena_header *h, uint32_t r) {
  region_header *rh = region_of(h, r);
  slot *s = slots_of(h, r);
  uint64_t used = load(&rh->used);
  for (uint64_t i = 0; i < used && i < h->slots; i++) {
    uint64_t w = load(&s[i].word);
    while (STATE(w) == WRITING || STATE(w) == SENT) {
      if (cas(&s[i].word, w, WORD(GEN(w), FREE))) break;
      w = load(&s[i].word);
    }
  }
}

/* Takes region r over from its owner `was` (0: nobody; else dead) as pid:
 * 1 if done. */
static int take_over(const arena_header *h, uint32_t r, uint64_t was, uint64_t pid) {
  region_header *rh = region_of(h, r);
  if (!cas(&rh->owner, was, pid)) return 0;
  reclaim(h, r);
  if (was != 0) __atomic_add_fetch(&region_of(h, 0)->takeovers, 1, __ATOMIC_RELAXED);
  return 1;
}

int vmmipc_arena_size(uint32_t regions, uint32_t slots, uint64_t region_bytes, uint64_t *size_out) {
  arena_header h;
  if (!size_out) return fail(VMMIPC_EINVAL, "vmmipc_arena_size", "NULL size_out");
  if (!layout(regions, slots, region_bytes, &h))
    return fail(VMMIPC_EINVAL, "vmmipc_arena_size",
                "regions must be 1..4096, slots 1..1048576, region_bytes a multiple of 4096, "
                "and the arena at most 64 TiB");
  *size_out = h.size;
  return VMMIPC_OK;
}

int vmmipc_arena_format(void *base, uint64_t size, uint32_t regions, uint32_t slots,
                        uint64_t region_bytes) {
  const char *fn = "vmmipc_arena_format";
  arena_header h;
  if (!base || (uintptr_t)base % PAGE) return fail(VMMIPC_EINVAL, fn, "NULL or unaligned base");
  if (!layout(regions, slots, region_bytes, &h) || h.size != size)
    return fail(VMMIPC_EINVAL, fn, "size is not vmmipc_arena_size's for this shape");
  uint64_t magic = __atomic_load_n((uint64_t *)base, __ATOMIC_ACQUIRE);
  if (magic != 0) return fail(VMMIPC_EINVAL, fn, "memory not zero-filled (formatted already?)");
  memcpy((char *)base + sizeof(uint64_t), (char *)&h + sizeof(uint64_t),
         sizeof h - sizeof(uint64_t));
  store((uint64_t *)base, MAGIC); /* last: a reader that sees it sees the rest */
  return VMMIPC_OK;
}

int vmmipc_arena_claim(void *base, uint64_t size, uint32_t pid, uint32_t *region_out) {
  const char *fn = "vmmipc_arena_claim";
  const arena_header *h = arena(base, size, fn);
  if (!h) return VMMIPC_EINVAL;
  if (!region_out || pid == 0) return fail(VMMIPC_EINVAL, fn, "NULL region_out or pid 0");
  for (uint32_t r = 0; r < h->regions; r++) /* a region nobody owns */
    if (take_over(h, r, 0, pid)) {
      *region_out = r;
      return VMMIPC_OK;
    }
  for (uint32_t r = 0; r < h->regions; r++) { /* one whose owner died */
    uint64_t owner = load(&region_of(h, r)->owner);
    if (owner != 0 && owner != pid && !alive(owner) && take_over(h, r, owner, pid)) {
      *region_out = r;
      return VMMIPC_OK;
    }
  }
  char msg[128];
  snprintf(msg, sizeof msg, "all %u regions have a live owner: make the arena with more regions",
           h->regions);
  return fail(VMMIPC_ENOMEM, fn, msg);
}

static int region_ok(const arena_header *h, uint32_t r, const char *fn) {
  if (r >= h->regions) {
    fail(VMMIPC_EINVAL, fn, "region out of range");
    return 0;
  }
  return 1;
}

int vmmipc_arena_leave(void *base, uint64_t size, uint32_t region, uint32_t pid) {
  const char *fn = "vmmipc_arena_leave";
  const arena_header *h = arena(base, size, fn);
  if (!h) return VMMIPC_EINVAL;
  if (!region_ok(h, region, fn)) return VMMIPC_EINVAL;
  region_header *rh = region_of(h, region);
  if (pid == 0 || load(&rh->owner) != pid) return fail(VMMIPC_ENOENT, fn, "pid does not own the region");
  reclaim(h, region);
  store(&rh->owner, 0);
  return VMMIPC_OK;
}

int vmmipc_arena_reap(void *base, uint64_t size, uint32_t pid, uint32_t *reaped_out) {
  const char *fn = "vmmipc_arena_reap";
  const arena_header *h = arena(base, size, fn);
  if (!h) return VMMIPC_EINVAL;
  if (pid == 0) return fail(VMMIPC_EINVAL, fn, "pid 0");
  uint32_t reaped = 0;
  for (uint32_t r = 0; r < h->regions; r++) {
    uint64_t owner = load(&region_of(h, r)->owner);
    /* An unowned region too: its writer left, and what it sent after that
     * (its queue's feeder thread, at exit) nobody receives. */
    if (owner != pid && (owner == 0 || !alive(owner)) && take_over(h, r, owner, pid)) {
      store(&region_of(h, r)->owner, 0);
      if (owner != 0) reaped++;
    }
  }
  if (reaped_out) *reaped_out = reaped;
  return VMMIPC_OK;
}

/* Trailing free slots go back to fresh room (their words keep their
 * generation, so a stale block naming one stays refused). */
static void trim(const arena_header *h, region_header *rh, slot *s) {
  uint64_t used = rh->used;
  while (used > 0 && STATE(load(&s[used - 1].word)) == FREE) {
    used--;
    rh->top = s[used].offset;
  }
  store(&rh->used, used);
  (void)h;
}

int vmmipc_arena_alloc(void *base, uint64_t size, uint32_t region, uint64_t nbytes,
                       vmmipc_arena_block *block_out) {
  const char *fn = "vmmipc_arena_alloc";
  const arena_header *h = arena(base, size, fn);
  if (!h) return VMMIPC_EINVAL;
  if (!region_ok(h, region, fn)) return VMMIPC_EINVAL;
  if (!block_out || nbytes == 0) return fail(VMMIPC_EINVAL, fn, "NULL block_out or nbytes 0");
  if (nbytes > h->region_bytes) {
    char msg[160];
    snprintf(msg, sizeof msg, "%llu bytes are more than a region holds (%llu bytes)",
             (unsigned long long)nbytes, (unsigned long long)h->region_bytes);
    return fail(VMMIPC_ENOMEM, fn, msg);
  }
  region_header *rh = region_of(h, region);
  if (load(&rh->owner) != (uint64_t)getpid())
    return fail(VMMIPC_ENOENT, fn, "this process does not own the region (it left, or is a "
                                   "child of its owner)");
  slot *s = slots_of(h, region);
  trim(h, rh, s);
  uint64_t used = rh->used, best = UINT64_MAX, best_cap = UINT64_MAX;
  for (uint64_t i = 0; i < used; i++) {
    uint64_t w = load(&s[i].word);
    if (STATE(w) == FREE && s[i].capacity >= nbytes && s[i].capacity < best_cap) {
      best = i;
      best_cap = s[i].capacity;
      if (best_cap == nbytes) break;
    }
  }
  uint64_t align = nbytes >= LARGE_BLOCK ? PAGE : VMMIPC_ARENA_ALIGN;
  uint64_t start = round_up(rh->top, align);
  uint64_t cap = round_up(nbytes, align);
  int room = used < h->slots && start <= h->region_bytes && cap <= h->region_bytes - start;
  uint64_t i;
  if (best != UINT64_MAX && (best_cap <= 2 * nbytes || !room)) {
    i = best;
  } else if (room) {
    i = used;
    s[i].offset = start;
    s[i].capacity = cap;
    rh->top = start + cap;
    store(&rh->used, used + 1);
  } else {
    uint64_t live = 0, blocks = 0;
    for (uint64_t j = 0; j < used; j++)
      if (STATE(load(&s[j].word)) != FREE) {
        live += s[j].nbytes;
        blocks++;
      }
    char msg[256];
    snprintf(msg, sizeof msg,
             "no room for %llu bytes in region %u: %llu blocks of %llu bytes live there, "
             "%llu of %llu slots used, region of %llu bytes",
             (unsigned long long)nbytes, region, (unsigned long long)blocks,
             (unsigned long long)live, (unsigned long long)used, (unsigned long long)h->slots,
             (unsigned long long)h->region_bytes);
    return fail(VMMIPC_ENOMEM, fn, msg);
  }
  uint64_t w = load(&s[i].word);
  uint64_t gen = GEN(w) + 1;
  s[i].nbytes = nbytes;
  if (!cas(&s[i].word, w, WORD(gen, WRITING)))
    return fail(VMMIPC_EINTERNAL, fn, "a free slot changed under its region's owner");
  block_out->region = region;
  block_out->slot = (uint32_t)i;
  block_out->generation = gen;
  block_out->offset = h->data_offset + (uint64_t)region * h->region_bytes + s[i].offset;
  block_out->nbytes = nbytes;
  return VMMIPC_OK;
}

/* The slot a block names, checked; NULL (error set) if out of range. */
static slot *slot_of(const void *base, uint64_t size, const vmmipc_arena_block *b, const char *fn,
                     const arena_header **hp) {
  const arena_header *h = arena(base, size, fn);
  if (!h) return NULL;
  if (!b) {
    fail(VMMIPC_EINVAL, fn, "NULL block");
    return NULL;
  }
  if (b->region >= h->regions || b->slot >= h->slots) {
    fail(VMMIPC_EINVAL, fn, "block's region or slot out of range (a damaged block?)");
    return NULL;
  }
  *hp = h;
  return slots_of(h, b->region) + b->slot;
}

/* Moves the block from state `from` to `to` in its generation. */
static int move(void *base, uint64_t size, const vmmipc_arena_block *b, unsigned from1,
                unsigned from2, unsigned to, const char *fn, const char *why) {
  const arena_header *h;
  slot *s = slot_of(base, size, b, fn, &h);
  if (!s) return VMMIPC_EINVAL;
  uint64_t w = load(&s->word);
  while (GEN(w) == b->generation && (STATE(w) == from1 || STATE(w) == from2)) {
    if (cas(&s->word, w, WORD(b->generation, to))) return VMMIPC_OK;
    w = load(&s->word);
  }
  char msg[256];
  static const char *names[] = {"free", "being written", "sent", "held"};
  if (GEN(w) == b->generation)
    snprintf(msg, sizeof msg, "block %u/%u generation %llu is %s: %s", b->region, b->slot,
             (unsigned long long)b->generation, names[STATE(w) & 3], why);
  else
    snprintf(msg, sizeof msg, "block %u/%u generation %llu is gone (the slot is at generation %llu): %s",
             b->region, b->slot, (unsigned long long)b->generation, (unsigned long long)GEN(w), why);
  return fail(VMMIPC_ENOENT, fn, msg);
}

int vmmipc_arena_send(void *base, uint64_t size, const vmmipc_arena_block *block) {
  const arena_header *h;
  if (!slot_of(base, size, block, "vmmipc_arena_send", &h)) return VMMIPC_EINVAL;
  if (load(&region_of(h, block->region)->owner) != (uint64_t)getpid())
    return fail(VMMIPC_ENOENT, "vmmipc_arena_send",
                "this process does not own the block's region (it left: nobody will receive it)");
  return move(base, size, block, WRITING, WRITING, SENT, "vmmipc_arena_send",
              "only a block being written can be sent, once");
}

int vmmipc_arena_receive(void *base, uint64_t size, vmmipc_arena_block *block) {
  const char *fn = "vmmipc_arena_receive";
  int status = move(base, size, block, SENT, SENT, HELD, fn,
                    "received already, or its writer died or left and its region was taken over");
  if (status != VMMIPC_OK) return status;
  const arena_header *h;
  slot *s = slot_of(base, size, block, fn, &h);
  block->offset = h->data_offset + (uint64_t)block->region * h->region_bytes + s->offset;
  block->nbytes = s->nbytes;
  return VMMIPC_OK;
}

int vmmipc_arena_free(void *base, uint64_t size, const vmmipc_arena_block *block) {
  return move(base, size, block, HELD, HELD, FREE, "vmmipc_arena_free",
              "only a received (held) block can be freed, once");
}

int vmmipc_arena_drop(void *base, uint64_t size, const vmmipc_arena_block *block) {
  return move(base, size, block, WRITING, WRITING, FREE, "vmmipc_arena_drop",
              "only a block being written (never sent) can be dropped, once");
}

int vmmipc_arena_get_info(const void *base, uint64_t size, vmmipc_arena_info *info_out,
                          size_t info_size) {
  const char *fn = "vmmipc_arena_get_info";
  const arena_header *h = arena(base, size, fn);
  if (!h) return VMMIPC_EINVAL;
  if (!info_out) return fail(VMMIPC_EINVAL, fn, "NULL info_out");
  vmmipc_arena_info info;
  memset(&info, 0, sizeof info);
  info.regions = h->regions;
  info.slots = h->slots;
  info.region_bytes = h->region_bytes;
  for (uint32_t r = 0; r < h->regions; r++) {
    region_header *rh = region_of(h, r);
    if (load(&rh->owner)) info.regions_owned++;
    uint64_t used = load(&rh->used);
    if (used > h->slots) used = h->slots;
    slot *s = slots_of(h, r);
    for (uint64_t i = 0; i < used; i++) {
      uint64_t w = load(&s[i].word);
      info.carved_bytes += s[i].capacity;
      switch (STATE(w)) {
      case WRITING: info.blocks_writing++; break;
      case SENT: info.blocks_sent++; break;
      case HELD: info.blocks_held++; break;
      default: info.blocks_free++; continue;
      }
      info.live_bytes += s[i].nbytes;
    }
  }
  info.takeovers = __atomic_load_n(&region_of(h, 0)->takeovers, __ATOMIC_RELAXED);
  memcpy(info_out, &info, info_size < sizeof info ? info_size : sizeof info);
  return VMMIPC_OK;
}
