"""Ending the experiment's capped generations with end-of-document, so that
Megatron-LM's sequence packing accepts them (no Megatron import: tested on CPU).

Megatron-LM (``megatron/rl/rl_utils.py``, ``compute_group_stats``) takes a
single-turn rollout shorter than ``--seq-length`` to have ended on its own, and
asserts that its last token is ``eod``. With sequence packing ``--seq-length`` is
the bin (several sequences), so every generation that stopped at
``--inference-max-seq-length`` is refused (measured:
results/one_h200/rollout_gain_qwen3_dp2/probe_2026-12-02c_sequence_packing). The
experiment's random model almost never samples ``eod`` before the cap, by design
(a KV-bound rollout), so its last token is set to ``eod`` as if the model had
ended there: the rollout ran the same steps on the same KV, only the training
data's last token differs.
"""

from __future__ import annotations


def end_capped_with_eod(trajectory: list, cap: int, seq_length: int, eod: int) -> int:
    """Set the last token of every turn of ``trajectory`` (a single-turn rollout's
    token lists) that stopped at the generation ``cap`` short of ``seq_length``
    without ``eod`` to ``eod``, in place. Multi-turn rollouts are left alone
    (Megatron checks only single-turn ones). Returns how many turns changed."""
    if len(trajectory) != 1 or cap >= seq_length:
        return 0
    turn = trajectory[0]
    if len(turn) < cap or len(turn) >= seq_length or not len(turn) or turn[-1] == eod:
        return 0
    turn[-1] = eod
    return 1
