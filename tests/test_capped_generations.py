"""The rollout-gain experiment's agent under Megatron's sequence packing, on CPU:
capped generations end with eod (tests/gpu/capped_generations.py says why), and
tests/gpu/megatron_rl_agent.py applies it only when Megatron packs. megatron.rl is
Megatron-LM's (not in megatron-core's wheel): a stand-in of the agent base it
extends, with the ``_rollout_from_episode`` seam it overrides, runs the agent's own
lines here."""

from __future__ import annotations

import asyncio
import importlib
import sys
import types

import pytest

from tests.gpu.capped_generations import end_capped_with_eod

EOD, CAP, BIN = 2, 8, 16


@pytest.mark.parametrize("turns, changed, last", [
    ([[5] * CAP], 1, EOD),  # stopped at the cap: ends with eod
    ([[5] * 5 + [EOD]], 0, EOD),  # ended on its own
    ([[5] * 5], 0, 5),  # shorter than the cap without eod: Megatron's check should see it
    ([[5] * BIN], 0, 5),  # a whole bin long: Megatron accepts it as truncated
    ([[5] * CAP, [5] * CAP], 0, 5),  # multi-turn: Megatron checks single-turn only
])
def test_only_a_single_turn_stopped_at_the_cap_gets_eod(turns, changed, last):
    before = [list(t) for t in turns]
    assert end_capped_with_eod(turns, CAP, BIN, EOD) == changed
    assert turns[0][-1] == last and turns[0][:-1] == before[0][:-1]


def test_without_packing_the_cap_is_the_sequence_and_nothing_changes():
    turns = [[5] * CAP]
    assert end_capped_with_eod(turns, CAP, CAP, EOD) == 0 and turns == [[5] * CAP]


@pytest.fixture
def agent_module(monkeypatch):
    """tests/gpu/megatron_rl_agent.py over stand-ins of megatron.rl's agent base and
    megatron.training's args and tokenizer."""
    base = types.ModuleType("megatron.rl.agent.reward_only_agent")

    class RewardOnlyAgent:
        async def _rollout_from_episode(self, request, episode, golden):
            return types.SimpleNamespace(trajectory=[list(t) for t in episode])

    base.RewardOnlyAgent = RewardOnlyAgent
    training = types.ModuleType("megatron.training")
    args = types.SimpleNamespace(rl_use_sequence_packing=True, inference_max_seq_length=CAP,
                                 seq_length=BIN)
    training.get_args = lambda: args
    training.get_tokenizer = lambda: types.SimpleNamespace(eod=EOD)
    for name, module in (("megatron.rl", types.ModuleType("megatron.rl")),
                         ("megatron.rl.agent", types.ModuleType("megatron.rl.agent")),
                         ("megatron.rl.agent.reward_only_agent", base),
                         ("megatron.training", training)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "tests.gpu.megatron_rl_agent", raising=False)
    module = importlib.import_module("tests.gpu.megatron_rl_agent")
    yield module, args, RewardOnlyAgent
    sys.modules.pop("tests.gpu.megatron_rl_agent", None)


def test_the_agent_ends_capped_generations_only_when_megatron_packs(agent_module):
    module, args, _ = agent_module
    agent = module.CountingAgent.__new__(module.CountingAgent)
    episode = [[5] * CAP]
    packed = asyncio.run(agent._rollout_from_episode(None, episode, golden={}))
    assert packed.trajectory == [[5] * (CAP - 1) + [EOD]]
    args.rl_use_sequence_packing = False
    plain = asyncio.run(agent._rollout_from_episode(None, episode, golden={}))
    assert plain.trajectory == [[5] * CAP]


def test_the_agent_refuses_a_megatron_without_its_seam(agent_module, monkeypatch):
    _, _, base = agent_module
    monkeypatch.delattr(base, "_rollout_from_episode")
    sys.modules.pop("tests.gpu.megatron_rl_agent", None)
    with pytest.raises(AssertionError, match="_rollout_from_episode"):
        importlib.import_module("tests.gpu.megatron_rl_agent")
