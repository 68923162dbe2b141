"""The ``amem-callbacks`` command: doctor, demo, bench."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="amem-callbacks",
        description="Free idle NCCL communicator memory during RL rollout.")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check torch, NCCL, cuMem and AMem; say what to fix "
                                           "(exit status 1: training would run unchanged)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--amem-library", metavar="PATH",
                        help="AMem's patched libnccl.so.2, to check it against this torch")
    doctor.add_argument("--no-probe", action="store_true",
                        help="skip the real suspend/resume of a 1-rank communicator on GPU 0")
    demo = sub.add_parser("demo", help="a small train/rollout loop on the local GPUs, several "
                                       "ranks per GPU where NCCL allows (2 CPU processes, dry "
                                       "run, without GPUs)")
    demo.add_argument("--steps", type=_positive_int, default=5)
    demo.add_argument("--ranks", type=_ranks, default=None,
                      help="ranks to start (default: one per GPU, at least 2; more ranks than "
                           "GPUs share them, NCCL >= 2.30)")
    demo.add_argument("--rollout-s", type=float, default=0.5)
    demo.add_argument("--backend", choices=("auto", "nccl", "amem", "noop"), default=None,
                      help="default: auto on GPUs, noop on CPU")
    bench = sub.add_parser("bench", help="measure suspend/resume cost in a synthetic RL loop "
                                         "on all local GPUs (or under torchrun)")
    bench.add_argument("--ranks", type=_ranks, default=None,
                       help="ranks to start (default: one per GPU, at least 2)")
    bench.add_argument("--groups", type=_positive_int, default=8,
                       help="process groups to suspend (Megatron-like roles), default 8")
    bench.add_argument("--steps", type=_positive_int, default=4, help="steps per mode")
    bench.add_argument("--rollout-s", type=float, default=2.0)
    bench.add_argument("--train-s", type=float, default=0.5)
    bench.add_argument("--grad-mib", type=_positive_int, default=64)
    bench.add_argument("--modes", type=_modes, default=("none", "naive", "overlap", "recreate"),
                       help="comma list of none,naive,overlap,recreate,touch,touch-nolearn "
                            "(default: none,naive,overlap,recreate)")
    bench.add_argument("--workers", type=_positive_int, default=None,
                       help="threads per transition in overlap mode (default: best of --sweep)")
    bench.add_argument("--sweep", type=_int_list, default=[1, 2, 4, 8],
                       help="worker counts to time a whole transition with, e.g. 1,4,8")
    bench.add_argument("--guard-calls", type=_positive_int, default=12000,
                       help="small collectives per side for P3, in 24 alternating blocks")
    bench.add_argument("--backend", choices=("nccl", "amem", "noop"), default=None)
    bench.add_argument("--out", default="bench-results")
    return parser


def _modes(text: str) -> tuple:
    from .bench import MODES

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or "none" not in modes:
        raise argparse.ArgumentTypeError(
            f"modes are a comma list of {', '.join(MODES)} and must include 'none' (the baseline)")
    return modes


def _int_list(text: str) -> list:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma list of integers, e.g. 1,4,8; got {text!r}")
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("worker counts must be >= 1")
    return values


def _ranks(text: str) -> int:
    value = _positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError("at least 2 ranks: a 1-rank communicator has no peer "
                                         "buffers to free")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from .doctor import main as doctor_main

        return doctor_main(as_json=args.json, amem_library=args.amem_library,
                           probe=not args.no_probe)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(steps=args.steps, rollout_s=args.rollout_s, backend=args.backend,
                         ranks=args.ranks)
    if args.command == "bench":
        from .bench import main as bench_main

        return bench_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
