"""The vLLM driver's forced short KV wake-up (tests/gpu/short_wake.py, --short-wake):
what it takes and when, and how the driver's spies record a wake-up the package
calls again after it ran out of memory (one generation, one barrier)."""

from __future__ import annotations

import argparse
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.gpu import common  # noqa: E402
from tests.gpu import short_wake as sw  # noqa: E402
from tests.gpu import trl_vllm_gpu as drv  # noqa: E402

GIB = 2**30


@pytest.mark.parametrize("text, expected", [("2:1", (2, 1)), ("5:0", (5, 0))])
def test_the_flag_reads_generation_and_rank(text, expected):
    assert sw.parse_short_wake(text) == expected


@pytest.mark.parametrize("text, says", [("2", "GENERATION:RANK"), ("a:b", "e.g. 2:1"),
                                        ("1:0", "at least 2"), ("2:-1", "rank at least 0")])
def test_a_bad_flag_says_what_to_write(text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        sw.parse_short_wake(text)


def test_the_run_command_refuses_a_bad_flag_at_start_up(capsys):
    with pytest.raises(SystemExit):
        drv.main(["run", "/tmp/never", "--short-wake", "1:0"])
    assert "must be at least 2" in capsys.readouterr().err


def test_the_gpu_taker_holds_an_allocation_until_release(monkeypatch):
    """Its lines, on CPU memory: on a GPU the same allocation is on "cuda:N"."""
    import gc
    import weakref

    import torch

    made, real_empty = [], torch.empty
    monkeypatch.setattr(torch, "empty",
                        lambda *a, **k: made.append(real_empty(*a, **k)) or made[-1])
    release = sw.device_taker("cpu")(1 << 20)
    tensor = weakref.ref(made.pop())
    assert tensor() is not None and tensor().numel() == 1 << 20
    release()
    gc.collect()
    assert tensor() is None  # nothing holds it once released


def short(at=(2, 1), rank=1, skipped=True, need=GIB, ranks_on_gpu=2):
    ledger = []
    wake = sw.ShortWake(at, rank, ranks_on_gpu, sw.stand_in_taker(ledger), lambda: skipped,
                        lambda tags: need)
    return wake, ledger


def test_it_takes_what_leaves_every_ranks_wake_up_short_then_gives_it_back():
    wake, ledger = short()
    free = 5 * GIB
    record = wake.before_wake(2, ["kv_cache"], free)
    # two ranks' 1 GiB wake-ups find 2 GiB - 256 MiB
    assert record["taken_bytes"] == free - 2 * GIB + sw.SHORT_BY == ledger[0]
    assert free - ledger[0] == 2 * GIB - sw.SHORT_BY
    assert wake.after_wake() and ledger == [ledger[0], -ledger[0]]
    assert not wake.after_wake()  # given back once


@pytest.mark.parametrize("generation, rank", [(3, 1), (2, 0)])
def test_only_the_named_generation_and_rank_take(generation, rank):
    wake, ledger = short(rank=rank)
    assert wake.before_wake(generation, ["kv_cache"], 5 * GIB) is None
    assert not ledger and not wake.after_wake()


@pytest.mark.parametrize("skipped, need, free, why", [
    (False, GIB, 5 * GIB, "the begin ran"),
    (True, None, 5 * GIB, "unknown"),
    (True, GIB, None, "unknown"),
    (True, 3 * GIB, 5 * GIB, "short already")])
def test_nothing_is_taken_where_the_begin_ran_or_nothing_is_known(skipped, need, free, why):
    wake, ledger = short(skipped=skipped, need=need)
    record = wake.before_wake(2, ["kv_cache"], free)
    assert record["taken_bytes"] == 0 and why in record["why_not"] and not ledger


def test_the_driver_builds_it_only_when_asked(monkeypatch):
    monkeypatch.setattr(common, "ON_CPU", True)
    args = types.SimpleNamespace(short_wake=None)
    assert drv.forced_short_wake(args, 1, 2, 0, None, {}) is None
    args.short_wake = (2, 1)
    out = {}
    session = types.SimpleNamespace(active=False)  # the begin was skipped
    wake = drv.forced_short_wake(args, 1, 2, 0, types.SimpleNamespace(session=session), out)
    assert wake.here and wake.ranks_on_gpu == 2 and wake._begin_skipped()
    session.active = True
    assert not wake._begin_skipped()
    assert not drv.forced_short_wake(args, 1, 2, 0, None, out)._begin_skipped()
    assert out["short_wake_ledger"] == []  # the CPU mode's ledger lands in the rank JSON
    monkeypatch.setattr(common, "ON_CPU", False)  # on a GPU: a torch allocation, not built yet
    assert drv.forced_short_wake(args, 1, 2, 0, None, {})._take.__qualname__.startswith(
        "device_taker")


class FakeLLM:
    """vLLM's colocated engine as the spies see it: its KV wake-up runs out of memory
    while more than ``room`` bytes are taken."""

    def __init__(self, ledger, room):
        self.ledger, self.room, self.calls = ledger, room, []

    def wake_up(self, tags=None):
        self.calls.append(list(tags or []))
        if "kv_cache" in (tags or []) and sum(self.ledger) > self.room:
            raise RuntimeError("CUDA Error: out of memory at "
                               "/workspace/csrc/cumem_allocator.cpp:163")

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        out = types.SimpleNamespace(token_ids=[1, 2, 3])
        return [types.SimpleNamespace(outputs=[out])]

    def sleep(self, level=1):
        pass


def test_the_spies_count_a_retried_wake_up_as_one_generation_with_one_barrier(monkeypatch):
    monkeypatch.setattr(drv, "torch_reserved", lambda start_peak_window=False: 0)
    monkeypatch.setattr(drv, "torch_reserved_peak", lambda: 0)
    ledger = []
    llm = FakeLLM(ledger, room=0)
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(global_step=16),
                                    vllm_generation=types.SimpleNamespace(
                                        llm=llm, sync_weights=lambda: None))
    wake = sw.ShortWake((2, 0), 0, 2, sw.stand_in_taker(ledger), lambda: True,
                        lambda tags: GIB)
    barriers = []
    rec = drv.Recorder(lambda: 4 * GIB)
    drv.spy(trainer, rec, lambda: barriers.append(len(rec.generations)), synced_sleep=True,
            memory_now=lambda: 4 * GIB, short_wake=wake)
    spied = llm.wake_up  # what the package wraps; it calls again where the first ran short

    def package_wake(tags):
        try:
            return spied(tags=tags)
        except RuntimeError as error:
            assert "out of memory" in str(error)
            ledger.append(-sum(ledger))  # the suspends free what was lacking
            return spied(tags=tags)

    for _ in range(2):
        package_wake(["weights"])
        package_wake(["kv_cache"])
        llm.generate([{"prompt_token_ids": [1]}])
        llm.sleep(level=1)
    assert len(rec.generations) == 2
    assert barriers == [1, 1, 2, 2]  # each generation's wake-up and sleep, never the retry
    first, second = rec.generations
    assert "short_wake" not in first and "kv_wake_failures" not in first
    assert second["short_wake"]["taken_bytes"] == 4 * GIB - 2 * GIB + sw.SHORT_BY
    assert second["short_wake"]["released_after_attempts"] == 2
    assert second["kv_wake_failures"][0].startswith("RuntimeError: CUDA Error: out of memory")
    assert "wake_kv_s" not in second and second["wake_kv_retry_s"] >= 0
    assert [e["what"] for e in rec.events].count("wake_up retry") == 1


def test_a_wake_up_that_fails_for_good_is_raised_and_recorded(monkeypatch):
    monkeypatch.setattr(drv, "torch_reserved", lambda start_peak_window=False: 0)
    ledger = [1]
    llm = FakeLLM(ledger, room=0)
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(global_step=0),
                                    vllm_generation=types.SimpleNamespace(
                                        llm=llm, sync_weights=lambda: None))
    rec = drv.Recorder(lambda: 0)
    drv.spy(trainer, rec, lambda: None, synced_sleep=False, memory_now=lambda: 0)
    with pytest.raises(RuntimeError, match="out of memory"):
        llm.wake_up(tags=["kv_cache"])
    assert len(rec.generations) == 1 and len(rec.generations[0]["kv_wake_failures"]) == 1


def test_a_series_set_on_one_card_fills_a_larger_one_the_same_way():
    from tests.gpu.vllm_series_scale import scaled

    h100, h200 = 85017493504, 150109749248
    flags = scaled(["--share", "0.027", "--amem", "--ballast-gib", "29.476", "--short-wake",
                    "2:1"], h100, h200)
    share, ballast = float(flags[1]), float(flags[4])
    assert abs(share * h200 - 0.027 * h100) < 1e-6 * h200  # vLLM's budget: the same bytes
    # what is left beside vLLM and the ballasts: the same bytes on both cards
    assert abs((h200 - 2 * ballast * GIB) - (h100 - 2 * 29.476 * GIB)) < 0.01 * GIB
    assert flags[2:4] == ["--amem", "--ballast-gib"] and flags[5:] == ["--short-wake", "2:1"]
    assert scaled(["--share", "0.027"], h100, h100) == ["--share", "0.027000"]
