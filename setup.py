"""Builds the host-backup hook (amem_callbacks/csrc): plain C, no CUDA headers.

Everything else is in pyproject.toml. The extension is optional: without a C
compiler the package installs and runs as before, with the backup re-pinned on
every suspend, and ``amem-callbacks doctor`` says why.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "amem_callbacks._host_backup",
    sources=["amem_callbacks/csrc/lookup_hook.c", "amem_callbacks/csrc/backup_pool.c"],
    depends=["amem_callbacks/csrc/host_backup.h"],
    libraries=["dl", "pthread"],
    # hidden by default: only the amem_hb_* entry points are exported; -O2 makes the
    # dlsym pass-through a tail call (lookup_hook.c says why that matters)
    extra_compile_args=["-O2", "-fvisibility=hidden", "-foptimize-sibling-calls",
                        "-fno-stack-protector", "-Wall", "-Werror"],
    optional=True,
    # no Python API is used (loaded with ctypes): one file serves every CPython 3
    py_limited_api=True,
)])
