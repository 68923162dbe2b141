"""A reward-only agent for Megatron-LM's RL loop in the GPU test (no dataset, no download).

The wrapper ``megatron_rl_gpu.py`` registers it in Megatron's agent allowlist
as ``AmemCountingAgent``. Prompts cycle through a fixed list in call order, so
every run asks the same questions; the reward is 1 when the answer's digit
appears in the response, which a tiny random model hits now and then: the
rewards vary, so GRPO's advantages (and its loss) are not all zero.

With Megatron's sequence packing on (``--rl-use-sequence-packing``), a generation
that stopped at ``--inference-max-seq-length`` ends with ``eod`` (capped_generations.py
says why).
"""

from __future__ import annotations

import itertools

from megatron.rl.agent.reward_only_agent import RewardOnlyAgent

from tests.gpu.capped_generations import end_capped_with_eod

_QUESTIONS = [(f"Count: {n} {n + 1} {n + 2}", str((n + 3) % 10)) for n in range(8)]
_next_question = itertools.count()


class CountingAgent(RewardOnlyAgent):
    env_id: str = "amem-counting"

    async def get_prompt(self, validation: bool = False):
        index = next(_next_question) % len(_QUESTIONS)
        prompt, answer = _QUESTIONS[index]
        return prompt, {"answer": answer, "problem_id": f"q{index}"}

    async def get_reward(self, response: str, golden, finish_reason: str) -> float:
        return float(golden["answer"] in (response or ""))

    async def evaluation_prompts(self, num_prompts: int, validation: bool = False):
        return [await self.get_prompt(validation) for _ in range(num_prompts)]

    async def _rollout_from_episode(self, request, episode, golden):
        rollout = await super()._rollout_from_episode(request, episode, golden)
        from megatron.training import get_args, get_tokenizer

        args = get_args()
        trajectory = getattr(rollout, "trajectory", None)
        if args.rl_use_sequence_packing and trajectory and not isinstance(trajectory[0], str):
            end_capped_with_eod(trajectory, args.inference_max_seq_length, args.seq_length,
                                get_tokenizer().eod)
        return rollout


# Fail at import, not at the first rollout, if Megatron-LM renames the seam.
assert hasattr(RewardOnlyAgent, "_rollout_from_episode"), \
    "megatron.rl's RewardOnlyAgent has no _rollout_from_episode: update CountingAgent"
