"""A Megatron-style script for the launcher test (run by tests/test_adapter_megatron.py).

Its parser is strict and knows none of the ``--rl-amem-*`` flags, as Megatron's
``parse_args`` without ``add_args``: it fails if the launcher left one in.
Then gloo, ``parallel_state``, and two rollouts on the hooked engine class.
"""

import argparse
import dataclasses
import json
import os

import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--perform-rl-step", action="store_true")
    parser.add_argument("--grpo-group-size", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from amem_callbacks.adapters.megatron import hooks

    from tests.scenarios_megatron import drain, init_megatron, make_engine

    init_megatron({"tp": args.tensor_model_parallel_size})
    engine = make_engine()
    for _ in range(2):
        engine.resume()
        drain(engine)
        engine.suspend()
    controller = hooks.current_controller()
    result = {
        "script_args": vars(args),
        "settings": dataclasses.asdict(controller.settings),
        "reports": [[via, report.kind, {g.name: g.action for g in report.groups}]
                    for via, report in controller.reports],
        "counters": controller.policy.metrics(last=False),
    }
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
