/* The kept blocks: NCCL's pinned host backups, held from a resume to the next suspend.
 *
 * NCCL 2.30's resume copies each offloaded buffer back and frees its pinned
 * backup; the next suspend pins a block of the same size again. While the
 * Python side has a resume window open, a block NCCL frees is kept (up to a
 * byte bound) instead of unpinned; while a suspend window is open, an
 * allocation of the same size, flags and context gets a kept block back
 * instead of pinning anew. Outside the windows both calls go to the driver
 * unchanged (communicator set-up and teardown pin and free as before). NCCL
 * zeroes every block it gets (ncclCudaHostCalloc), so a reused block holds
 * nothing of its last use.
 *
 * A new block (the first cycle's, or one over the bound) is pinned by
 * registration where amem_hb_set_registered is on (the NCCL releases whose suspend
 * was read to use a backup only as a cudaMemcpy's host side): the kernel gets and
 * zeroes the pages first (mmap, MAP_POPULATE: no driver call), then
 * cuMemHostRegister pins them. Measured on an H100 (results/one_h100/pin_paths):
 * cuMemHostAlloc takes 0.64 s/GiB and the process's GPU work runs at 6 % of its
 * rate meanwhile; populating and registering take 0.40 s/GiB at 65 %. The block is
 * then pinned like any other: kept, reused, and released by unregistering and
 * unmapping it. A new mapping's pages are zero, so NCCL's zeroing of it is left out
 * too. Where the driver refuses the registration, the block is NCCL's own
 * cuMemHostAlloc, as asked, and registration is not tried again.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>
#include <time.h>

#include "host_backup.h"

typedef struct block {
  void* ptr;
  size_t size;
  unsigned int flags;
  CUcontext ctx;
  int registered; /* our mapping, pinned by cuMemHostRegister: unregister, then munmap */
  struct block* next;
} block;

#define LIVE_BUCKETS 4096
static block* live[LIVE_BUCKETS]; /* every block handed to the runtime, by address */
static block* kept;               /* blocks held for the next suspend */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static cu_host_alloc_fn real_alloc;
static cu_free_host_fn real_free;
static cu_ctx_current_fn real_ctx_current;
static cu_host_register_fn real_register;
static cu_host_unregister_fn real_unregister;
static volatile int suspend_depth, resume_depth, reuse_on = 1, register_on;
static amem_hb_stats_t st; /* under lock, except the windows' counts */
/* The kept block (or new registered one) this thread's last allocation handed back
 * (NULL when the last one pinned anew): NCCL's next call on this thread zeroes it,
 * then copies over it. */
static __thread void* fresh_ptr;
static __thread size_t fresh_size;

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static size_t bucket(const void* p) { return ((uintptr_t)p >> 12) % LIVE_BUCKETS; }

static void live_add(block* b) {
  size_t i = bucket(b->ptr);
  b->next = live[i];
  live[i] = b;
}

static block* live_take(const void* p) {
  for (block** at = &live[bucket(p)]; *at; at = &(*at)->next) {
    if ((*at)->ptr == p) {
      block* b = *at;
      *at = b->next;
      return b;
    }
  }
  return NULL;
}

static CUcontext current_context(void) {
  CUcontext ctx = NULL;
  if (real_ctx_current) real_ctx_current(&ctx);
  return ctx;
}

void* amem_hb_substitute(const char* symbol, void* real) {
  /* One ABI each; a second, different pointer for the same name is left alone. */
  if (strcmp(symbol, "cuMemHostAlloc") == 0) {
    if (!real_alloc) real_alloc = (cu_host_alloc_fn)real;
    if (real == (void*)real_alloc) { st.alloc_wrapped = 1; return (void*)amem_hb_host_alloc; }
    __atomic_add_fetch(&amem_hb_unknown, 1, __ATOMIC_RELAXED);
  } else if (strcmp(symbol, "cuMemFreeHost") == 0) {
    if (!real_free) real_free = (cu_free_host_fn)real;
    if (real == (void*)real_free) { st.free_wrapped = 1; return (void*)amem_hb_free_host; }
    __atomic_add_fetch(&amem_hb_unknown, 1, __ATOMIC_RELAXED);
  } else if (strcmp(symbol, "cuCtxGetCurrent") == 0 && !real_ctx_current) {
    real_ctx_current = (cu_ctx_current_fn)real;
  }
  return real;
}

/* cuMemHostAlloc's flags the registration can honour: PORTABLE and DEVICEMAP have
 * the same values in cuMemHostRegister's; WRITECOMBINED has no counterpart. */
#define REGISTRABLE_FLAGS 0x3u

/* A new block of kernel-zeroed pages pinned by registration (0), or nothing done
 * (non-zero: the caller pins through the driver as NCCL asked). */
static int register_new(void** pp, size_t size, unsigned int flags) {
  if (flags & ~REGISTRABLE_FLAGS) return -1;
  if (!real_register || !real_unregister) {
    real_register = (cu_host_register_fn)amem_hb_driver_entry("cuMemHostRegister");
    real_unregister = (cu_host_unregister_fn)amem_hb_driver_entry("cuMemHostUnregister");
    if (!real_register || !real_unregister) { /* a driver without them: never again */
      __atomic_add_fetch(&st.register_failed, 1, __ATOMIC_RELAXED);
      register_on = 0;
      return -1;
    }
  }
  block* b = malloc(sizeof *b);
  if (!b) return -1;
  uint64_t start = now_ns();
  void* p = mmap(NULL, size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  CUresult result = p == MAP_FAILED ? -1 : real_register(p, size, flags);
  uint64_t took = now_ns() - start;
  if (result != 0) {
    free(b);
    if (p != MAP_FAILED) munmap(p, size);
    __atomic_add_fetch(&st.register_failed, 1, __ATOMIC_RELAXED);
    register_on = 0; /* the driver said no: NCCL's own pinning from here on */
    return -1;
  }
  *b = (block){p, size, flags, current_context(), 1, NULL};
  pthread_mutex_lock(&lock);
  live_add(b);
  st.pinned_new++;
  st.pinned_new_bytes += size;
  st.registered_new++;
  st.registered_new_bytes += size;
  st.pin_ns += took;
  pthread_mutex_unlock(&lock);
  *pp = p;
  fresh_ptr = p; /* a new mapping's pages are zero: NCCL's zeroing is not needed */
  fresh_size = size;
  return 0;
}

CUresult amem_hb_host_alloc(void** pp, size_t size, unsigned int flags) {
  if (__atomic_load_n(&suspend_depth, __ATOMIC_ACQUIRE) > 0 && reuse_on && pp) {
    CUcontext ctx = current_context();
    pthread_mutex_lock(&lock);
    for (block** at = &kept; *at; at = &(*at)->next) {
      block* b = *at;
      if (b->size == size && b->flags == flags && b->ctx == ctx) {
        *at = b->next;
        live_add(b);
        st.kept_bytes -= size;
        st.kept_blocks--;
        st.reused++;
        st.reused_bytes += size;
        pthread_mutex_unlock(&lock);
        *pp = b->ptr;
        fresh_ptr = b->ptr;
        fresh_size = size;
        return 0;
      }
    }
    pthread_mutex_unlock(&lock);
  }
  fresh_ptr = NULL;
  if (register_on && reuse_on && pp && __atomic_load_n(&suspend_depth, __ATOMIC_ACQUIRE) > 0 &&
      register_new(pp, size, flags) == 0)
    return 0;
  uint64_t start = now_ns();
  CUresult result = real_alloc(pp, size, flags);
  uint64_t took = now_ns() - start;
  if (result != 0 || !pp) return result;
  block* b = malloc(sizeof *b);
  pthread_mutex_lock(&lock);
  st.pinned_new++;
  st.pinned_new_bytes += size;
  st.pin_ns += took;
  if (b) { /* untracked (no memory for the record): it is simply never kept */
    *b = (block){*pp, size, flags, current_context(), 0, NULL};
    live_add(b);
  }
  pthread_mutex_unlock(&lock);
  return 0;
}

/* Free a block for good: unpin it (a registered one: unregister and unmap), counted.
 * Takes the record. */
static CUresult release_block(block* b, void* p, size_t size) {
  int registered = b && b->registered;
  free(b);
  uint64_t start = now_ns();
  CUresult result;
  if (registered) {
    result = real_unregister(p);
    munmap(p, size);
  } else {
    result = real_free(p);
  }
  uint64_t took = now_ns() - start;
  pthread_mutex_lock(&lock);
  st.unpinned++;
  st.unpinned_bytes += size;
  st.unpin_ns += took;
  pthread_mutex_unlock(&lock);
  return result;
}

CUresult amem_hb_free_host(void* p) {
  pthread_mutex_lock(&lock);
  block* b = p ? live_take(p) : NULL;
  if (b && reuse_on && __atomic_load_n(&resume_depth, __ATOMIC_ACQUIRE) > 0 &&
      st.kept_bytes + b->size <= st.limit_bytes) {
    b->next = kept;
    kept = b;
    st.kept_bytes += b->size;
    st.kept_blocks++;
    pthread_mutex_unlock(&lock);
    return 0;
  }
  pthread_mutex_unlock(&lock);
  return release_block(b, p, b ? b->size : 0);
}

/* Installed in libnccl's memset slot only for the NCCL versions whose suspend was
 * read to do, per offloaded entry and on one thread: ncclCudaHostCalloc(backup, n)
 * (cudaHostAlloc, then memset(backup, 0, n)), then cudaMemcpy(backup, device, n). The
 * zeroing of a block just handed back from the pool is then overwritten whole before
 * anything reads it: it is left out. Every other memset runs as before. */
void* amem_hb_memset(void* s, int c, size_t n) {
  if (s && s == fresh_ptr && c == 0 && n == fresh_size) {
    fresh_ptr = NULL;
    __atomic_add_fetch(&st.zero_skipped, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&st.zero_skipped_bytes, n, __ATOMIC_RELAXED);
    return s;
  }
  return memset(s, c, n);
}

/* Unpin kept blocks until at most `keep` bytes stay; the bytes unpinned. */
static uint64_t trim(uint64_t keep) {
  uint64_t released = 0;
  for (;;) {
    pthread_mutex_lock(&lock);
    block* b = st.kept_bytes > keep ? kept : NULL;
    if (b) {
      kept = b->next;
      st.kept_bytes -= b->size;
      st.kept_blocks--;
    }
    pthread_mutex_unlock(&lock);
    if (!b) return released;
    released += b->size;
    release_block(b, b->ptr, b->size);
  }
}

/* --- the Python side's calls ------------------------------------------------ */
/* kind 0: a suspend runs (allocations may take kept blocks); 1: a resume runs
 * (frees are kept). Windows nest and overlap across threads: counts, not flags. */
AMEM_EXPORT void amem_hb_enter(int kind) {
  __atomic_add_fetch(kind ? &resume_depth : &suspend_depth, 1, __ATOMIC_ACQ_REL);
  __atomic_add_fetch(kind ? &st.resume_windows : &st.suspend_windows, 1, __ATOMIC_RELAXED);
}

AMEM_EXPORT void amem_hb_leave(int kind) {
  fresh_ptr = NULL; /* a zeroing is left out only inside the suspend that handed the block */
  __atomic_sub_fetch(kind ? &resume_depth : &suspend_depth, 1, __ATOMIC_ACQ_REL);
}

/* The most bytes kept between a resume and the next suspend; lowering it unpins
 * what is over. Returns the bytes unpinned. */
AMEM_EXPORT uint64_t amem_hb_set_limit(uint64_t bytes) {
  pthread_mutex_lock(&lock);
  st.limit_bytes = bytes;
  pthread_mutex_unlock(&lock);
  return trim(bytes);
}

/* Off: nothing more is kept, and what is kept is unpinned now. */
AMEM_EXPORT uint64_t amem_hb_set_reuse(int on) {
  reuse_on = on ? 1 : 0;
  return on ? 0 : trim(0);
}

/* New backups pinned by registration (1) or by the driver's cuMemHostAlloc, as NCCL
 * asks (0). The Python side turns it on only for the NCCL releases read. */
AMEM_EXPORT void amem_hb_set_registered(int on) { register_on = on ? 1 : 0; }

/* Unpin every kept block (policy close, exit); the bytes unpinned. */
AMEM_EXPORT uint64_t amem_hb_release(void) { return trim(0); }

AMEM_EXPORT void amem_hb_stats(amem_hb_stats_t* out) {
  pthread_mutex_lock(&lock);
  *out = st;
  pthread_mutex_unlock(&lock);
  out->lookups = __atomic_load_n(&amem_hb_lookups, __ATOMIC_RELAXED);
  out->unknown = __atomic_load_n(&amem_hb_unknown, __ATOMIC_RELAXED);
  out->reuse_on = (uint64_t)reuse_on;
  out->registered_on = (uint64_t)register_on;
}
