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
