/* Answers the driver look-ups of the CUDA runtime linked into libnccl.
 *
 * libnccl's runtime finds the driver with dlsym(libcuda, "cuGetProcAddress*")
 * through libnccl's own PLT, then asks cuGetProcAddress for every entry point.
 * amem_hb_install rewrites libnccl's GOT slots of dlsym/dlvsym (and of nothing
 * else, in no other library) to point here; the answers pass every look-up
 * through unchanged except cuGetProcAddress itself, whose answer is wrapped so
 * that the runtime's request for cuMemHostAlloc/cuMemFreeHost gets the pool's
 * (backup_pool.c). HAMi-core answers look-ups the same way, from LD_PRELOAD;
 * rewriting one library's slots needs no preload and leaves torch's own runtime
 * and every other library's dlsym as they were.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "host_backup.h"

#if defined(__x86_64__)
#define JUMP_SLOT R_X86_64_JUMP_SLOT
#define GLOB_DAT R_X86_64_GLOB_DAT
#elif defined(__aarch64__)
#define JUMP_SLOT R_AARCH64_JUMP_SLOT
#define GLOB_DAT R_AARCH64_GLOB_DAT
#else
#define AMEM_HB_UNSUPPORTED 1
#endif

typedef CUresult (*gpa_v1_fn)(const char*, void**, int, uint64_t);
typedef CUresult (*gpa_v2_fn)(const char*, void**, int, uint64_t, void*);

volatile uint64_t amem_hb_lookups, amem_hb_unknown;
static gpa_v1_fn real_gpa_v1;
static gpa_v2_fn real_gpa_v2;
static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;
static char installed_path[4096];

static CUresult answer_gpa_v1(const char* symbol, void** pfn, int version, uint64_t flags);
static CUresult answer_gpa_v2(const char* symbol, void** pfn, int version, uint64_t flags,
                              void* status);

/* What the runtime should call for `real`, the driver's `symbol`: ours for
 * cuGetProcAddress itself (its later look-ups must come here too) and for the
 * pool's two functions; the driver's own for everything else. */
static void* answer_for(const char* symbol, void* real) {
  if (!real || !symbol) return real;
  if (strncmp(symbol, "cuGetProcAddress", 16) == 0) {
    __atomic_add_fetch(&amem_hb_lookups, 1, __ATOMIC_RELAXED);
    if (real == (void*)real_gpa_v2) return (void*)answer_gpa_v2;
    if (real == (void*)real_gpa_v1) return (void*)answer_gpa_v1;
    __atomic_add_fetch(&amem_hb_unknown, 1, __ATOMIC_RELAXED);  /* an ABI we do not know */
    return real;
  }
  return amem_hb_substitute(symbol, real);
}

static CUresult answer_gpa_v1(const char* symbol, void** pfn, int version, uint64_t flags) {
  CUresult result = real_gpa_v1(symbol, pfn, version, flags);
  if (result == 0 && pfn) *pfn = answer_for(symbol, *pfn);
  return result;
}

static CUresult answer_gpa_v2(const char* symbol, void** pfn, int version, uint64_t flags,
                              void* status) {
  CUresult result = real_gpa_v2(symbol, pfn, version, flags, status);
  if (result == 0 && pfn) *pfn = answer_for(symbol, *pfn);
  return result;
}

/* Both cuGetProcAddress ABIs of the driver `handle` names, so that whichever the
 * runtime asks for first, the other is recognised when it is handed out. */
static void learn_driver(void* handle) {
  if (!real_gpa_v1) real_gpa_v1 = (gpa_v1_fn)dlsym(handle, "cuGetProcAddress");
  if (!real_gpa_v2) real_gpa_v2 = (gpa_v2_fn)dlsym(handle, "cuGetProcAddress_v2");
}

/* The driver's own entry point `symbol` (CUDA 12's ABI), asked of the same
 * cuGetProcAddress NCCL's runtime reached: not passed through answer_for. */
void* amem_hb_driver_entry(const char* symbol) {
  void* pfn = NULL;
  int status = 0;
  if (real_gpa_v2) {
    if (real_gpa_v2(symbol, &pfn, 12000, 0, &status) != 0) pfn = NULL;
  } else if (real_gpa_v1) {
    if (real_gpa_v1(symbol, &pfn, 12000, 0) != 0) pfn = NULL;
  }
  return pfn;
}

static int is_driver_lookup(void* handle, const char* name) {
  /* RTLD_DEFAULT/RTLD_NEXT depend on who calls; the runtime names libcuda's handle */
  return name && handle != RTLD_DEFAULT && handle != RTLD_NEXT &&
         (strncmp(name, "cuGetProcAddress", 16) == 0 || strcmp(name, "cuMemHostAlloc") == 0 ||
          strcmp(name, "cuMemFreeHost") == 0);
}

__attribute__((noinline)) static void* answer_driver(void* handle, const char* name,
                                                     const char* version) {
  void* real = version ? dlvsym(handle, name, version) : dlsym(handle, name);
  if (real && strncmp(name, "cuGetProcAddress", 16) == 0) learn_driver(handle);
  return answer_for(name, real);
}

/* The pass-through must be a tail call: glibc's dlsym finds its caller from the
 * return address (RTLD_NEXT, RTLD_DEFAULT scopes), which must stay libnccl's. */
static void* answer_dlsym(void* handle, const char* name) {
  if (is_driver_lookup(handle, name)) return answer_driver(handle, name, NULL);
  return dlsym(handle, name);
}

static void* answer_dlvsym(void* handle, const char* name, const char* version) {
  if (is_driver_lookup(handle, name)) return answer_driver(handle, name, version);
  return dlvsym(handle, name, version);
}

/* --- finding libnccl's slots ---------------------------------------------- */
struct object {
  ElfW(Addr) base;
  const ElfW(Phdr) * phdr;
  ElfW(Half) phnum;
  uintptr_t low, high;           /* its mapped range */
  uintptr_t relro_low, relro_high;
  int found;
};

static int find_object(struct dl_phdr_info* info, size_t size, void* data) {
  (void)size;
  struct object* o = data;
  if (info->dlpi_addr != o->base) return 0;
  o->phdr = info->dlpi_phdr;
  o->phnum = info->dlpi_phnum;
  o->low = UINTPTR_MAX;
  for (ElfW(Half) i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr)* p = &info->dlpi_phdr[i];
    uintptr_t start = info->dlpi_addr + p->p_vaddr, end = start + p->p_memsz;
    if (p->p_type == PT_LOAD) {
      if (start < o->low) o->low = start;
      if (end > o->high) o->high = end;
    } else if (p->p_type == PT_GNU_RELRO) {
      o->relro_low = start;
      o->relro_high = end;
    }
  }
  o->found = 1;
  return 1;
}

static uintptr_t dyn_address(ElfW(Addr) base, ElfW(Addr) value) {
  /* glibc relocates these entries in place on most targets, not on all */
  return value < base ? base + value : value;
}

#define MAX_SLOTS 16
struct slots {
  void** at[MAX_SLOTS];
  void* answer[MAX_SLOTS];
  int count, lookups, unhandled;
};

static void collect(struct slots* s, const struct object* o, const ElfW(Rela) * rela, size_t n,
                    const ElfW(Sym) * symtab, const char* strtab, int skip_zeroing) {
  for (size_t i = 0; i < n; i++) {
    const char* name = strtab + symtab[ELF64_R_SYM(rela[i].r_info)].st_name;
    int dlsym_ = strcmp(name, "dlsym") == 0, dlvsym_ = strcmp(name, "dlvsym") == 0;
    int memset_ = skip_zeroing && strcmp(name, "memset") == 0;
    if (!dlsym_ && !dlvsym_ && !memset_) continue;
    if (memset_ && ELF64_R_TYPE(rela[i].r_info) != JUMP_SLOT) continue; /* left as it is */
    unsigned type = ELF64_R_TYPE(rela[i].r_info);
    if (type != JUMP_SLOT || s->count == MAX_SLOTS) {
      s->unhandled++; /* its address taken (GLOB_DAT): a call we cannot tell apart */
      continue;
    }
    /* Bound or not says nothing of the runtime: a library loaded with RTLD_NOW (as
     * Python loads torch) has every slot bound before any call. */
    s->at[s->count] = (void**)(o->base + rela[i].r_offset);
    s->answer[s->count] = dlsym_ ? (void*)answer_dlsym
                          : dlvsym_ ? (void*)answer_dlvsym : (void*)amem_hb_memset;
    s->lookups += !memset_;
    s->count++;
  }
}

static int write_slot(const struct object* o, void** slot, void* value) {
  uintptr_t at = (uintptr_t)slot;
  int relro = at >= o->relro_low && at < o->relro_high;
  long page = sysconf(_SC_PAGESIZE);
  void* start = (void*)(at & ~(uintptr_t)(page - 1));
  if (relro && mprotect(start, (size_t)page, PROT_READ | PROT_WRITE) != 0) return -1;
  __atomic_store_n(slot, value, __ATOMIC_SEQ_CST);
  if (relro) mprotect(start, (size_t)page, PROT_READ);
  return 0;
}

static int refuse(char* why, size_t n, int code, const char* text, const char* path) {
  if (why && n) snprintf(why, n, text, path);
  return code;
}

/* Point the dlsym/dlvsym slots of the loaded library `path` at the answers (and
 * with `skip_zeroing` its memset slot at amem_hb_memset).
 * 0: installed (or already); <0: refused, nothing written, `why` says why. Its
 * runtime takes the pool's functions only if it reaches the driver after this. */
AMEM_EXPORT int amem_hb_install(const char* path, int skip_zeroing, char* why, size_t why_len) {
#ifdef AMEM_HB_UNSUPPORTED
  return refuse(why, why_len, -1, "this CPU architecture is not supported (x86_64, aarch64)", path);
#else
  pthread_mutex_lock(&install_lock);
  int code = 0;
  if (installed_path[0]) {
    code = strcmp(installed_path, path) == 0 ? 0
           : refuse(why, why_len, -2, "the hook is installed on another NCCL already", path);
    pthread_mutex_unlock(&install_lock);
    return code;
  }
  void* handle = dlopen(path, RTLD_NOLOAD | RTLD_LAZY);
  struct link_map* map = NULL;
  if (!handle || dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || !map) {
    if (handle) dlclose(handle);
    pthread_mutex_unlock(&install_lock);
    return refuse(why, why_len, -3, "%s is not loaded in this process", path);
  }
  struct object o = {.base = map->l_addr};
  dl_iterate_phdr(find_object, &o);
  const ElfW(Rela)* jmprel = NULL;
  const ElfW(Rela)* rela = NULL;
  const ElfW(Sym)* symtab = NULL;
  const char* strtab = NULL;
  size_t jmprel_size = 0, rela_size = 0;
  long pltrel = DT_RELA;
  for (const ElfW(Dyn)* d = map->l_ld; d && d->d_tag != DT_NULL; d++) {
    switch (d->d_tag) {
      case DT_JMPREL: jmprel = (const void*)dyn_address(o.base, d->d_un.d_ptr); break;
      case DT_PLTRELSZ: jmprel_size = d->d_un.d_val; break;
      case DT_PLTREL: pltrel = (long)d->d_un.d_val; break;
      case DT_RELA: rela = (const void*)dyn_address(o.base, d->d_un.d_ptr); break;
      case DT_RELASZ: rela_size = d->d_un.d_val; break;
      case DT_SYMTAB: symtab = (const void*)dyn_address(o.base, d->d_un.d_ptr); break;
      case DT_STRTAB: strtab = (const void*)dyn_address(o.base, d->d_un.d_ptr); break;
    }
  }
  dlclose(handle);
  struct slots s = {0};
  if (!o.found || !symtab || !strtab || pltrel != DT_RELA) {
    code = refuse(why, why_len, -4, "%s: its dynamic section is not one this hook reads", path);
  } else {
    if (jmprel)
      collect(&s, &o, jmprel, jmprel_size / sizeof(ElfW(Rela)), symtab, strtab, skip_zeroing);
    if (rela) collect(&s, &o, rela, rela_size / sizeof(ElfW(Rela)), symtab, strtab, skip_zeroing);
    if (s.unhandled)
      code = refuse(why, why_len, -5, "%s takes dlsym's address (not a lazy call): not hooked", path);
    else if (!s.lookups)
      code = refuse(why, why_len, -6, "%s imports no dlsym: its CUDA runtime finds the driver "
                    "another way", path);
  }
  if (code == 0) {
    for (int i = 0; i < s.count; i++) {
      if (write_slot(&o, s.at[i], s.answer[i]) != 0) {
        code = refuse(why, why_len, -7, "%s: a slot could not be made writable", path);
        break; /* the ones written only pass look-ups through until the runtime asks */
      }
    }
  }
  if (code == 0) snprintf(installed_path, sizeof installed_path, "%s", path);
  pthread_mutex_unlock(&install_lock);
  return code;
#endif
}
