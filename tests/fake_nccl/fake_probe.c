/* Loaded as a dependency of the stand-in NCCL's runtime build only: its symbol is
 * what dlsym(RTLD_NEXT, ...) from that NCCL finds, and from no other caller. */
int fake_probe_symbol = 42;
