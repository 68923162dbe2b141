"""Faults, bad set-ups and long runs on CPU ranks: nothing lost, no hang."""

import pytest

from tests.harness import run_ranks

MiB = 2**20


def _cuda_torch() -> bool:
    import torch

    return torch.version.cuda is not None


def results(scenario, world=2, expect_ok=True, **args):
    return [r.get("result") for r in run_ranks(f"tests.scenarios_reliability:{scenario}",
                                               world=world, args=args, expect_ok=expect_ok)]


def test_a_dead_peer_turns_into_a_timeout_naming_the_groups():
    survivor = results("rank_dies", expect_ok=False, timeout_s=2)[0]
    message = survivor["error_message"]
    assert message and "did not finish within 2 s" in message
    assert "Groups not finished on this rank: ['world'" in message
    assert survivor["took"] < 2 + 2 * 2 + 5  # the timeout, bounded waits for the peer, slack


def test_two_hundred_cycles_leave_memory_threads_and_store_flat():
    for res in results("cycles_flat", cycles=200, warmup=20):
        early, late = res["samples"]["20"], res["samples"]["200"]
        assert late["threads"] == early["threads"]
        # each cycle writes ~20 keys; only the last two rounds may remain
        assert late["store_keys"] <= early["store_keys"] + 16, "agreement keys must not pile up"
        assert late["rss"] - early["rss"] <= 0.01 * early["rss"]
        assert res["exact"] and res["counters"]["amem/total/begins"] == 200


def test_ddp_training_is_bit_identical_with_and_without_offload():
    for res in results("ddp_identical", steps=8):
        assert res["losses_equal"] and res["params_equal"] and res["suspends"] > 0


@pytest.mark.parametrize("case, words", [
    ("old_nccl", ["needs NCCL >= 2.29.7", "pip install -U 'nvidia-nccl-cu"]),
    ("cumem_off", ["NCCL_CUMEM_ENABLE=0", "unset NCCL_CUMEM_ENABLE"]),
    ("amem_missing", ["is not AMem's", "LD_LIBRARY_PATH"]),
    ("amem_wrong_path", ["/nonexistent/amem/libnccl.so.2", "is not the NCCL torch loaded"]),
    pytest.param("auto_cpu", ["no NCCL library is loaded", "pip install"], marks=pytest.mark.skipif(
        _cuda_torch(), reason="a CUDA torch loads NCCL on import: 'auto' is not inert there")),
])
def test_an_unusable_backend_says_why_once_and_training_is_unchanged(case, words):
    for res in results("unusable", case=case):
        assert res["inert"] and res["skipped"] and res["exact"]
        assert len(res["warnings"]) == 1, res["warnings"]
        assert "training runs unchanged" in res["warnings"][0]
        for word in words:
            assert word in res["warnings"][0]


def test_host_memory_cap_keeps_groups_past_it_active_and_reports_bytes():
    for res in results("host_cap"):
        groups = res["begin"]["groups"]
        suspended = [n for n, (action, _r, _e) in groups.items() if action == "suspended"]
        assert len(suspended) == 2, groups
        capped = [n for n, (action, reason, _e) in groups.items() if "host memory cap" in reason]
        assert len(capped) == 2
        assert all(res["bytes"][n] == 480 * MiB for n in suspended)
        assert sum(res["during"].values()) == 2 and res["exact"]
