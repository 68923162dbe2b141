/* A stand-in CUDA driver: the entry points NCCL's static runtime reaches through
 * cuGetProcAddress (both ABIs), with "pinned" host memory from malloc.
 *
 * Every block carries a header so a free of something it never handed out, or a
 * second free, is CUDA_ERROR_INVALID_VALUE, as the driver's is. Host memory can be
 * registered too (cuMemHostRegister): a range registered twice, or an unregister of
 * one never registered, is CUDA_ERROR_INVALID_VALUE (counted as a bad free);
 * FAKE_CUDA_REGISTER_FAILS=1 refuses every registration, as a driver without it does.
 * Counters tell the tests what really reached the driver: pins, unpins,
 * registrations, unregistrations and the bytes pinned now (either way).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_OUT_OF_MEMORY = 2,
       CUDA_ERROR_NOT_FOUND = 500 };
#define LIVE 0x70696e6e6564ULL /* "pinned" */
#define DEAD 0x66726565ULL     /* "free" */

typedef struct { uint64_t magic, size; unsigned flags, pad; } header;
static long pins, unpins, bad_frees, registers, unregisters;
static uint64_t pinned_bytes;

typedef struct range { void* p; size_t size; struct range* next; } range;
static range* registered;
static pthread_mutex_t registered_lock = PTHREAD_MUTEX_INITIALIZER;

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

CUresult cuMemHostRegister(void* p, size_t size, unsigned int flags) {
  const char* fails = getenv("FAKE_CUDA_REGISTER_FAILS");
  if (fails && strcmp(fails, "1") == 0) return 801; /* CUDA_ERROR_NOT_SUPPORTED */
  if (!p || !size || (flags & ~0xfu)) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&registered_lock);
  for (range* r = registered; r; r = r->next) {
    if ((char*)p < (char*)r->p + r->size && (char*)r->p < (char*)p + size) {
      pthread_mutex_unlock(&registered_lock);
      return 712; /* CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED */
    }
  }
  range* r = malloc(sizeof *r);
  if (!r) { pthread_mutex_unlock(&registered_lock); return CUDA_ERROR_OUT_OF_MEMORY; }
  *r = (range){p, size, registered};
  registered = r;
  pthread_mutex_unlock(&registered_lock);
  __atomic_add_fetch(&registers, 1, __ATOMIC_RELAXED);
  __atomic_add_fetch(&pinned_bytes, size, __ATOMIC_RELAXED);
  return CUDA_SUCCESS;
}

CUresult cuMemHostUnregister(void* p) {
  pthread_mutex_lock(&registered_lock);
  for (range** at = &registered; *at; at = &(*at)->next) {
    if ((*at)->p == p) {
      range* r = *at;
      *at = r->next;
      pthread_mutex_unlock(&registered_lock);
      __atomic_add_fetch(&unregisters, 1, __ATOMIC_RELAXED);
      __atomic_sub_fetch(&pinned_bytes, r->size, __ATOMIC_RELAXED);
      free(r);
      return CUDA_SUCCESS;
    }
  }
  pthread_mutex_unlock(&registered_lock);
  __atomic_add_fetch(&bad_frees, 1, __ATOMIC_RELAXED);
  return CUDA_ERROR_INVALID_VALUE;
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
  if (strcmp(symbol, "cuMemHostRegister") == 0) return (void*)cuMemHostRegister;
  if (strcmp(symbol, "cuMemHostUnregister") == 0) return (void*)cuMemHostUnregister;
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

/* what: 0 pins, 1 unpins, 2 bytes pinned now, 3 frees of unknown or freed blocks,
 * 4 registrations, 5 unregistrations */
long fakeCudaCount(int what) {
  switch (what) {
    case 0: return pins;
    case 1: return unpins;
    case 2: return (long)pinned_bytes;
    case 4: return registers;
    case 5: return unregisters;
    default: return bad_frees;
  }
}
