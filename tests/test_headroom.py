"""The vLLM setting the freed memory allows: plain arithmetic, checked."""

from types import SimpleNamespace

from amem_callbacks.headroom import freed_on_this_gpu, vllm_headroom

GiB = 2**30


def test_the_share_rises_by_the_freed_bytes_less_the_margin_rounded_down():
    h = vllm_headroom("vllm_gpu_memory_utilization", 0.6, int(8 * GiB), int(80 * GiB),
                      margin_bytes=GiB // 2)
    assert h.suggested == 0.69  # 0.6 + 7.5 / 80 = 0.69375
    assert "from 0.6 to 0.69" in h.line()
    assert h.as_dict()["amem/headroom/gpu_memory_utilization"] == 0.69


def test_too_little_memory_or_a_full_gpu_never_lowers_or_exceeds_the_limits():
    assert vllm_headroom("x", 0.6, GiB // 4, 80 * GiB).suggested == 0.6
    assert "too small" in vllm_headroom("x", 0.6, GiB // 4, 80 * GiB).line()
    assert vllm_headroom("x", 0.95, 40 * GiB, 80 * GiB).suggested == 0.98
    assert vllm_headroom("x", 0.6, 8 * GiB, None) is None


def test_a_shared_gpu_counts_the_device_wide_reading():
    alone = SimpleNamespace(skipped=None, device_shared_by=1, device_freed_bytes=5, nccl_bytes=3)
    shared = SimpleNamespace(skipped=None, device_shared_by=2, device_freed_bytes=5, nccl_bytes=3)
    assert freed_on_this_gpu(alone) == 3 and freed_on_this_gpu(shared) == 5
    assert freed_on_this_gpu(SimpleNamespace(skipped="inert")) is None
