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


H100 = 85017493504  # one H100 80GB HBM3's total, as torch reads it
FREED = 1207959552  # what one rank's world group freed there (TRL 1.16 + vLLM 0.31)


def test_the_free_memory_at_the_rollouts_fullest_bounds_the_raise():
    """results/one_h100/trl_vllm_colocate: at 0.0417 (past what fits without the
    package) NCCL still frees 1.125 GiB a rank, but 0.64 GiB stay free a rank: the
    freed bytes alone said 0.0495, what stays free says 0.0434."""
    alone = vllm_headroom("x", 0.0417, FREED, H100)
    assert alone.suggested == 0.0495 and not alone.limited_by_room
    bounded = vllm_headroom("x", 0.0417, FREED, H100, room_bytes=int(0.64 * GiB))
    assert bounded.suggested == 0.0434 and bounded.limited_by_room
    assert "no further: 0.64 GiB stay free" in bounded.line()
    assert bounded.as_dict()["amem/headroom/room_bytes"] == int(0.64 * GiB)
    # more room than was freed: the freed bytes bound it, as before
    assert vllm_headroom("x", 0.0339, FREED, H100, room_bytes=int(1.5 * GiB)).suggested == 0.0417
    # nothing left beyond the margin: keep the share, and say so
    full = vllm_headroom("x", 0.0495, FREED, H100, room_bytes=GiB // 4)
    assert full.suggested == 0.0495 and "do not raise it" in full.line()
    assert vllm_headroom("x", 0.0495, FREED, H100, room_bytes=-5).room_bytes == 0


def session_telling(monkeypatch):
    from amem_callbacks import OffloadPolicy, RolloutSession
    import amem_callbacks.headroom as headroom_module

    monkeypatch.setattr(headroom_module, "gpu_total_bytes", lambda device=None: H100)
    return RolloutSession(OffloadPolicy(backend="noop"))


def test_a_later_rollout_that_leaves_less_free_revises_the_line_down(monkeypatch, caplog):
    """The first rollout runs before the optimizer's state exists (2.52 GiB free a
    rank there, 0.64 from the second on): the line follows the lower figure, and
    never rises again."""
    import logging

    session = session_telling(monkeypatch)
    begin = SimpleNamespace(skipped=None, nccl_bytes=FREED)
    with caplog.at_level(logging.INFO, logger="amem_callbacks"):
        session.tell_headroom("x", 0.0417, begin, free_at_fullest=int(2.52 * GiB))
        assert session.headroom.suggested == 0.0495
        session.tell_headroom("x", 0.0417, begin, free_at_fullest=int(0.64 * GiB))
        assert session.headroom.suggested == 0.0434
        session.tell_headroom("x", 0.0417, begin, free_at_fullest=int(3 * GiB))
        assert session.headroom.suggested == 0.0434
    told = [r.getMessage() for r in caplog.records if "headroom" in r.getMessage()]
    assert len(told) == 2 and "revised at a later rollout" in told[1]


def test_a_rollout_whose_begin_was_skipped_tells_nothing_new(monkeypatch):
    """Skipped: every rank had room for what it allocated with its groups still
    allocated, so no reading of it can lower the line."""
    session = session_telling(monkeypatch)
    skipped = SimpleNamespace(skipped="not needed: every rank's next allocation fits in the "
                                      "free memory", nccl_bytes=FREED)
    session.tell_headroom("x", 0.0261, skipped, free_at_fullest=GiB)
    assert session.headroom is None
    session.tell_headroom("x", 0.0261, SimpleNamespace(skipped=None, nccl_bytes=FREED))
    assert session.headroom.suggested == 0.0339
    session.tell_headroom("x", 0.0261, skipped, free_at_fullest=0)
    assert session.headroom.suggested == 0.0339
