/* Keeping NCCL's pinned host backup from one suspend to the next.
 *
 * NCCL's suspend pins a fresh host block for every buffer it offloads
 * (cudaHostAlloc + memset + copy) and its resume unpins it again
 * (cudaFreeHost). Pinning and unpinning cost many times the copy, on every
 * cycle. libnccl links the CUDA runtime statically, so those calls cannot be
 * interposed by symbol; but that runtime reaches the driver through libnccl's
 * own dlsym import and then the driver's cuGetProcAddress. lookup_hook.c points
 * libnccl's dlsym slots at an answer that hands its runtime our
 * cuMemHostAlloc/cuMemFreeHost; backup_pool.c keeps the blocks NCCL frees while
 * a resume runs and hands them back to the next suspend, same size and flags,
 * and (NCCL 2.30-2.32, through libnccl's memset slot) leaves out the zeroing of a
 * block handed back that NCCL then copies over whole. Nothing else in the process
 * is touched: only libnccl's own slots change.
 */
#ifndef AMEM_HOST_BACKUP_H
#define AMEM_HOST_BACKUP_H

#include <stddef.h>
#include <stdint.h>

#define AMEM_EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef void* CUcontext;

typedef CUresult (*cu_host_alloc_fn)(void** pp, size_t bytesize, unsigned int flags);
typedef CUresult (*cu_free_host_fn)(void* p);
typedef CUresult (*cu_ctx_current_fn)(CUcontext* ctx);
typedef CUresult (*cu_host_register_fn)(void* p, size_t bytesize, unsigned int flags);
typedef CUresult (*cu_host_unregister_fn)(void* p);

/* backup_pool.c: the driver functions the runtime asked for, wrapped */
CUresult amem_hb_host_alloc(void** pp, size_t bytesize, unsigned int flags);
CUresult amem_hb_free_host(void* p);
/* libnccl's memset, when zeroing may be skipped: NCCL zeroes each backup it gets
 * (ncclCudaHostCalloc) and then copies the device bytes over all of it. */
void* amem_hb_memset(void* s, int c, size_t n);
/* A driver function a look-up answered: the pool keeps the real one and returns
 * what the runtime should call instead (the same pointer when it is not ours). */
void* amem_hb_substitute(const char* symbol, void* real);

/* lookup_hook.c: a driver entry point from the cuGetProcAddress NCCL's runtime uses
 * (NULL before that runtime reached the driver, or where the driver has none) */
void* amem_hb_driver_entry(const char* symbol);
/* lookup_hook.c: counts of what the answers saw */
extern volatile uint64_t amem_hb_lookups;  /* driver look-ups answered */
extern volatile uint64_t amem_hb_unknown;  /* look-ups whose answer was not recognised */

/* The figures the Python side reads (amem_hb_stats fills it). */
typedef struct amem_hb_stats_t {
  uint64_t kept_bytes, kept_blocks;        /* pinned blocks held for the next suspend */
  uint64_t reused, reused_bytes;           /* allocations answered from kept blocks */
  uint64_t pinned_new, pinned_new_bytes;   /* allocations that pinned fresh memory */
  uint64_t unpinned, unpinned_bytes;       /* blocks really freed (unpinned) */
  uint64_t pin_ns, unpin_ns;               /* time spent pinning/unpinning (pages included) */
  uint64_t lookups, unknown;               /* driver look-ups answered / not recognised */
  uint64_t alloc_wrapped, free_wrapped;    /* the runtime got our functions (0/1) */
  uint64_t limit_bytes, reuse_on;
  uint64_t suspend_windows, resume_windows;/* windows opened so far */
  uint64_t zero_skipped, zero_skipped_bytes;/* zeroings of reused backups left out */
  /* new blocks pinned by registration (amem_hb_set_registered), counted in pinned_new too */
  uint64_t registered_new, registered_new_bytes;
  uint64_t register_failed;                /* registrations the driver refused (then off) */
  uint64_t registered_on;
} amem_hb_stats_t;

#endif
