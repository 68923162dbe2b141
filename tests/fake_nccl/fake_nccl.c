/* A stand-in for libnccl.so.2 with the ABI of the functions amem_callbacks binds.
 *
 * Communicators are plain structs made by fakeCommCreate; suspend state, memory
 * stats, result codes and call counts behave like NCCL >= 2.29.7's (double
 * suspend and resume-while-active are ncclInvalidUsage). Build variants:
 *   default      NCCL 2.32.3 with ncclCommSuspend/Resume/MemStats
 *   -DNO_SUSPEND an older NCCL (2.28.9) without them
 *   -DAMEM       AMem's patched NCCL 2.27.5: ncclPause/ncclResume, process-wide
 *   -DRUNTIME    the default build plus a stand-in for NCCL's statically linked CUDA
 *                runtime and its pinned host backup (see "The runtime" below)
 * FAKE_NCCL_VERSION in the environment overrides the reported version.
 *
 * Peers: NCCL's suspend and resume wait for every member of the communicator (a
 * bootstrap barrier, src/mem_manager.cc). A fake communicator given its peers
 * (fakeCommSetPeers) waits too, through files in a folder its group's ranks share; a
 * peer that never comes ends the wait after FAKE_NCCL_PEER_WAIT_S seconds (60) with
 * ncclSystemError and peer_timed_out set, where NCCL would wait forever.
 *
 * Injected errors land where NCCL 2.30.7's own do (src/mem_manager.cc): a usage error
 * (ncclInvalidArgument, ncclInvalidUsage) before the members meet, as NCCL's checks do,
 * so the peers wait; any other error of a suspend after they met (the host backup or
 * its copy failed), leaving the communicator partly offloaded with no rollback: its
 * suspended flag stays 0, `partial` says so, and a resume refuses it; any error of a
 * resume before they meet (re-creating, mapping and copying back come first).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int ncclResult_t;
enum { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
       ncclInvalidArgument = 4, ncclInvalidUsage = 5 };

#ifndef FAKE_VERSION
#define FAKE_VERSION 23203
#endif
#ifndef FAKE_VERSION_STR
#define FAKE_VERSION_STR "2.32.3"
#endif
/* Library files carry this banner; amem_callbacks reads it without loading. */
const char fake_nccl_banner[] = "NCCL version " FAKE_VERSION_STR "+fake";

typedef struct fakeComm {
  uint64_t suspendable, persist;
  int suspended;
  int fail_op, fail_code, fail_times; /* inject: op 0 suspend, 1 resume */
  int partial; /* a suspend failed after the members met: partly offloaded, no rollback */
  int delay_us;
  int suspends, resumes;
  /* GIL probe: with gate set, a suspend waits (up to 20 s) for fakeCommOpenGate,
   * which only a Python thread can call. If the caller of ncclCommSuspend holds
   * the GIL, no Python thread can run, the wait runs out and gate_timed_out says so. */
  volatile int gate, gate_open, in_suspend, gate_timed_out;
  char peer_dir[512];
  int peer_rank, peer_count, peer_round; /* rounds: every member's suspends and resumes, in order */
  volatile int in_barrier, peer_timed_out;
  unsigned char* image;          /* RUNTIME: the communicator's "device" bytes */
  void** backup;                 /* RUNTIME: one pinned block per entry while suspended */
  int entries;
  size_t entry_bytes;
} fakeComm;

#ifdef RUNTIME
/* The runtime. NCCL links the CUDA runtime statically; that runtime reaches the
 * driver once, when the first communicator is made: dlopen("libcuda.so.1"), then
 * dlsym(handle, "cuGetProcAddress_v2") through this library's own PLT, then
 * cuGetProcAddress for cuGetProcAddress itself and for each entry point it uses.
 * Here the driver is the stand-in FAKE_NCCL_DRIVER names (fake_cuda.c). A
 * communicator given entries (fakeCommSetBackup) is then backed up on suspend as
 * NCCL 2.30.7's mem_manager.cc does it: per entry cudaHostAlloc(mapped), memset,
 * copy out, "release" the device bytes; resume copies back and cudaFreeHost's. */
#include <dlfcn.h>
typedef int (*gpa_fn)(const char*, void**, int, uint64_t, int*);
static int (*rt_host_alloc)(void**, size_t, unsigned int);
static int (*rt_free_host)(void*);
static int (*rt_ctx_current)(void**);
static int rt_state; /* 0 not yet, 1 ready, -1 failed */

static void runtime_init(void) {
  const char* path = getenv("FAKE_NCCL_DRIVER");
  if (rt_state || !path) return;
  rt_state = -1;
  void* driver = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!driver) return;
  gpa_fn first = (gpa_fn)dlsym(driver, "cuGetProcAddress_v2");
  gpa_fn gpa = NULL;
  int status = 0;
  if (!first || first("cuGetProcAddress", (void**)&gpa, 12080, 0, &status) || !gpa) return;
  if (gpa("cuMemHostAlloc", (void**)&rt_host_alloc, 12080, 0, &status) ||
      gpa("cuMemFreeHost", (void**)&rt_free_host, 12080, 0, &status) ||
      gpa("cuCtxGetCurrent", (void**)&rt_ctx_current, 12080, 0, &status)) return;
  rt_state = 1;
}

static ncclResult_t backup_out(fakeComm* c) {
  if (!c->entries) return ncclSuccess;
  if (rt_state != 1) return ncclUnhandledCudaError;
  for (int i = 0; i < c->entries; i++) {
    if (rt_host_alloc(&c->backup[i], c->entry_bytes, 0x02 /* CU_MEMHOSTALLOC_DEVICEMAP */))
      return ncclUnhandledCudaError;
    memset(c->backup[i], 0, c->entry_bytes); /* ncclCudaHostCalloc */
    memcpy(c->backup[i], c->image + (size_t)i * c->entry_bytes, c->entry_bytes);
  }
  memset(c->image, 0xEE, (size_t)c->entries * c->entry_bytes); /* the device bytes are gone */
  return ncclSuccess;
}

static ncclResult_t backup_in(fakeComm* c) {
  for (int i = 0; i < c->entries; i++) {
    memcpy(c->image + (size_t)i * c->entry_bytes, c->backup[i], c->entry_bytes);
    if (rt_free_host(c->backup[i])) return ncclUnhandledCudaError;
    c->backup[i] = NULL;
  }
  return ncclSuccess;
}

void fakeCommSetBackup(fakeComm* c, int entries, size_t entry_bytes) {
  c->entries = entries; c->entry_bytes = entry_bytes;
  c->image = calloc((size_t)entries, entry_bytes);
  c->backup = calloc((size_t)entries, sizeof(void*));
}
unsigned char* fakeCommImage(fakeComm* c) { return c->image; }
int fakeRuntimeState(void) { return rt_state; }
/* dlsym(RTLD_NEXT, name) from this library: the scope after it, i.e. its dependencies */
void* fakeNextLookup(const char* name) { return dlsym(RTLD_NEXT, name); }
#else
__attribute__((unused)) static ncclResult_t backup_out(fakeComm* c) { (void)c; return 0; }
__attribute__((unused)) static ncclResult_t backup_in(fakeComm* c) { (void)c; return 0; }
static void runtime_init(void) {}
#endif

ncclResult_t ncclGetVersion(int* version) {
  const char* env = getenv("FAKE_NCCL_VERSION");
  *version = env ? atoi(env) : FAKE_VERSION;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (fake)";
    case ncclSystemError: return "unhandled system error (fake)";
    case ncclInternalError: return "internal error (fake)";
    case ncclInvalidArgument: return "invalid argument (fake)";
    case ncclInvalidUsage: return "invalid usage (fake)";
    default: return "unknown result code (fake)";
  }
}

const char* ncclGetLastError(void* comm) { (void)comm; return "fake last error"; }

#ifndef NO_SUSPEND
static int injected(fakeComm* c, int op) {
  if (c->fail_times > 0 && c->fail_op == op) { c->fail_times--; return c->fail_code; }
  return ncclSuccess;
}

static int usage_error(int code) { return code == ncclInvalidArgument || code == ncclInvalidUsage; }

static int peers_arrived(fakeComm* c, int round) {
  char path[600];
  for (int r = 0; r < c->peer_count; r++) {
    snprintf(path, sizeof path, "%s/%d.%d", c->peer_dir, round, r);
    if (access(path, F_OK) != 0) return 0;
  }
  return 1;
}

static ncclResult_t peer_barrier(fakeComm* c) {
  if (c->peer_count <= 1) return ncclSuccess;
  int round = ++c->peer_round;
  char path[600];
  snprintf(path, sizeof path, "%s/%d.%d", c->peer_dir, round, c->peer_rank);
  FILE* mark = fopen(path, "w");
  if (!mark) return ncclSystemError;
  fclose(mark);
  const char* env = getenv("FAKE_NCCL_PEER_WAIT_S");
  long limit_ms = (long)((env ? atof(env) : 60.0) * 1000);
  c->in_barrier = 1;
  long waited_ms = 0;
  while (!peers_arrived(c, round) && waited_ms < limit_ms) { usleep(1000); waited_ms++; }
  c->in_barrier = 0;
  if (!peers_arrived(c, round)) { c->peer_timed_out = 1; return ncclSystemError; }
  return ncclSuccess;
}

ncclResult_t ncclCommSuspend(fakeComm* c, int flags) {
  if (!c || flags != 1) return ncclInvalidArgument;
  if (c->suspended && !(c->fail_times > 0 && c->fail_op == 0)) return ncclInvalidUsage;
  if (c->fail_times > 0 && c->fail_op == 0 && usage_error(c->fail_code)) return injected(c, 0);
  if (peer_barrier(c) != ncclSuccess) return ncclSystemError;
  ncclResult_t r = injected(c, 0);
  if (r != ncclSuccess) { c->partial = 1; return r; }
  if (c->suspended) return ncclInvalidUsage;
  c->in_suspend = 1;
  if (c->delay_us) usleep(c->delay_us);
  if (c->gate) {
    int waited_ms = 0;
    while (!c->gate_open && waited_ms < 20000) { usleep(1000); waited_ms++; }
    if (!c->gate_open) c->gate_timed_out = 1;
  }
  c->in_suspend = 0;
  if (backup_out(c) != ncclSuccess) { c->partial = 1; return ncclUnhandledCudaError; }
  c->suspended = 1; c->suspends++;
  return ncclSuccess;
}

ncclResult_t ncclCommResume(fakeComm* c) {
  if (!c) return ncclInvalidArgument;
  if (!c->suspended && !(c->fail_times > 0 && c->fail_op == 1)) return ncclInvalidUsage;
  ncclResult_t r = injected(c, 1);
  if (r != ncclSuccess) return r;
  if (!c->suspended) return ncclInvalidUsage;
  if (peer_barrier(c) != ncclSuccess) return ncclSystemError;
  if (c->delay_us) usleep(c->delay_us);
  if (backup_in(c) != ncclSuccess) return ncclUnhandledCudaError;
  c->suspended = 0; c->resumes++;
  return ncclSuccess;
}

ncclResult_t ncclCommMemStats(fakeComm* c, int stat, uint64_t* value) {
  if (!c || !value) return ncclInvalidArgument;
  switch (stat) {
    case 0: *value = c->suspendable; break;
    case 1: *value = (uint64_t)c->suspended; break;
    case 2: *value = c->persist; break;
    case 3: *value = c->suspendable + c->persist; break;
    default: return ncclInvalidArgument;
  }
  return ncclSuccess;
}
#endif

#ifdef AMEM
static int amem_paused, amem_group_id, amem_pauses, amem_resumes;
ncclResult_t ncclPause(void** comm) { (void)comm; amem_paused = 1; amem_pauses++; return ncclSuccess; }
ncclResult_t ncclResume(void** comm) { (void)comm; amem_paused = 0; amem_resumes++; return ncclSuccess; }
ncclResult_t ncclMemStats(void) { return ncclSuccess; }
ncclResult_t ncclSetGroupID(int id) { amem_group_id = id; return ncclSuccess; }
ncclResult_t ncclGetGroupID(int* id) { *id = amem_group_id; return ncclSuccess; }
int fakeAmemPaused(void) { return amem_paused; }
int fakeAmemCount(int op) { return op == 0 ? amem_pauses : amem_resumes; }
#endif

/* --- test controls ---------------------------------------------------- */
fakeComm* fakeCommCreate(uint64_t suspendable, uint64_t persist) {
  fakeComm* c = calloc(1, sizeof(fakeComm));
  runtime_init(); /* NCCL's runtime reaches the driver with the first communicator */
  c->suspendable = suspendable; c->persist = persist;
  return c;
}
void fakeCommInject(fakeComm* c, int op, int code, int times) {
  c->fail_op = op; c->fail_code = code; c->fail_times = times;
}
int fakeCommPartial(fakeComm* c) { return c->partial; }
void fakeCommSetDelayUs(fakeComm* c, int us) { c->delay_us = us; }
void fakeCommSetGate(fakeComm* c) { c->gate = 1; c->gate_open = 0; c->gate_timed_out = 0; }
void fakeCommOpenGate(fakeComm* c) { c->gate_open = 1; }
int fakeCommInSuspend(fakeComm* c) { return c->in_suspend; }
int fakeCommGateTimedOut(fakeComm* c) { return c->gate_timed_out; }
int fakeCommSuspended(fakeComm* c) { return c->suspended; }
int fakeCommCount(fakeComm* c, int op) { return op == 0 ? c->suspends : c->resumes; }
void fakeCommSetPeers(fakeComm* c, const char* dir, int rank, int count) {
  snprintf(c->peer_dir, sizeof c->peer_dir, "%s", dir);
  c->peer_rank = rank; c->peer_count = count; c->peer_round = 0;
}
int fakeCommInBarrier(fakeComm* c) { return c->in_barrier; }
int fakeCommPeerTimedOut(fakeComm* c) { return c->peer_timed_out; }
