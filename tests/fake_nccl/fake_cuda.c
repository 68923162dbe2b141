/* A stand-in CUDA driver: the entry points NCCL's static runtime reaches through
 * cuGetProcAddress (both ABIs), with "pinned" host memory from malloc.
 *
 * Every block carries a header so a free of something it never handed out, or a
 * second free, is CUDA_ERROR_INVALID_VALUE, as the driver's is. Counters tell the
 * tests what really reached the driver: pins, unpins and the bytes pinned now.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_OUT_OF_MEMORY = 2,
       CUDA_ERROR_NOT_FOUND = 500 };
#define LIVE 0x70696e6e6564ULL /* "pinned" */
#define DEAD 0x66726565ULL     /* "free" */

typedef struct { uint64_t magic, size; unsigned flags, pad; } header;
static long pins, unpins, bad_frees;
static uint64_t pinned_bytes;

CUresult cuMemHostAlloc(void** pp, size_t size, unsigned int flags) {
  header* h = malloc(sizeof(header) + size);
  if (!h) return CUDA_ERROR_OUT_OF_MEMORY;
  *h = (header){LIVE, size, flags, 0};
  __atomic_add_fetch(&pins, 1, __ATOMIC_RELAXED);
  __atomic_add_fetch(&pinned_bytes, size, __ATOMIC_RELAXED);
  *pp = h + 1;
  return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void* p) {
  header* h = (header*)p - 1;
  if (!p || h->magic != LIVE) { __atomic_add_fetch(&bad_frees, 1, __ATOMIC_RELAXED); return CUDA_ERROR_INVALID_VALUE; }
  h->magic = DEAD;
  __atomic_add_fetch(&unpins, 1, __ATOMIC_RELAXED);
  __atomic_sub_fetch(&pinned_bytes, h->size, __ATOMIC_RELAXED);
  free(h);
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(void** ctx) { *ctx = (void*)0x1; return CUDA_SUCCESS; }

CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, uint64_t flags);
CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, uint64_t flags,
                             int* status);

static void* entry(const char* symbol, int version) {
  if (strcmp(symbol, "cuGetProcAddress") == 0)
    return version >= 12000 ? (void*)cuGetProcAddress_v2 : (void*)cuGetProcAddress;
  if (strcmp(symbol, "cuMemHostAlloc") == 0) return (void*)cuMemHostAlloc;
  if (strcmp(symbol, "cuMemFreeHost") == 0) return (void*)cuMemFreeHost;
  if (strcmp(symbol, "cuCtxGetCurrent") == 0) return (void*)cuCtxGetCurrent;
  return NULL;
}

CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, uint64_t flags) {
  (void)flags;
  *pfn = entry(symbol, version);
  return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, uint64_t flags,
                             int* status) {
  CUresult result = cuGetProcAddress(symbol, pfn, version, flags);
  if (status) *status = result == CUDA_SUCCESS ? 0 : 1;
  return result;
}

/* what: 0 pins, 1 unpins, 2 bytes pinned now, 3 frees of unknown or freed blocks */
long fakeCudaCount(int what) {
  switch (what) {
    case 0: return pins;
    case 1: return unpins;
    case 2: return (long)pinned_bytes;
    default: return bad_frees;
  }
}
