"""Folds the runs of tests/gpu/vllm_series.sh into a results folder (issue 34):

    python3 tests/gpu/vllm_series_merge.py RESULTS_DIR SERIES [SERIES ...] --label "session O o1"

SERIES is a series.tgz (or the folder it packs). Each run folder becomes one row of
RESULTS_DIR/state.json "runs" (trl_vllm_gpu.merge_run, with its share, package side and
ballast from the rank JSONs' own arguments, how it ended from rc.txt, its log's tail),
then summary.json (trl_vllm_gpu.summarise, with "pairs"), runs.json and logs.tgz are
written again. A run the series' bound cut mid-training, with no out-of-memory line, says
nothing about fitting: it goes to "left_out" with why, not to the runs. Sessions L-N
merged by hand; the same steps, written once."""
import argparse
import io
import json
import os
import re
import sys
import tarfile
import tempfile
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from amem_callbacks.tools.pairs import MixedCommits, one_commit  # noqa: E402
from tests.gpu import trl_vllm_gpu as drv  # noqa: E402

#: the exit statuses of a bound that cut the run (timeout's own, and its -k kill)
CUT = (124, 137)
#: what a run keeps of its log beside the figures (the rest is in logs.tgz)
LOG_TAIL_LINES = 40


def run_folders(root: str) -> list:
    return sorted(n for n in os.listdir(root)
                  if os.path.isdir(os.path.join(root, n))
                  and os.path.exists(os.path.join(root, n, "log.txt")))


def first_rank(folder: str) -> dict:
    """The lowest rank's JSON (its arguments, world size, launcher command); {} if none."""
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank.rank") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                return json.load(f)
    return {}


def ended(folder: str) -> tuple:
    """(rc, seconds) from the series' rc.txt; (None, None) where the series was cut first."""
    try:
        with open(os.path.join(folder, "rc.txt")) as f:
            rc, seconds = f.read().split()
        return int(rc), float(seconds)
    except (OSError, ValueError):
        return None, None


def merge_folder(folder: str, name: str, label: str) -> dict:
    with open(os.path.join(folder, "log.txt"), errors="replace") as f:
        lines = f.read().splitlines()
    first = first_rank(folder)
    args = first.get("args") or {}
    # series names read VARIANT-amem-N / VARIANT-base-N (the pairs' own naming)
    named = re.fullmatch(r"(.+?)-(amem|base)(?:-\d+)?", name)
    variant = named.group(1) if named else name
    rc, seconds = ended(folder)
    by_name = bool(named) and named.group(2) == "amem"  # where no rank wrote its arguments
    meta = {"name": name, "share": args.get("share"),
            "amem": bool(args["amem"]) if "amem" in args else by_name,
            "ballast_gib": args.get("ballast_gib"), "variant": variant,
            "rc": rc, "hung": rc in CUT, "ranks": first.get("world") or 2,
            "command": first.get("command"), "seconds": seconds}
    run = drv.merge_run(os.path.join(folder, "rank"), lines, meta)
    run["log_tail"] = "\n".join(lines[-LOG_TAIL_LINES:])
    run["series"] = label
    return run


def left_out_why(run: dict) -> Optional[str]:
    """Why a run says nothing about fitting, or None where it counts (ok, or failed)."""
    if run["ok"] or (run.get("failed") or {}).get("oom"):
        return None
    if run.get("rc") in CUT or run.get("rc") is None:
        return (f"cut at {run.get('seconds')} s by the series' bound before it finished, "
                f"no out-of-memory line (ranks reported: {run.get('ranks_reported')})")
    return None


def repack_logs(archive: str, additions: list) -> None:
    """logs.tgz again with (arcname, folder) added: the log, rank JSONs and merged.json."""
    members = []
    if os.path.exists(archive):
        with tarfile.open(archive) as old:
            for m in old.getmembers():
                data = old.extractfile(m).read() if m.isfile() else None
                members.append((m, data))
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(archive) or ".", suffix=".tgz")
    os.close(fd)
    with tarfile.open(tmp, "w:gz") as new:
        for m, data in members:
            new.addfile(m, io.BytesIO(data) if data is not None else None)
        for arcname, folder in additions:
            for leaf in sorted(os.listdir(folder)):
                if leaf == "log.txt" or leaf == "merged.json" or leaf.startswith("rank.rank"):
                    new.add(os.path.join(folder, leaf), arcname=f"./{arcname}/{leaf}")
    os.replace(tmp, archive)


def check_commits(state: dict, why: Optional[str], label: str) -> None:
    """Every run of the folder from one commit, or the reason they may be folded kept
    in state.json ("mixed_commits"), by the label that brought them (pairs.one_commit)."""
    commits = {name: run.get("commit") for name, run in state["runs"].items()}
    one_commit(commits, why)
    if why:
        state.setdefault("mixed_commits", {})[label] = why


def fold(results: str, series: list, label: str, mixed_commits_why: Optional[str] = None) -> dict:
    os.makedirs(results, exist_ok=True)
    path = os.path.join(results, "state.json")
    state = {"runs": {}, "shares": {}, "left_out": {}}
    if os.path.exists(path):
        with open(path) as f:
            state = json.load(f)
    state.setdefault("shares", {})
    state.setdefault("left_out", {})
    additions = []
    with tempfile.TemporaryDirectory() as scratch:
        for i, source in enumerate(series):
            root = source
            if os.path.isfile(source):
                root = os.path.join(scratch, str(i))
                with tarfile.open(source) as tar:
                    tar.extractall(root, filter="data")
            for name in run_folders(root):
                run = merge_folder(os.path.join(root, name), name, label)
                why = left_out_why(run)
                if why:
                    key = f"{label}: {name}"
                    state["left_out"][key] = why
                    kept_as = f"left-out-{label.split()[-1]}-{name}"
                    additions.append((kept_as, os.path.join(root, name)))
                    print(f"{name}: left out ({why})")
                    continue
                if name in state["runs"]:
                    raise SystemExit(f"{results} has a run named {name} already: "
                                     "rename the series run (the next pair index)")
                state["runs"][name] = run
                if run.get("share") is not None:
                    state["shares"].setdefault(run["variant"], run["share"])
                additions.append((name, os.path.join(root, name)))
                print(f"{name}: ok={run['ok']} KV {run.get('kv_cache_tokens')} tokens, "
                      f"{run.get('tokens_per_s')} tokens/s, mean step {run.get('mean_step_s')} s")
        check_commits(state, mixed_commits_why, label)  # before anything is written
        repack_logs(os.path.join(results, "logs.tgz"), additions)
    summary = drv.summarise(state)
    summary["left_out"] = state["left_out"]
    for leaf, body in (("state.json", state), ("summary.json", summary),
                       ("runs.json", state["runs"])):
        with open(os.path.join(results, leaf), "w") as f:
            json.dump(body, f, indent=1)
            f.write("\n")
    return summary


def recompute(results: str) -> dict:
    """Every run of a results folder merged again from its rank JSONs (logs.tgz) by
    today's merge, with the row state.json keeps of it (share, side, how it ended),
    and the pairs of those: RESULTS/whole_run.json. For records older than the
    whole-run figures: their mean step over every step and tokens over every
    generation come from the records' own steps and generations."""
    with open(os.path.join(results, "state.json")) as f:
        state = json.load(f)
    meta_keys = ("name", "share", "amem", "ballast_gib", "variant", "rc", "hung", "ranks",
                 "command", "seconds", "series")
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        with tarfile.open(os.path.join(results, "logs.tgz")) as tar:
            tar.extractall(scratch, filter="data")
        for name, row in state["runs"].items():
            folder = os.path.join(scratch, name)
            if not os.path.isdir(folder):
                continue
            meta = {k: row.get(k) for k in meta_keys if k in row}
            run = drv.merge_run(os.path.join(folder, "rank"), (), meta)
            run["ok"] = row.get("ok")  # how it ended is the series' word (rc.txt, log)
            runs[name] = run
    keys = ("share", "amem", "ok", "commit", "whole_run_s", "whole_run_mean_step_s",
            "whole_run_tokens_per_s", "mean_step_s", "tokens_per_s", "kv_cache_tokens")
    out = {"how": "python3 tests/gpu/vllm_series_merge.py RESULTS --recompute: each run's "
                  "rank JSONs in logs.tgz merged again; whole_run_* count every step and "
                  "generation (warm-up included), mean_step_s and tokens_per_s leave the "
                  "first generation out (the steady state); whole_run_s is None where the "
                  "records predate the process's start mark",
           "runs": {n: {k: r.get(k) for k in keys} for n, r in sorted(runs.items())},
           "pairs": drv.interleaved_pairs(runs)}
    with open(os.path.join(results, "whole_run.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("series", nargs="*", help="series.tgz files or the folders they pack")
    p.add_argument("--label", help='e.g. "session O o1": where the runs came from')
    p.add_argument("--recompute", action="store_true",
                   help="merge RESULTS' runs again from logs.tgz into whole_run.json")
    p.add_argument("--mixed-commits-why", metavar="TEXT",
                   help="fold runs of different commits, for this reason (kept in state.json)")
    args = p.parse_args(argv)
    if args.recompute:
        pairs = recompute(args.results)["pairs"]
        print(json.dumps({v: {k: rows[k] for k in drv.PAIR_KEYS} for v, rows in pairs.items()},
                         indent=1))
        return 0
    if not args.series or not args.label:
        p.error("folding needs SERIES and --label (or --recompute alone)")
    try:
        summary = fold(args.results, args.series, args.label, args.mixed_commits_why)
    except MixedCommits as exc:
        raise SystemExit(str(exc)) from None
    print(json.dumps({"pairs": summary["pairs"],
                      "raised_share_fails_without": summary["raised_share_fails_without"]},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
