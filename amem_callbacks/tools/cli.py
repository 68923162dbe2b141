"""The ``amem-callbacks`` command (also ``python -m amem_callbacks``): doctor, demo, bench.

Parsing imports no torch: ``--version``, ``--help`` and a bad option answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from .. import __version__
from ..checks import MAX_WORKERS, number_type
from ..states import BackendName
from .bench import MODES, ROLES
from .bench import main as bench_main
from .bench_stages import FULL, QUICK, resolve
from .launch import TORCH_NCCL_BACKENDS
from .demo import main as demo_main
from .doctor import main as doctor_main

MIN_RANKS = 2  # a 1-rank communicator has no peer buffers to free
# Upper bounds of the tools' numbers: past them a run does not finish in any
# useful time, or asks for more than a machine holds; each message says so.
MAX_RANKS = 1024  # rank processes on one host
MAX_STEPS = 100_000
MAX_SECONDS = 3600.0  # one rollout or training phase of a synthetic loop: an hour
MAX_GRAD_MIB = 65536  # the gradient tensor alone: 64 GiB
MAX_PAIRS = 100
MAX_GUARD_CALLS = 10_000_000
MAX_GB = 2**20  # 1 PiB: more than any GPU holds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="amem-callbacks",
        description="Free idle NCCL communicator memory during RL rollout.")
    parser.add_argument("--version", action="version", version=f"amem-callbacks {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check torch, NCCL, cuMem and AMem; say what to fix "
                                           "(exit status 1: training would run unchanged)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--amem-library", metavar="PATH",
                        help="AMem's patched libnccl.so.2, to check it against this torch")
    doctor.add_argument("--no-probe", action="store_true",
                        help="skip the real suspend/resume of a 1-rank communicator on GPU 0")
    doctor.add_argument("--freed-gb", type=gigabytes, default=None, metavar="GB",
                        help="NCCL memory a rollout frees on one GPU (the figure of a job's first "
                             "'headroom' log line, or of amem/headroom/freed_bytes): print the "
                             "vLLM share it allows")
    doctor.add_argument("--vllm-utilization", type=fraction, default=None, metavar="U",
                        help="the rollout's gpu_memory_utilization now (with --freed-gb)")
    doctor.add_argument("--gpu-gb", type=gigabytes, default=None, metavar="GB",
                        help="the GPU's total memory (default: GPU 0's)")

    demo = sub.add_parser("demo", help="a small train/rollout loop on the local GPUs, several "
                                       "ranks per GPU where NCCL allows (2 CPU processes, dry "
                                       "run, without GPUs)")
    demo.add_argument("--steps", type=positive_int, default=5,
                      help="train/rollout steps (default 5)")
    _ranks_option(demo)
    demo.add_argument("--rollout-s", type=positive_seconds, default=0.5, metavar="SECONDS",
                      help="compute time of each rollout, while the idle groups are suspended "
                           "(default 0.5)")
    demo.add_argument("--backend", choices=BackendName.choices(), default=None,
                      help="default: auto on GPUs (falls back to running unchanged), noop on "
                           "CPU; a backend named here that cannot work stops the demo at once, "
                           "saying why")
    demo.add_argument("--out", metavar="DIR", default=None,
                      help="folder for demo.json, the full metrics (default: a new folder "
                           "under the system temp folder)")

    bench = sub.add_parser(
        "bench", help="measure suspend/resume cost in a synthetic RL loop on all local GPUs "
                      "(or under torchrun); quick by default, --full for the whole sweep",
        description="Quick by default (about a minute on one GPU): fewer modes, steps and groups, no "
                    "worker sweep, and small NCCL buffers (NCCL_BUFFSIZE=1 MiB, "
                    "NCCL_MAX_NCHANNELS=4, unless already set) so transitions take ~0.4 s. "
                    "--full runs the whole sweep with NCCL's default buffers (minutes). "
                    "Options given explicitly override either.")
    bench.add_argument("--full", action="store_true",
                       help="the full sweep: every default mode, more steps and groups, worker "
                            "sweep, NCCL's default buffers (several minutes on one GPU)")
    _ranks_option(bench)
    bench.add_argument("--groups", type=group_count, default=None,
                       help=f"process groups to suspend, Megatron-like roles (quick "
                            f"{QUICK['groups']}, full {FULL['groups']})")
    bench.add_argument("--steps", type=positive_int, default=None,
                       help=f"steps per mode (quick {QUICK['steps']}, full {FULL['steps']})")
    bench.add_argument("--rollout-s", type=positive_seconds, default=None, metavar="SECONDS",
                       help=f"compute time of each rollout (quick {QUICK['rollout_s']}, full "
                            f"{FULL['rollout_s']})")
    bench.add_argument("--train-s", type=positive_seconds, default=None, metavar="SECONDS",
                       help=f"compute time of each training phase, before its collectives "
                            f"(quick {QUICK['train_s']}, full {FULL['train_s']})")
    bench.add_argument("--grad-mib", type=grad_mib, default=None, metavar="MIB",
                       help=f"size of the gradient all-reduce on 'dp' each step (quick "
                            f"{QUICK['grad_mib']}, full {FULL['grad_mib']})")
    bench.add_argument("--modes", type=mode_list, default=None,
                       help="comma list of none,naive,overlap,recreate,touch,touch-nolearn; "
                            f"none is required (quick {','.join(QUICK['modes'])}; full "
                            f"{','.join(FULL['modes'])})")
    bench.add_argument("--pairs", type=whole_number, default=None,
                       help="with/without pairs run interleaved (none then overlap, overlap "
                            "then none, ...): the step-time ratio inside each pair, median and "
                            f"spread; 0 for none (quick {QUICK['pairs']}, full {FULL['pairs']})")
    bench.add_argument("--workers", type=workers, default=None,
                       help="threads per transition in overlap mode (default: best of --sweep, "
                            "or the policy's default without a sweep)")
    bench.add_argument("--sweep", type=int_list, default=None,
                       help="worker counts to time a whole transition with, e.g. 1,4,8; empty "
                            "for none (quick: none; full 1,2,4,8)")
    bench.add_argument("--guard-calls", type=guard_calls, default=None,
                       help=f"small collectives per side for P3, in 24 alternating blocks "
                            f"(quick {QUICK['guard_calls']}, full {FULL['guard_calls']})")
    bench.add_argument("--backup-cycles", type=whole_number, default=None, metavar="N",
                       help="P6: warm suspend+resume cycles per block, NCCL's host backup "
                            "re-pinned against kept (blocks off,on,off,on; GPU only; a figure "
                            "at NCCL's default buffers, so in --full); 0 for none (quick "
                            f"{QUICK['backup_cycles']}, full {FULL['backup_cycles']})")
    # Not "auto": a bench measures one named backend's cost.
    bench.add_argument("--backend", choices=BackendName.concrete(), default=None,
                       help="default: nccl on GPUs, noop on CPU (a dry run); a backend that "
                            "cannot work here stops the bench at once, saying why")
    bench.add_argument("--torch-backend", choices=TORCH_NCCL_BACKENDS, default=None,
                       help="the torch.distributed backend of the bench's NCCL groups (default "
                            "'nccl', which torch 2.15 makes ProcessGroupNCCL2; nccl-lazy and "
                            "nccl-legacy need torch >= 2.15); the figures name the class it made")
    bench.add_argument("--out", metavar="DIR", default=None,
                       help="folder for bench.json and, on GPUs with matplotlib installed, the "
                            "memory plot bench_memory.png (the run says which it wrote; default: "
                            "a new folder under the system temp folder)")
    return parser


def _ranks_option(parser) -> None:
    parser.add_argument("--ranks", type=ranks, default=None,
                        help=f"ranks to start, >= {MIN_RANKS} (default: one per GPU, at least "
                             f"{MIN_RANKS}; more ranks than GPUs share them, NCCL >= 2.30)")


# argparse names a failing type function in its message ("invalid _ranks value"),
# unless it raises ArgumentTypeError: each one below says what it wants instead.

def whole(what: str, minimum: int, maximum: int):
    """An argparse ``type=``: a whole number from ``minimum`` to ``maximum``,
    else a message saying ``what`` is wanted, with the range."""
    def parse(text: str) -> int:
        value = _int_or_none(text)
        if value is None or not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
        return value

    return parse


ranks = whole(f"a whole number of ranks >= {MIN_RANKS} (a 1-rank communicator has no peer "
              f"buffers to free) and <= {MAX_RANKS}", MIN_RANKS, MAX_RANKS)
positive_int = whole(f"a whole number >= 1 and <= {MAX_STEPS}", 1, MAX_STEPS)
workers = whole(f"a whole number of threads >= 1 and <= {MAX_WORKERS}", 1, MAX_WORKERS)
grad_mib = whole(f"a whole number of MiB >= 1 and <= {MAX_GRAD_MIB}", 1, MAX_GRAD_MIB)
guard_calls = whole(f"a whole number >= 1 and <= {MAX_GUARD_CALLS}", 1, MAX_GUARD_CALLS)
whole_number = whole(f"a whole number >= 0 and <= {MAX_PAIRS}", 0, MAX_PAIRS)
positive_seconds = number_type(f"a number of seconds > 0 and <= {MAX_SECONDS:.0f}",
                               lambda v: 0 < v <= MAX_SECONDS)
gigabytes = number_type(f"a number of GB >= 0 and <= {MAX_GB} (more than any GPU holds)",
                        lambda v: 0 <= v <= MAX_GB)
fraction = number_type("a fraction between 0 and 1, e.g. 0.6", lambda v: 0 < v < 1)


def group_count(text: str) -> int:
    """As many groups as the bench has roles for (it used to cut a larger count silently)."""
    return whole(f"a whole number of groups >= 1 and <= {len(ROLES)} (the bench's "
                 "Megatron-like roles)", 1, len(ROLES))(text)


def int_list(text: str) -> list:
    values = [_int_or_none(v) for v in text.split(",") if v.strip()]
    if any(v is None or not 1 <= v <= MAX_WORKERS for v in values):
        raise argparse.ArgumentTypeError(f"a comma list of whole numbers >= 1 and <= "
                                         f"{MAX_WORKERS}, e.g. 1,4,8; got {text!r}")
    return values


def mode_list(text: str) -> tuple:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or "none" not in modes:
        raise argparse.ArgumentTypeError(
            f"a comma list of {', '.join(MODES)} that includes 'none' (the baseline), "
            f"got {text!r}")
    return modes


def _int_or_none(text: str):
    try:
        return int(text.strip())
    except ValueError:
        return None


def output_folder(requested, tool: str) -> str:
    """Where a tool writes its files: --out, else a new folder under the system
    temp folder (never the working folder, which a quick try should not litter)."""
    if requested:
        return requested
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(tempfile.gettempdir(), f"amem-{tool}-{stamp}")


def unwritable(folder: str):
    """Why ``folder`` cannot take the results, or None; checked before minutes of work."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".amem-write-check-"):
            pass
    except OSError as exc:
        return f"cannot write to --out {folder}: {exc.strerror or exc}"
    return None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        headroom = None
        if args.freed_gb is not None or args.vllm_utilization is not None:
            if args.freed_gb is None or args.vllm_utilization is None:
                print("amem-callbacks doctor: give --freed-gb and --vllm-utilization together",
                      file=sys.stderr)
                return 2
            headroom = (args.freed_gb, args.vllm_utilization, args.gpu_gb)
        return doctor_main(as_json=args.json, amem_library=args.amem_library,
                           probe=not args.no_probe, headroom=headroom)
    args.out = output_folder(args.out, args.command)
    why = unwritable(args.out)
    if why:
        print(f"amem-callbacks {args.command}: {why}", file=sys.stderr)
        return 2
    if args.command == "demo":
        return demo_main(steps=args.steps, rollout_s=args.rollout_s, backend=args.backend,
                         ranks=args.ranks, out=args.out)
    if args.command == "bench":
        return bench_main(resolve(args))
    return 2


if __name__ == "__main__":
    sys.exit(main())
