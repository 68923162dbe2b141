"""The ``amem-callbacks`` command: doctor, demo (and bench)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="amem-callbacks",
        description="Free idle NCCL communicator memory during RL rollout.")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check torch, NCCL, cuMem and AMem; say what to fix")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--amem-library", metavar="PATH",
                        help="AMem's patched libnccl.so.2, to check it against this torch")
    demo = sub.add_parser("demo", help="a small train/rollout loop on all local GPUs "
                                       "(2 CPU processes, dry run, without GPUs)")
    demo.add_argument("--steps", type=_positive_int, default=5)
    demo.add_argument("--rollout-s", type=float, default=0.5)
    demo.add_argument("--backend", choices=("auto", "nccl", "amem", "noop"), default=None,
                      help="default: auto on GPUs, noop on CPU")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from .doctor import main as doctor_main

        return doctor_main(as_json=args.json, amem_library=args.amem_library)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(steps=args.steps, rollout_s=args.rollout_s, backend=args.backend)
    return 2


if __name__ == "__main__":
    sys.exit(main())
