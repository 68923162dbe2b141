import os

import pytest

from tests.fake_nccl import VARIANTS, build


@pytest.fixture(scope="session", autouse=True)
def fake_nccl_dir(tmp_path_factory):
    """Build every fake NCCL variant once; rank subprocesses find them via the env."""
    path = str(tmp_path_factory.mktemp("fake-nccl"))
    for variant in VARIANTS:
        build(variant, path)
    os.environ["AMEM_FAKE_NCCL_DIR"] = path
    return path


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA sees a GPU (the device machine); one is enough."""
    _group_by_module(items)
    if not any("gpu" in item.keywords for item in items):
        return
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    if gpus >= 1:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --- spreading the suite over worker processes where pytest-xdist is installed ---------
#: modules whose tests may reach the GPU of a GPU host (the real-NCCL suite; the
#: doctor's one-rank probe): they share one worker, so no two of them run at once
#: and the GPU suite's free-memory readings see only its own ranks
DEVICE_MODULES = ("test_gpu.py", "test_cli.py")
WORKERS_ENV = "AMEM_TEST_WORKERS"


def auto_workers(asked: str = None) -> int:
    """Worker processes asked for with ``AMEM_TEST_WORKERS`` (unset: none).

    Not on by default: on the GPU machine (Firecracker, 16 cores) four workers
    made thread creation fail at their start ("can't start new thread" in
    execnet, OpenBLAS's pthread_create EAGAIN) and xdist re-spawned them in a
    loop; the serial suite runs there."""
    if asked in (None, ""):
        return 0
    workers = int(asked)
    if workers < 0:
        raise ValueError(f"{WORKERS_ENV}={asked!r}: write a count >= 0 (0: no workers)")
    return workers


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """``AMEM_TEST_WORKERS=N python -m pytest`` spreads the suite over N
    pytest-xdist workers, each module on one worker (its multi-rank scenarios
    are cached per process) and the device modules together. Runs before
    xdist's own hook, which turns the count into its workers; ``-n N`` or
    ``-p no:xdist`` on the command line win."""
    if not config.pluginmanager.hasplugin("xdist") or config.option.numprocesses is not None:
        return None
    if config.getoption("collectonly") or config.getoption("usepdb", False):
        return None
    workers = auto_workers(os.environ.get(WORKERS_ENV))
    if workers:
        config.option.numprocesses = workers
        config.option.dist = "loadgroup"
    return None


def _group_by_module(items) -> None:
    """Under xdist's loadgroup: one group per module, the device modules in one."""
    for item in items:
        module = os.path.basename(str(item.fspath))
        group = "device" if module in DEVICE_MODULES else module
        item.add_marker(pytest.mark.xdist_group(group))
