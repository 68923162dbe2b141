"""The vLLM setting the freed memory allows: plain arithmetic, checked."""

from types import SimpleNamespace

from amem_callbacks.headroom import freed_on_this_gpu, vllm_headroom

GiB = 2**30


def test_the_share_rises_by_the_freed_bytes_less_the_margin_rounded_down():
    h = vllm_headroom("vllm_gpu_memory_utilization", 0.6, int(8 * GiB), int(80 * GiB),
                      margin_bytes=GiB // 2)
    assert h.suggested == 0.6937  # 0.6 + 7.5 / 80 = 0.69375, rounded down to 1e-4
    assert "from 0.6 to 0.6937" in h.line()
    assert h.as_dict()["amem/headroom/gpu_memory_utilization"] == 0.6937


def test_one_ddp_communicator_can_raise_the_share_on_an_h200():
    """0.01 steps (1.4 GiB of 141 GiB) never let a single communicator's bytes through."""
    h = vllm_headroom("x", 0.3, int(1.2 * GiB), int(141 * GiB), margin_bytes=GiB // 2)
    assert 0.3 < h.suggested <= 0.3 + 0.7 / 141


def test_too_little_memory_or_a_full_gpu_never_lowers_or_exceeds_the_limits():
    assert vllm_headroom("x", 0.6, GiB // 4, 80 * GiB).suggested == 0.6
    assert "too small" in vllm_headroom("x", 0.6, GiB // 4, 80 * GiB).line()
    assert vllm_headroom("x", 0.95, 40 * GiB, 80 * GiB).suggested == 0.98
    assert vllm_headroom("x", 0.6, 8 * GiB, None) is None


def test_each_rank_counts_its_own_bytes_also_on_a_shared_gpu():
    """Two ranks on one GPU, each with its own vLLM engine: each may take what its
    own suspends freed, not the device-wide figure (that would count it twice)."""
    alone = SimpleNamespace(skipped=None, device_shared_by=1, device_freed_bytes=5, nccl_bytes=3)
    shared = SimpleNamespace(skipped=None, device_shared_by=2, device_freed_bytes=6, nccl_bytes=3)
    assert freed_on_this_gpu(alone) == 3 and freed_on_this_gpu(shared) == 3
    assert freed_on_this_gpu(SimpleNamespace(skipped="inert")) is None
