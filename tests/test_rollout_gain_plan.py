"""The rollout-gain experiment on CPU: its presets' command lines, the plan's
arithmetic, and the curve and pair merges on per-rank records made by the code that
writes them on the GPU.

The records come from a rank scenario (``rollout_records``, 2 ranks on gloo) that
runs tests/gpu/megatron_rl_gpu.py's own probes (KV allocations, engine steps,
rollouts, iterations, the memory trace, ``write_record`` with the real
``amem_summary``) around megatron-core 0.16.1's hooked ``DynamicInferenceEngine``
with the package's real hooks, growth, decisions and regrow over the fake NCCL. The
engine's step is a queue: as many requests run at once as ``max_requests`` allows,
each generating a fixed number of tokens, as a random model does up to the sequence
cap. The probes' clock adds a fixed cost per step and per request ran, so the rates
the merge computes are the scenario's, not the CPU's noise. What the GPU run adds that
this cannot: Megatron-LM's loop itself (train_rl.py), real memory and real times.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import textwrap
import time
import types
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments import presets, rollout_gain  # noqa: E402
from experiments import gpu_runs as megatron_runs  # noqa: E402
from tests.gpu import megatron_rl_gpu  # noqa: E402
from tests.requires import skip_for_download  # noqa: E402
from amem_callbacks.tools.pairs import Interleaved, Pair  # noqa: E402

RECORDED = os.path.join(ROOT, "results", "one_h200", "rollout_gain_megatron_dp2")
GiB, MiB = 2**30, 2**20


def recorded_runs(tmp_path) -> str:
    """The first experiment's recorded runs (tiny_kv on one H200), unpacked."""
    folder = tmp_path / "recorded"
    with tarfile.open(os.path.join(RECORDED, "runs.tgz")) as tar:
        tar.extractall(folder)
    return str(folder)


# --- the plan ------------------------------------------------------------------------
def test_the_plan_counts_the_parameters_and_memory_megatron_counted(tmp_path):
    """tiny_kv's recorded log: Megatron's own parameter count and its theoretical
    weight-and-optimizer figure, and the engine's KV summary, against the plan's."""
    folder = recorded_runs(tmp_path)
    log = open(os.path.join(folder, "pair0_without.log"), errors="replace").read()
    p = presets.plan(presets.PRESETS["tiny_kv"])
    counted = int(re.search(r"number of parameters on .*?: (\d+)", log).group(1))
    assert p["params"] == counted
    theory_mb = float(re.search(r"weight and optimizer=([\d.]+) MB", log).group(1))
    # its formula counts the parameters from the config, 16 k fewer than the model has
    assert p["memory_per_rank"]["model_state"] / MiB == pytest.approx(theory_mb, rel=1e-4)
    record = json.load(open(os.path.join(folder, "pair0_without.rank0.json")))
    launch, grown_alloc = record["kv_cache_allocations"][0], json.load(open(os.path.join(
        folder, "pair0_with.rank0.json")))["kv_cache_allocations"][1]
    assert (p["launch"]["blocks"], p["launch"]["max_requests"], p["block_bytes"]) == (
        launch["blocks"], launch["max_requests"], launch["kv_bytes"] // launch["blocks"])
    # the first design grew blocks only; the package's rule, which also pays for each
    # extra request's logits, reaches the same block count here
    assert p["grown"]["blocks"] == grown_alloc["blocks"]
    # every prompt is PROMPT_TOKENS long: generations fill the sequence to the cap
    generation = record["generations"][1]
    assert generation["generated_tokens"] == generation["rollouts"] * \
        p["generated_tokens_per_request"]


def test_the_step_model_reproduces_the_recorded_rollout_and_need(tmp_path):
    """The plan's serial step model against tiny_kv's measured rollout (within 15 %),
    and its memory estimate against the need the recorded runs reported (the estimate
    leaves torch's cache out: calibrate measures it; the gap is what it must cover)."""
    folder = recorded_runs(tmp_path)
    measured = json.load(open(os.path.join(RECORDED, "rollout_gain.json")))
    without = [pair["results"]["without"]["generation_s"] for pair in measured["pairs"]]
    p = presets.plan(presets.PRESETS["tiny_kv"])
    assert p["rollout"]["serial"]["without_s"] == pytest.approx(
        sum(without) / len(without), rel=0.15)
    assert p["rollout"]["overlapped"]["without_s"] < p["rollout"]["serial"]["without_s"]
    record = json.load(open(os.path.join(folder, "pair0_without.rank0.json")))
    need = record["torch_max_reserved_bytes"] - record["standin_bytes"] + \
        record["nccl_total_bytes"] + presets.CUDA_CONTEXT
    assert p["need_per_rank"] < need < 1.35 * p["need_per_rank"]


def test_the_realistic_preset_meets_every_set_up_condition_of_the_issue():
    p = presets.plan(presets.PRESETS["qwen3_1_7b"])
    assert all(p["checks"].values()), p["checks"]
    m = presets.QWEN3_1_7B
    assert p["kv_bytes_per_token"] == 2 * m.layers * m.kv_heads * m.head_dim * 2 == 114688
    assert p["params"] == pytest.approx(1.72e9, rel=0.01)  # Qwen3-1.7B, tied embeddings
    assert p["waves"] == [2, 1] and p["generated_tokens_per_request"] >= 512
    assert 0.15 <= p["freed_fraction_of_kv"] <= 0.5
    # concurrency follows the blocks: the grown cache runs all of a rank's requests
    assert p["grown"]["max_requests"] >= p["requests_per_rank"] > p["launch"]["max_requests"]
    assert p["requests_per_rank"] / p["launch"]["max_requests"] >= p["goals"]["concurrency_ratio"]
    # the run fits a rank's share with the slack the grown cache's attention needs
    assert p["need_per_rank"] + p["slack_gb"] * GiB < p["share_per_rank"]
    # one step model says the goal is reachable, the other not: the curve decides
    assert p["rollout"]["serial"]["tokens_per_s_ratio"] >= p["goals"]["tokens_per_s_ratio"]
    assert p["rollout"]["overlapped"]["tokens_per_s_ratio"] < p["goals"]["tokens_per_s_ratio"]


def test_qwen2_5_needs_four_times_the_training_tokens_for_the_same_cache():
    """Why Qwen2.5-1.5B is not the campaign's model: its 2 KV heads make a token's KV
    a quarter of Qwen3-1.7B's, so the same cache needs ~4x the requests."""
    qwen3, qwen25 = (presets.plan(presets.PRESETS[n]) for n in ("qwen3_1_7b", "qwen2_5_1_5b"))
    assert qwen3["kv_bytes_per_token"] == 4 * qwen25["kv_bytes_per_token"]
    assert qwen25["requests"] >= 3.5 * qwen3["requests"]
    assert qwen25["train_s"] > 3 * qwen3["train_s"]
    assert all(qwen25["checks"].values())  # it meets the set-up: it only costs too much


def test_the_presets_docstring_quotes_the_plan():
    """The module docstring's figures are the plan's (no drift when a preset changes)."""
    doc = presets.__doc__
    p = presets.plan(presets.PRESETS["qwen3_1_7b"])
    for text in (f"{p['kv_bytes_per_token'] // 1024} KiB of KV a token",
                 f"{p['block_bytes'] / MiB:.1f} MiB a block of {p['block_tokens']} tokens",
                 f"a {p['buffer_gb']:g} GiB cache holds {p['launch']['blocks']} blocks, "
                 f"{p['launch']['max_requests']} requests",
                 f"{p['grown']['blocks']} blocks, {p['grown']['max_requests']} requests",
                 f"capacity x{p['capacity_ratio']:.2f}",
                 f"{100 * p['freed_fraction_of_kv']:.0f} % of the cache",
                 f"{presets.PRESETS['qwen3_1_7b'].prompts} prompts x "
                 f"{presets.PRESETS['qwen3_1_7b'].group} = {p['requests']} requests, "
                 f"{p['requests_per_rank']} a rank",
                 f"{p['rollout']['overlapped']['without_s']:.0f} s (overlapped) to "
                 f"{p['rollout']['serial']['without_s']:.0f} s (serial)",
                 f"{p['memory_per_rank']['model_state'] / GiB:.1f} GiB a rank",
                 f"{p['generated_tokens_per_request']} tokens"):
        assert " ".join(text.split()) in " ".join(doc.split()), text


def test_the_plan_subcommand_prints_the_arithmetic_and_writes_plan_json(tmp_path, capsys):
    assert rollout_gain.main(["plan", str(tmp_path), "--preset", "qwen3_1_7b"]) == 0
    printed = capsys.readouterr().out
    assert "112 KiB) a token" in printed and "FAIL" not in printed
    assert json.load(open(tmp_path / "plan.json"))["preset"] == "qwen3_1_7b"
    assert rollout_gain.main(["plan", "--preset", "tiny_kv"]) == 1  # 33-token generations
    assert "FAIL generations of at least 512 tokens" in capsys.readouterr().out


def test_the_rollout_simulation_counts_waves_and_the_regrow():
    one = lambda active: 1.0  # noqa: E731  (a step costs 1 s whatever runs)
    assert presets.simulate(10, 3, 4, one) == {"seconds": 9.0, "steps": 9, "peak_in_flight": 4}
    grown = presets.simulate(10, 3, 4, one, grown_slots=10, grow_at_s=1.0, regrow_s=0.5)
    # 4 run one step, the cache grows (0.5 s), then all 10 run: 2 more steps for the
    # first 4, 3 for the rest
    assert grown == {"seconds": 4.5, "steps": 4, "peak_in_flight": 10}


# --- the command lines ---------------------------------------------------------------
class FakeRun:
    """Stands in for megatron_runs.Run: records what would run, writes the records
    of a run the scenario made under this run's name (or none), returns rc 0."""

    started: list = []
    records_from: dict = {}

    def __init__(self, name, argv, log, timeout_s, env):
        self.name, self.argv, self.log, self.env = name, argv, log, env
        FakeRun.started.append(self)
        open(log, "w").close()

    def wait(self):
        source = FakeRun.records_from.get(self.name)
        if source:
            out = os.path.dirname(self.log)
            for path in glob.glob(source + ".rank*.json"):
                suffix = path[len(source):]
                with open(path) as f, open(os.path.join(out, self.name + suffix), "w") as g:
                    g.write(f.read())
        return {"name": self.name, "rc": 0, "hung": False, "seconds": 1.0,
                "command": " ".join(self.argv), "log": self.log, "tail": ""}


@pytest.fixture
def fake_runs(monkeypatch):
    FakeRun.started, FakeRun.records_from = [], {}
    monkeypatch.setattr(megatron_runs, "Run", FakeRun)
    monkeypatch.setattr(megatron_runs, "install_bundle", lambda: None)
    return FakeRun


def parse_command(argv: list) -> tuple:
    """(the adapter's settings or None, the wrapper's flags, train_rl.py's flags) of
    a torchrun line that megatron_runs.command built."""
    from amem_callbacks.adapters.megatron.args import launcher_parser, settings_from_args

    script = argv.index(megatron_runs.WRAPPER)
    launcher = argv[script - 2:script] == ["-m", "amem_callbacks.adapters.megatron"]
    rest = argv[script + 1:]
    settings = None
    if launcher:
        ours, rest = launcher_parser().parse_known_args(rest)
        settings = settings_from_args(ours)
    else:
        assert not [a for a in rest if a.startswith("--rl-amem-")], rest
    wrapper, train_rl = megatron_rl_gpu.wrapper_parser().parse_known_args(rest)
    return settings, wrapper, train_rl


def last_values(flags: list) -> dict:
    """train_rl.py's flags as argparse reads them: the last value of each wins; a
    flag followed by another flag is a switch."""
    out, i = {}, 0
    while i < len(flags):
        name = flags[i]
        nxt = flags[i + 1] if i + 1 < len(flags) else None
        if nxt is None or nxt.startswith("--"):
            out[name], i = True, i + 1
        else:
            value = [nxt]
            i += 2
            while i < len(flags) and not flags[i].startswith("--"):  # nargs (--spec a b)
                value.append(flags[i])
                i += 1
            out[name] = value[0] if len(value) == 1 else value
    return out


def claims(preset: presets.Preset) -> dict:
    """What the experiment says its runs are, from the preset's model and plan."""
    m = preset.model
    out = {"--num-layers": m.layers, "--hidden-size": m.hidden, "--num-attention-heads": m.heads,
           "--kv-channels": m.head_dim, "--ffn-hidden-size": m.ffn,
           "--inference-max-seq-length": preset.seq, "--seq-length": preset.bin_tokens,
           "--max-position-embeddings": preset.bin_tokens,
           "--inference-dynamic-batching-block-size": preset.block_tokens,
           "--grpo-prompts-per-step": preset.prompts, "--grpo-group-size": preset.group,
           "--global-batch-size": preset.requests, "--micro-batch-size": 1,
           "--rl-kv-cache-management-mode": "recompute", "--train-iters": preset.iters,
           "--inference-dynamic-batching-buffer-size-gb": preset.buffer_gb}
    if m.kv_heads != m.heads:
        out.update({"--group-query-attention": True, "--num-query-groups": m.kv_heads})
    if preset.per_bin > 1:
        out.update({"--rl-use-sequence-packing": True,
                    "--rl-sequence-packing-max-sequences-per-bin": preset.per_bin})
    if m.learned_positions:
        out["--position-embedding-type"] = "learned_absolute"
    else:
        out.update({"--position-embedding-type": "rope", "--rotary-base": 1000000})
    return out


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_each_sides_command_line_is_what_the_experiment_claims(name, tmp_path, fake_runs):
    """The exact torchrun lines ``run`` starts, through the adapter's parser and the
    wrapper's: the package's flags only on its sides, growth only on ``with``, the
    stand-in allocation, and train_rl.py's flags as the preset and its plan say
    (after megatron_rl_gpu.py's TINY defaults, which they override)."""
    preset = presets.PRESETS[name]
    for sides in ("without,with", "nogrow,with", "nogrow,twin"):
        out = tmp_path / sides.replace(",", "-")
        assert rollout_gain.main(["run", str(out), "--preset", name, "--pairs", "2",
                                  "--sides", sides]) == 0
    assert [r.name for r in fake_runs.started] == [
        "pair0_without", "pair0_with", "pair1_with", "pair1_without",
        "pair0_nogrow", "pair0_with", "pair1_with", "pair1_nogrow",
        "pair0_nogrow", "pair0_twin", "pair1_twin", "pair1_nogrow"]
    for run in fake_runs.started:
        settings, wrapper, train_rl = parse_command(run.argv)
        side = run.name.split("_")[1]
        if side == "without":
            assert settings is None
        else:
            assert settings.enabled and settings.backend == "nccl"
            assert settings.grow_kv_cache == (side == "with")
        assert wrapper.amem_leave_gb == preset.leave_gb and wrapper.amem_vocab == \
            preset.model.vocab and wrapper.amem_memory_trace > 0
        assert wrapper.probe_out.endswith(run.name) and not wrapper.amem_stop_after_rollouts
        flags = last_values(megatron_rl_gpu.TINY + train_rl)
        for flag, value in claims(preset).items():
            value = f"{value:g}" if isinstance(value, float) else str(value)
            assert str(flags.get(flag)) == value, (flag, flags.get(flag), value)
        assert "CUDA_VISIBLE_DEVICES" not in run.env or run.env["CUDA_VISIBLE_DEVICES"] == \
            os.environ.get("CUDA_VISIBLE_DEVICES")


def test_only_one_side_runs_the_half_of_a_pair_a_lost_machine_left(tmp_path, fake_runs, capsys):
    """--only: the side a machine that went back never ran, in the pair's own order and
    flags; a side the pairs do not have stops before any run, naming the ones they do."""
    assert rollout_gain.main(["run", str(tmp_path), "--preset", "qwen3_1_7b", "--first", "3",
                              "--pairs", "2", "--only", "without"]) == 0
    assert [r.name for r in fake_runs.started] == ["pair3_without", "pair4_without"]
    assert all(parse_command(r.argv)[0] is None for r in fake_runs.started)
    with pytest.raises(SystemExit):
        rollout_gain.main(["run", str(tmp_path), "--only", "nogrow"])
    assert "--only without or --only with" in capsys.readouterr().err
    assert len(fake_runs.started) == 2


def test_sequence_packing_trains_in_bins_and_leaves_the_rollout_as_it_was(tmp_path, fake_runs):
    """--sequences-per-bin 2: train_rl.py packs two sequences a micro-batch (bins of
    twice the sequence, Megatron's own flags), the rollout's flags unchanged; the plan
    counts half the passes and a bin's activations."""
    assert rollout_gain.main(["run", str(tmp_path), "--preset", "qwen3_1_7b", "--pairs", "1",
                              "--sequences-per-bin", "2"]) == 0
    packed = presets.PRESETS["qwen3_1_7b"].packed(2)
    assert packed.bin_tokens == 2 * packed.seq == 1088
    for run in fake_runs.started:
        flags = last_values(megatron_rl_gpu.TINY + parse_command(run.argv)[2])
        for flag, value in claims(packed).items():
            value = f"{value:g}" if isinstance(value, float) else str(value)
            assert str(flags.get(flag)) == value, (flag, flags.get(flag), value)
    one, two = (presets.plan(presets.PRESETS["qwen3_1_7b"].packed(n)) for n in (1, 2))
    assert (one["bins_per_rank"], two["bins_per_rank"]) == (232, 116)
    assert two["train_s"] < one["train_s"] and two["launch"] == one["launch"]
    assert two["waves"] == one["waves"]
    for model in ("serial", "overlapped"):  # the same rollout; the run is shorter
        a, b = one["rollout"][model], two["rollout"][model]
        assert (a["without_s"], a["with_s"]) == (b["without_s"], b["with_s"])
        assert all(y < x for x, y in zip(a["run_s"], b["run_s"]))
    mem = "training_activations"
    # two sequences' activations: the attention scores stay a sequence's, not a bin's
    assert two["memory_per_rank"][mem] == pytest.approx(2 * one["memory_per_rank"][mem], rel=1e-6)
    assert all(two["checks"].values()), two["checks"]
    # four a bin: its activations come too close to the rollout's KV cache
    four = presets.plan(presets.PRESETS["qwen3_1_7b"].packed(4))
    assert not four["checks"]["training's peak stays under the rollout's"]


def test_emptying_torchs_cache_after_training_reaches_every_run(tmp_path, fake_runs, records):
    """--empty-unused-memory-level 2 (Megatron's flag) goes to every side and the control:
    on the GPU (2026-12-03) the control's bigger cache reused training's cached blocks."""
    fake_runs.records_from = {"pair0_with": os.path.join(records["pairs"], "pair0_with")}
    assert rollout_gain.main(["run", str(tmp_path), "--preset", "qwen3_1_7b", "--pairs", "1",
                              "--control", "--empty-unused-memory-level", "2"]) == 0
    assert len(fake_runs.started) == 3  # without, with, the control
    for run in fake_runs.started:
        assert last_values(parse_command(run.argv)[2]).get(
            "--empty-unused-memory-level") == "2", run.argv
    assert rollout_gain.main(["run", str(tmp_path / "plain"), "--preset", "qwen3_1_7b",
                              "--pairs", "1"]) == 0
    assert all("--empty-unused-memory-level" not in run.argv for run in fake_runs.started[3:])


@pytest.mark.parametrize("argv, says", [
    (["--preset", "tiny_kv", "--sequences-per-bin", "2"], "learned positions"),
    (["--preset", "qwen3_1_7b", "--sequences-per-bin", "0"], "1 or more"),
    (["--preset", "qwen3_1_7b", "--empty-unused-memory-level", "3"], "0, 1 or 2")])
def test_a_bad_sequences_per_bin_stops_before_any_run(argv, says, tmp_path, fake_runs, capsys):
    with pytest.raises(SystemExit) as stop:
        rollout_gain.main(["run", str(tmp_path), *argv])
    assert stop.value.code == 2 and says in capsys.readouterr().err
    assert fake_runs.started == []


def test_several_gpus_run_both_sides_of_a_pair_at_once_then_the_control_at_the_grown_size(
        records, tmp_path, fake_runs):
    """Pairs on 4 GPUs, two at a time, sides swapped pair to pair; the control, without
    the package, gets the largest cache a run with it reached (its records' own)."""
    fake_runs.records_from = {f"pair{i}_{side}": os.path.join(records["pairs"], f"pair{i}_{side}")
                              for i in range(3) for side in ("without", "with")}
    assert rollout_gain.main(["run", str(tmp_path), "--preset", "qwen3_1_7b", "--pairs", "3",
                              "--gpus", "4", "--control"]) == 0
    placed = [(r.name, r.env.get("CUDA_VISIBLE_DEVICES")) for r in fake_runs.started]
    assert placed[:6] == [("pair0_without", "0"), ("pair0_with", "1"), ("pair1_with", "2"),
                          ("pair1_without", "3"), ("pair2_without", "0"), ("pair2_with", "1")]
    ports = [r.argv[r.argv.index("--master-port") + 1] for r in fake_runs.started]
    assert len(set(ports)) == len(ports)  # runs at once need their own ports
    with tarfile.open(tmp_path / "runs.tgz") as tar:  # every run so far, packed after each
        assert {"pair2_with.rank1.json", "control.outcome.json"} <= set(tar.getnames())
    control = fake_runs.started[-1]
    settings, wrapper, train_rl = parse_command(control.argv)
    grown = max(a["kv_bytes"] for i in range(3) for a in load(os.path.join(
        records["pairs"], f"pair{i}_with"))["kv_cache_allocations"])
    assert control.name == "control" and settings is None and wrapper.amem_leave_gb == \
        presets.PRESETS["qwen3_1_7b"].leave_gb
    assert last_values(train_rl)["--inference-dynamic-batching-buffer-size-gb"] == \
        f"{round(grown / GiB, 2):g}"


def test_a_step_given_some_gpus_places_its_runs_on_those(tmp_path, fake_runs, monkeypatch):
    """Two steps at once on one host (the pairs on GPUs 0-1, the old preset's on 2-3):
    a step's GPU indices go through its own CUDA_VISIBLE_DEVICES."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert rollout_gain.main(["run", str(tmp_path), "--preset", "tiny_kv", "--pairs", "2",
                              "--gpus", "2", "--sides", "nogrow,with"]) == 0
    assert [(r.name, r.env["CUDA_VISIBLE_DEVICES"]) for r in fake_runs.started] == [
        ("pair0_nogrow", "2"), ("pair0_with", "3"), ("pair1_with", "2"), ("pair1_nogrow", "3")]


def test_the_megatron_0192_parser_takes_every_presets_command_line(tmp_path):
    """train_rl.py's flags of every preset through megatron-core 0.19.2's own
    ``parse_args`` and ``validate_args`` (2 ranks): a misspelt or removed flag, or
    an inconsistent shape, fails here rather than on the GPU. 0.19.2 needs Python
    3.12 and a GPU stack to import whole; on 3.11 its argument module imports with
    two shims (``typing.override``; the MoE paged-stash kernels, which need Triton)."""
    wheel_dir = tmp_path / "wheel"
    download = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "megatron-core==0.19.2", "--no-deps",
         "--only-binary=:all:", "--python-version", "3.12", "--platform",
         "manylinux_2_28_x86_64", "-d", str(wheel_dir)], capture_output=True, text=True,
        timeout=180)
    found = sorted(wheel_dir.glob("megatron_core-*.whl"))
    if download.returncode != 0 or not found:
        skip_for_download(f"megatron-core 0.19.2 not downloadable here: {download.stderr[-300:]}")
    site = tmp_path / "site"
    zipfile.ZipFile(found[0]).extractall(site)
    argvs = {}
    for name, preset in presets.PRESETS.items():
        argvs[name] = ["train_rl.py", *megatron_rl_gpu.TINY, "--tokenizer-type",
                       "HuggingFaceTokenizer", "--tokenizer-model", "/nonexistent",
                       "--langrl-env-config", "/nonexistent.yaml",
                       *preset.train_rl_flags(preset.iters, preset.buffer_gb)]
    # the curve's point with a user-set max_requests (rollout_gain.curve adds the flag)
    argvs["curve_point"] = argvs["qwen3_1_7b"] + ["--inference-dynamic-batching-max-requests",
                                                  "88"]
    # train_rl.py adds Megatron-LM's inference flags (megatron/inference/utils.py): with
    # the bundle (tests/gpu/bundle_megatron.sh) here, its own provider is used too
    mlm = os.path.join(ROOT, ".gpu", "megatron", "mlm")
    provider = os.path.exists(os.path.join(mlm, "megatron", "inference", "utils.py"))
    script = tmp_path / "parse.py"
    script.write_text(textwrap.dedent(f'''
        import importlib.abc, importlib.machinery, json, os, sys, types, typing
        typing.override = getattr(typing, "override", lambda f: f)  # Python 3.12's
        STUB = "megatron.core.transformer.moe.ops.paged_stash"  # Triton kernels
        class Stub(types.ModuleType):
            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return lambda *a, **k: None
        class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path, target=None):
                return importlib.machinery.ModuleSpec(name, self) if name == STUB else None
            def create_module(self, spec):
                return Stub(spec.name)
            def exec_module(self, module):
                pass
        sys.meta_path.insert(0, Finder())
        sys.path.insert(0, {str(site)!r})
        os.environ.update(WORLD_SIZE="2", RANK="0")
        from megatron.training.arguments import parse_args, validate_args
        provider = None
        if {provider!r}:
            sys.path.insert(0, {mlm!r})
            from megatron.inference.utils import add_inference_args as provider
        out = {{}}
        for name, argv in json.loads(sys.argv[1]).items():
            sys.argv = argv
            args = parse_args(provider)
            validate_args(args, {{}})
            out[name] = {{k: getattr(args, k) for k in (
                "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "ffn_hidden_size", "padded_vocab_size", "seq_length",
                "inference_max_seq_length", "inference_dynamic_batching_block_size",
                "inference_dynamic_batching_buffer_size_gb", "global_batch_size",
                "data_parallel_size", "rl_kv_cache_management_mode", "rotary_base",
                "position_embedding_type", "swiglu", "untie_embeddings_and_output_weights",
                "add_qkv_bias", "add_bias_linear", "group_query_attention",
                "layernorm_epsilon", "inference_dynamic_batching_max_requests")
                if hasattr(args, k)}}
        print("PARSED " + json.dumps(out, default=str))
    '''))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(script), json.dumps(argvs)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=str(tmp_path))
    line = next((x for x in done.stdout.splitlines() if x.startswith("PARSED ")), None)
    assert done.returncode == 0 and line, (done.stdout[-2000:], done.stderr[-3000:])
    parsed = json.loads(line[len("PARSED "):])
    for name, preset in presets.PRESETS.items():
        got, m = parsed[name], preset.model
        assert (got["num_layers"], got["hidden_size"], got["num_attention_heads"],
                got["kv_channels"], got["ffn_hidden_size"]) == (
            m.layers, m.hidden, m.heads, m.head_dim, m.ffn)
        # Megatron reads num_query_groups only with --group-query-attention
        assert (got["num_query_groups"] if got["group_query_attention"] else m.heads) == \
            m.kv_heads
        assert got["inference_dynamic_batching_block_size"] == preset.block_tokens
        assert got["inference_max_seq_length"] == got["seq_length"] == preset.seq
        assert got["global_batch_size"] == preset.requests and got["data_parallel_size"] == 2
        assert got["rl_kv_cache_management_mode"] == "recompute"
        assert got["add_qkv_bias"] == m.qkv_bias and not got["add_bias_linear"]
        assert got["untie_embeddings_and_output_weights"] == (not m.tied)
        assert got["inference_dynamic_batching_max_requests"] is None  # follows the blocks
        if not m.learned_positions:
            assert got["rotary_base"] == 1000000 and got["layernorm_epsilon"] == 1e-6
    assert parsed["curve_point"]["inference_dynamic_batching_max_requests"] == 88


# --- records made by the code that writes them -----------------------------------------
#: the probes' clock adds STEP_S + PER_REQUEST_S a request ran to each step (seconds
#: that pass only there); each step also sleeps REAL_STEP_S for the suspends' threads
STEP_S, PER_REQUEST_S, REAL_STEP_S = 1.0, 0.02, 0.02
#: each fake communicator's suspend takes this long in pairs 0 and 2 (after their first
#: rollout): the resume comes first, the cache grows between two steps
SUSPEND_DELAY_MS = 25
TOKENS, REQUESTS, LAUNCH_BLOCKS, BLOCK_BYTES = 12, 20, 17, 256 * MiB
TOTAL, BASE, NCCL = 80 * GiB, 20 * GiB, 3 * GiB


def __getattr__(name):
    """The package reads the CUDA-graph batch-list builder from the module of the
    context's class (concurrency.builder): the scenario's context is defined here, and
    0.16.1 has no builder, so this module lends tests/scenarios_megatron.py's stand-in
    (imported only then: it brings torch.distributed)."""
    if name == "CUDAGraphBatchDimensionBuilder":
        from tests.scenarios_megatron import CUDAGraphBatchDimensionBuilder

        return CUDAGraphBatchDimensionBuilder
    raise AttributeError(name)


class Clock:
    """The probes' clock: real time plus a fixed virtual cost per engine step."""

    def __init__(self):
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


def rollout_records(args):
    """Rank scenario (tests.scenarios): the runs of a curve and of interleaved pairs,
    each rank writing megatron_rl_gpu.py's record for each, into ``args["out"]``."""
    from collections import deque

    import torch.distributed as dist
    from megatron.core.inference.engines import dynamic_engine

    from amem_callbacks.adapters.megatron import Settings, hooks, install, remove_hooks
    from amem_callbacks.patching import Patches
    from tests import scenarios_megatron as sm
    from tests.scenarios import FakeNccl

    sm.init_megatron({})
    namespace = {}
    exec(textwrap.dedent(sm.ALLOCATOR), namespace)
    clock, probe = Clock(), megatron_rl_gpu
    probe.time = types.SimpleNamespace(monotonic=clock.monotonic, sleep=time.sleep)
    fake = FakeNccl(default_mib=480)
    state = {"iteration": 0, "controller": None, "engine": None}
    probe._iteration = lambda: state["iteration"]

    class Context(sm.GrowableContext):
        """0.16.1's engine allocates through allocate_all_tensors (0.19.2's through
        initialize_all_tensors, which the GPU run probes): the same probe functions."""

        def __init__(self, blocks, max_requests=None):
            super().__init__(namespace["KVBlockAllocator"],
                             namespace["KVCacheManagementMode"]("recompute"), blocks)
            self.block_size_bytes, self.block_size_tokens = BLOCK_BYTES, 64
            self.max_sequence_length, self.max_kv_block_count = 64, 1
            if max_requests:  # --inference-dynamic-batching-max-requests
                self.config.max_requests = self.max_requests = max_requests
            self.is_tensor_state_allocated, self.memory_buffer = False, None

        def allocate_all_tensors(self, *, is_init):
            super().allocate_all_tensors(is_init=is_init)
            size = self.kv_block_allocator.total_count * self.block_size_bytes
            self.memory_buffer = types.SimpleNamespace(numel=lambda: size, element_size=lambda: 1)
            self.is_tensor_state_allocated = True

        def deallocate_all_tensors(self):
            self.is_tensor_state_allocated, self.memory_buffer = False, None

    def free_bytes():
        """Both ranks alike on one GPU: the model, the cache, NCCL less what was freed."""
        context = state["engine"].context if state["engine"] else None
        kv = context.memory_buffer.numel() if context is not None and context.memory_buffer \
            else 0
        freed = probe._amem_freed().get("amem_freed_bytes", 0)
        return TOTAL - 2 * (BASE + kv + NCCL - freed)

    probe._device_memory = lambda: (free_bytes(), TOTAL, BASE + 2 * GiB)

    class Engine(sm.cpu_engine_class()):
        def _add_request(self, request):
            pass  # the queue below holds the requests; a regrow leaves it as it is

    async def step(self):  # as many run as max_requests allows; each makes one token a step
        sim = self.sim
        while sim["waiting"] and len(sim["active"]) < self.context.max_requests:
            sim["active"].append(TOKENS)
            sim["waiting"] -= 1
        ran = len(sim["active"])
        time.sleep(REAL_STEP_S)  # the suspends run meanwhile, in their threads
        clock.advance(STEP_S + PER_REQUEST_S * ran)
        sim["active"] = [left - 1 for left in sim["active"]]
        finished = [i for i, left in enumerate(sim["active"]) if left == 0]
        sim["active"] = [left for left in sim["active"] if left > 0]
        self.context.total_request_count = len(sim["active"])
        self.waiting_request_ids = deque(range(sim["waiting"]))
        return {"active_request_ids": list(range(len(sim["active"]))),
                "finished_request_records": finished}

    original_step = dynamic_engine.DynamicInferenceEngine.async_step
    dynamic_engine.DynamicInferenceEngine.async_step = step
    loop = types.ModuleType("amem_test_rl_utils")

    def get_environment_rollouts(model, inference_model, optimizer, n_prompts, group):
        engine, controller = state["engine"], state["controller"]
        time.sleep(state["setup_s"])  # the loop's own set-up before the engine's resume
        engine.resume()
        sm.drain(engine)
        engine.sim = {"waiting": REQUESTS, "active": []}
        while engine.sim["waiting"] or engine.sim["active"]:
            engine._loop.run_until_complete(engine.async_step())
        engine.suspend()
        if controller is not None:
            controller.policy.wait()  # the end's resumes, before the "training" below
        dist.barrier()
        count = dist.get_world_size() * REQUESTS  # every rank holds every rollout
        return [[types.SimpleNamespace(generation_mask=[[1] * TOKENS], num_evictions=[0])
                 for _ in range(count)]]

    loop.get_environment_rollouts = get_environment_rollouts
    written = []
    for spec in args["runs"]:
        name, side, blocks, rollouts = spec["name"], spec["side"], spec["blocks"], spec["rollouts"]
        probe._record = probe.new_record()
        probe._record["engine_step_fields"] = list(probe.STEP_FIELDS)
        loop._INFERENCE_INTERFACE = None
        controller = None
        if side != "without":
            settings = Settings(enabled=True, backend="nccl", grow_kv_cache=side == "with",
                                kv_margin_gb=0.25)
            controller = install(settings=settings, backend=fake.backend(), agree_timeout_s=20,
                                 timeout_s=30)
            hooks.patch_loop(loop)
        state["controller"] = controller
        patches = Patches()
        patches.wrap(Context, "allocate_all_tensors", before=probe.kv_alloc,
                     after=probe.kv_allocated)
        probe.probe_engine_steps(dynamic_engine.DynamicInferenceEngine)
        engine = state["engine"] = sm.make_engine(cls=Engine)
        engine.context = Context(blocks, spec.get("max_requests"))
        state["setup_s"] = spec.get("setup_s", 0.0)
        engine.controller = sm.SamplingController(engine.context)
        rollouts_of = probe.rollouts_probe(loop.get_environment_rollouts)
        stop = probe.start_memory_trace(0.01, free_bytes) if dist.get_rank() == 0 else None
        for k in range(rollouts):
            state["iteration"] = k
            if k == 1:  # later rollouts begin early, at the loop's seam, with the engine
                loop._INFERENCE_INTERFACE = types.SimpleNamespace(_inference_engine=engine)
            probe.rollout(lambda: rollouts_of(None, None, None, 1, REQUESTS))
            if k == 0 and controller is not None:
                for comm in fake.comms.values():  # later suspends outlast the resume, or not
                    fake.controls.delay(comm, spec.get("delay_ms", 0) * 1000)
            probe.train_step(lambda: time.sleep(0.002))
            probe.training_log({"lm loss": 1.0 + k}, {}, 1e-6, k + 1)
        if stop is not None:
            stop.set()
        prefix = os.path.join(args["out"], name)
        probe.write_record(prefix)
        written.append(prefix)
        patches.undo()
        dynamic_engine.DynamicInferenceEngine.async_step = step  # the probe's and the hooks'
        if controller is not None:
            remove_hooks()
            for comm in fake.comms.values():
                fake.controls.delay(comm, 0)
        dist.barrier()
    dynamic_engine.DynamicInferenceEngine.async_step = original_step
    return {"written": written}


def curve_runs() -> list:
    """The curve's runs as rollout_gain names them: the launch buffer (calibrate's run),
    the grown size, half the launch size's requests at once."""
    launch_gb, grown_gb = LAUNCH_BLOCKS * BLOCK_BYTES / GiB, 22 * BLOCK_BYTES / GiB
    half = (LAUNCH_BLOCKS - 1) // 2
    return [{"name": "calibrate", "side": "without", "blocks": LAUNCH_BLOCKS, "rollouts": 2},
            {"name": rollout_gain.point_name(grown_gb, None), "side": "without", "blocks": 22,
             "rollouts": 1},
            {"name": rollout_gain.point_name(launch_gb, half), "side": "without",
             "blocks": LAUNCH_BLOCKS, "max_requests": half, "rollouts": 1}]


def pair_runs() -> list:
    """Three interleaved pairs, four rollouts each; in pairs 0 and 2 the suspends
    outlast the resume (they are held until the first tokens, the cache grows between
    steps), in pair 1 the loop's set-up outlasts them: the first begin at the loop's
    seam holds them too (nothing measured there yet), the next, known to fit before
    the resume, does not (it grows at the resume). Rollout 2 runs at the launch size:
    the decider measures it again (its only figure was the launch's rollout)."""
    out = []
    for index in range(3):
        order = ("without", "with") if index % 2 == 0 else ("with", "without")
        timing = {"setup_s": 0.3} if index == 1 else {"delay_ms": SUSPEND_DELAY_MS}
        out += [dict(timing, name=f"pair{index}_{side}", side=side, blocks=LAUNCH_BLOCKS,
                     rollouts=4) for side in order]
    return out


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Every run's per-rank records, and each run's outcome as megatron_runs.Run writes it."""
    from tests.harness import run_ranks
    from tests.requires import skip_unless_installed

    skip_unless_installed("megatron.core")  # the probes run around megatron-core's engine

    out = str(tmp_path_factory.mktemp("rollout-records"))
    pairs_out, curve_out = os.path.join(out, "pairs"), os.path.join(out, "curve")
    for folder, runs_ in ((curve_out, curve_runs()), (pairs_out, pair_runs())):
        os.makedirs(folder)
        results = run_ranks(f"{__name__}:rollout_records", world=2, timeout=400,
                            args={"out": folder, "runs": runs_})
        assert all(r["returncode"] == 0 for r in results), results
        for name in (spec["name"] for spec in runs_):  # a run that ended well, as Run says
            outcome = megatron_runs.Run(name, [sys.executable, "-c", "pass"],
                                        os.path.join(folder, name + ".log"), 60,
                                        dict(os.environ)).wait()
            with open(os.path.join(folder, name + ".outcome.json"), "w") as f:
                json.dump(outcome, f)
    return {"pairs": pairs_out, "curve": curve_out}


def load(prefix: str, rank: int = 0) -> dict:
    return json.load(open(f"{prefix}.rank{rank}.json"))


def test_the_records_have_every_part_the_merge_reads(records):
    record = load(os.path.join(records["pairs"], "pair0_with"))
    assert not record["errors"], record["errors"]
    assert record["engine_step_fields"] == list(megatron_rl_gpu.STEP_FIELDS)
    assert len(record["generations"]) == 4 and len(record["iterations"]) == 4
    assert [e for e, _ in record["events"]].count("rollouts_asked") == 4
    assert record["memory_trace"] and all(len(s) == 2 for s in record["memory_trace"])
    amem = record["amem"]
    assert amem["installed"] and amem["kv_growth"]["decisions"]
    decisions = amem["kv_growth"]["decisions"]
    assert [d["amem/kv_cache/decision"] for d in decisions] == [0, 1, 0, 1]
    assert "probe" in decisions[1]["why"]
    assert "measure the launch size again" in decisions[2]["why"]
    measured = amem["kv_growth"]["measured"]
    assert measured[1]["amem/kv_cache/measured/grown"] == 1
    assert "amem_freed_bytes" in record["kv_cache_allocations"][1]
    assert not load(os.path.join(records["pairs"], "pair0_without"))["amem"]["installed"]


def test_a_step_counts_tokens_as_the_packages_meter_does():
    from amem_callbacks.adapters.megatron.meter import tokens_of

    megatron_rl_gpu._record = megatron_rl_gpu.new_record()
    context = types.SimpleNamespace(total_request_count=5, paused_request_count=1,
                                    max_requests=8, kv_block_allocator=types.SimpleNamespace(
                                        total_count=9, total_avail=2))
    engine = types.SimpleNamespace(context=context, waiting_request_ids=[7, 8])
    for result in ({"active_request_ids": [1, 2, 3], "finished_request_records": ["a"]},
                   {"active_request_ids": None}, None, []):
        megatron_rl_gpu.record_step(engine, 1.0, 1.5, result)
        row = dict(zip(megatron_rl_gpu.STEP_FIELDS, megatron_rl_gpu._record["engine_steps"][-1]))
        assert row["tokens"] == tokens_of(result)
        assert (row["active"], row["paused"], row["waiting"], row["free_blocks"]) == (4, 1, 2, 2)


def test_a_run_told_to_stop_after_its_rollouts_writes_its_record_and_exits(tmp_path,
                                                                            monkeypatch):
    exits = []
    megatron_rl_gpu._record = megatron_rl_gpu.new_record()
    monkeypatch.setattr(megatron_rl_gpu, "_exit", exits.append)
    monkeypatch.setattr(megatron_rl_gpu, "_iteration", lambda: 0)
    prefix = str(tmp_path / "curve_b1")
    probed = megatron_rl_gpu.rollouts_probe(lambda *a: [], stop_after=2, prefix=prefix)
    probed()
    assert exits == [] and not os.path.exists(prefix + ".rank0.json")
    probed()
    assert exits == [0] and len(load(prefix)["generations"]) == 2


def test_the_pairs_merge_into_the_new_designs_figures(records):
    """Each figure against what the records and the package's own reports say."""
    out = records["pairs"]
    assert rollout_gain.main(["merge", out]) == 0
    gain = json.load(open(os.path.join(out, "rollout_gain.json")))
    first = load(os.path.join(out, "pair0_with"))
    # the headline first: whole runs, from each rank's start to its last iteration,
    # rollout 0 (the launch-size cache, the first begin) included
    for side in ("without", "with"):
        ranks = [load(os.path.join(out, f"pair0_{side}"), rank) for rank in (0, 1)]
        whole = max(r["iterations"][-1]["time"] - r["started"] for r in ranks)
        result = gain["pairs"][0]["results"][side]
        assert result["whole_run_s"] == pytest.approx(whole)
        assert result["whole_iteration_s"] == pytest.approx(whole / len(ranks[0]["iterations"]))
        generations = ranks[0]["generations"]
        assert result["whole_rollout_tokens_per_s"] == pytest.approx(
            sum(g["generated_tokens"] for g in generations) / sum(g["seconds"] for g in generations))
    assert list(gain)[:2] == ["sides", "whole_run"]
    assert gain["whole_run"]["whole_run_s"]["ratio"] is not None
    assert gain["commit"] == first["commit"] and gain["mixed_commits_why"] is None
    reports = first["amem"]["kv_cache"]
    grown = [r for r in reports if r["amem/kv_cache/grown"]]
    launch = LAUNCH_BLOCKS - 1
    # the cache each grown rollout ended with, from the probe and from the package
    assert gain["capacity_ratio"] == pytest.approx((grown[-1]["amem/kv_cache/blocks"] - 1)
                                                   / launch)
    assert gain["max_requests_ratio"] == pytest.approx(
        grown[-1]["amem/kv_cache/max_requests"] / (launch // 4 * 4))
    assert gain["launch_max_requests"] == {"without": launch // 4 * 4, "with": launch // 4 * 4}
    # concurrency follows the blocks: all of a rank's requests once grown
    peak = min(REQUESTS, grown[-1]["amem/kv_cache/max_requests"])
    assert gain["peak_in_flight"] == {"without": launch // 4 * 4, "with": peak}
    assert gain["concurrency_ratio"] == pytest.approx(peak / (launch // 4 * 4))
    # nothing waits for the suspends: in pair 0 the first tokens came before they were
    # over (the package's own figures), and the package adds at most the issue's wait
    measured = first["amem"]["kv_growth"]["measured"][1]
    assert measured["amem/kv_cache/measured/ready_s"] > \
        measured["amem/kv_cache/measured/first_token_s"] >= \
        measured["amem/kv_cache/measured/first_step_s"]
    assert gain["extra_wait_before_first_token_s"] == pytest.approx(
        gain["wait_before_first_token_s"]["with"] - gain["wait_before_first_token_s"]["without"])
    assert gain["extra_wait_before_first_token_s"] <= rollout_gain.WAIT_GOAL_S
    for side in ("without", "with"):  # the first step's start, then its tokens at its end
        assert gain["wait_before_kv_s"][side] <= gain["wait_before_first_step_s"][side] \
            < gain["wait_before_first_token_s"][side]
    # the stand-in's suspends end after the first tokens: negative, as the overlap means
    assert all(lag < 0 for run in pairs_after_suspends(gain) for lag in run)
    # one wave instead of two: fewer steps, each paid for in the probes' clock
    assert gain["rollout_tokens_per_s_ratio"] > 1.1 and gain["step_tokens_per_s_ratio"] > 1.1
    assert gain["generated_tokens_per_request"] == {"without": TOKENS, "with": TOKENS}
    pairs = {p["index"]: p["results"] for p in gain["pairs"]}
    assert pairs[0]["without"]["kv_allocations_per_rollout"] == [1, 1, 1]
    # launch size, then grown; the launch size measured again; grown again
    assert pairs[0]["with"]["kv_allocations_per_rollout"][:2] == [2, 1]
    # held, grown mid-rollout; the launch size measured again; then, known to fit before
    # the resume: not held, grown at the resume
    assert pairs[1]["with"]["kv_allocations_per_rollout"] == [2, 1, 1]
    assert all(after > 0 for after in pairs[0]["with"]["grown_after_s"])
    assert pairs[0]["with"]["decisions"][1][0] == 1
    assert [p["order"] for p in gain["pairs"]] == [["without", "with"], ["with", "without"],
                                                  ["without", "with"]]
    goals = gain["goals"]
    assert goals["concurrency_ratio_at_least_0.9_of_capacity_ratio"] == (
        gain["concurrency_ratio"] >= 0.9 * gain["capacity_ratio"])
    assert goals["tokens_per_s_ratio_at_least_1_plus_half_the_capacity_gain"] == (
        gain["rollout_tokens_per_s_ratio"] >= 1 + 0.5 * (gain["capacity_ratio"] - 1))
    assert goals["extra_wait_before_first_token_at_most_0.1_s"] is True
    assert goals["iteration_time_ratio_below_1"] == (gain["step_time_ratio"] < 1)
    assert goals["at_least_3_pairs"] is True and goals["control_fails"] is None
    assert gain["freed_fraction_of_kv"] == pytest.approx(
        first["amem"]["transitions"][2]["nccl_bytes"] / (LAUNCH_BLOCKS * BLOCK_BYTES))
    critical = json.load(open(os.path.join(out, "critical_path.json")))
    assert critical["pairs"] == 3 and critical["critical_path_s"] is not None
    assert critical["wait_before_first_token_s"] == gain["wait_before_first_token_s"]
    assert critical["first_token_after_suspends_s"] == list(pairs_after_suspends(gain))


def pairs_after_suspends(gain: dict):
    return (p["results"]["with"]["first_token_after_suspends_s"] for p in gain["pairs"])


def test_the_curve_says_more_kv_gave_more_tokens_per_second(records):
    result = rollout_gain.merge_curve(records["curve"])
    points = {p["run"]: p for p in result["points"]}
    half = (LAUNCH_BLOCKS - 1) // 2
    launch = (LAUNCH_BLOCKS - 1) // 4 * 4
    assert [p["peak_in_flight"] for p in result["points"]] == [half, launch, REQUESTS]
    assert points["calibrate"]["bound_step_fraction"] > 0  # requests waited for room
    assert result["rises_with_concurrency"] and result["kv_limited_at_launch"]
    assert result["capacity_ratio"] == pytest.approx(21 / 16)
    # the probes' clock: a step costs STEP_S + PER_REQUEST_S a request that ran
    rate = lambda n: n / (STEP_S + PER_REQUEST_S * n)  # noqa: E731
    assert points["calibrate"]["step_tokens_per_s"] == pytest.approx(
        2 * REQUESTS * TOKENS / (TOKENS * (STEP_S + PER_REQUEST_S * launch)
                                 + TOKENS * (STEP_S + PER_REQUEST_S * (REQUESTS - launch))),
        rel=0.05)
    assert result["best_case_tokens_per_s_ratio"] == pytest.approx(
        points[rollout_gain.point_name(22 * BLOCK_BYTES / GiB, None)]["step_tokens_per_s"]
        / points["calibrate"]["step_tokens_per_s"])
    assert result["pairs_can_meet_the_tokens_goal"] == (
        result["best_case_tokens_per_s_ratio"] >= result["tokens_goal"])
    assert result["verdict"].startswith("KV-limited")
    bins = result["per_step"]
    assert bins and bins[-1]["tokens_per_s_per_rank"] == pytest.approx(rate(REQUESTS), rel=0.1)
    assert json.load(open(os.path.join(records["curve"], "curve.json")))["verdict"] == \
        result["verdict"]


def test_calibrate_and_curve_run_their_points_and_read_their_records(records, tmp_path,
                                                                     fake_runs):
    """The sub-commands' own code over the scenario's records: the leave that
    calibrate derives, the curve's runs (no stand-in, stop after one rollout)."""
    source = records["curve"]
    fake_runs.records_from = {s["name"]: os.path.join(source, s["name"]) for s in curve_runs()}
    grown_gb, half = 22 * BLOCK_BYTES / GiB, (LAUNCH_BLOCKS - 1) // 2
    launch_gb = LAUNCH_BLOCKS * BLOCK_BYTES / GiB
    fake_runs.records_from.update({
        rollout_gain.point_name(grown_gb, None): os.path.join(source, curve_runs()[1]["name"]),
        rollout_gain.point_name(launch_gb, half): os.path.join(source, curve_runs()[2]["name"])})
    out = str(tmp_path)
    assert rollout_gain.main(["calibrate", out, "--preset", "qwen3_1_7b", "--slack-gb", "1"]) == 0
    calibration = json.load(open(os.path.join(out, "calibration.json")))
    record = load(os.path.join(source, "calibrate"))
    need = record["torch_max_reserved_bytes"] + record["nccl_total_bytes"] + presets.CUDA_CONTEXT
    assert calibration["leave_gb"] == round(need / GiB + 1, 2)
    # the stand-in's torch reserves nothing: no training cache, nothing said
    assert set(calibration["training_cache_at_rollout_gib"].values()) == {0.0}
    assert "control_can_take_the_training_cache" not in calibration
    assert rollout_gain.main(["curve", out, "--preset", "qwen3_1_7b", "--points",
                              f"{grown_gb:g}", f"{launch_gb:g}:{half}"]) == 0
    curve_started = fake_runs.started[1:]
    for run, max_requests in zip(curve_started, (None, half)):
        settings, wrapper, train_rl = parse_command(run.argv)
        assert settings is None and wrapper.amem_leave_gb == 0.0  # alone on its GPU
        assert wrapper.amem_stop_after_rollouts == 1
        assert last_values(train_rl).get("--inference-dynamic-batching-max-requests") == (
            None if max_requests is None else str(max_requests))
    assert json.load(open(os.path.join(out, "curve.json")))["kv_limited_at_launch"]


def test_calibrate_counts_the_training_blocks_torch_holds_at_a_later_rollout():
    """On the GPU (2026-12-03) torch reserved 10.6 GiB more at rollout 1's KV allocation
    than at rollout 0's: training's cached blocks, which a bigger cache without the
    package gets once torch frees them on a failed allocation."""
    def allocation(iteration, reserved, kv=11230248960):
        return {"iteration": iteration, "torch_reserved_bytes": reserved, "kv_bytes": kv,
                "blocks": 180, "block_tokens": 544, "max_requests": 176}

    record = {"generations": [{"iteration": i} for i in range(3)],
              "kv_cache_allocations": [allocation(0, 15 * GiB), allocation(1, 26 * GiB),
                                       allocation(1, 20 * GiB, kv=2 * GiB),  # a regrow
                                       allocation(2, 25 * GiB)]}
    assert rollout_gain._cached_training_bytes(record) == 11 * GiB
    record["kv_cache_allocations"] = record["kv_cache_allocations"][:1]
    assert rollout_gain._cached_training_bytes(record) == 0  # one rollout: nothing to say


def test_the_old_presets_growth_cost_pairs_merge_against_growth_off(records, tmp_path):
    """``--sides nogrow,with``: the same merge, with the goal the issue sets for the
    old experiment under the default growth (iteration time within 1 % of growth off)."""
    out = tmp_path / "growth-cost"
    out.mkdir()
    for path in glob.glob(os.path.join(records["pairs"], "pair*_*")):
        name = os.path.basename(path).replace("_without", "_nogrow")
        (out / name).write_bytes(open(path, "rb").read())
    assert rollout_gain.main(["merge", str(out)]) == 0
    gain = json.load(open(out / "rollout_gain.json"))
    assert gain["sides"] == ["nogrow", "with"] and "set_up" not in gain
    # every iteration counts for this goal (a growth probe's too), not step_s's later two
    every = gain["step_time_ratio_all_iterations"]
    pairs = gain["pairs"]
    assert every == pytest.approx(statistics.median(
        p["results"]["with"]["step_s_mean_all"] / p["results"]["nogrow"]["step_s_mean_all"]
        for p in pairs))
    for p in pairs:
        with_ = p["results"]["with"]
        assert with_["step_s_mean_all"] != pytest.approx(with_["step_s"])
    assert gain["goals"]["iteration_time_at_most_1.01_of_growth_off"] == (every <= 1.01)
    assert "concurrency_ratio_at_least_0.9_of_capacity_ratio" not in gain["goals"]


def test_twin_pairs_merge_as_one_configuration_against_itself(records, tmp_path):
    """``--sides nogrow,twin``: two runs of one configuration; the merge reads them like
    any pair (the twin's transitions as the compared side's) and sets no goal: their
    ratios are the loop's own run-to-run swing."""
    out = tmp_path / "twins"
    out.mkdir()
    for path in glob.glob(os.path.join(records["pairs"], "pair*_with*")):
        name = os.path.basename(path).replace("_with", "_twin")
        (out / name).write_bytes(open(path, "rb").read())
        (out / name.replace("_twin", "_nogrow")).write_bytes(open(path, "rb").read())
    assert rollout_gain.main(["merge", str(out)]) == 0
    gain = json.load(open(out / "rollout_gain.json"))
    assert gain["sides"] == ["nogrow", "twin"] and gain["same_configuration"]
    assert gain["goals"] == {} and gain["step_time_ratio"] == pytest.approx(1.0)
    # on the growth-cost goal's basis too (every iteration), so the folders compare
    assert gain["step_time_ratio_all_iterations"] == pytest.approx(1.0)
    assert gain["step_time_ratio_all_iterations_spread"] == pytest.approx([1.0, 1.0])
    critical = json.load(open(out / "critical_path.json"))
    assert critical["sides"] == ["nogrow", "twin"] and critical["per_run"]


def test_the_memory_plot_of_a_pair_or_a_note_without_matplotlib(records, tmp_path, monkeypatch):
    out = tmp_path / "plot"
    out.mkdir()
    for path in glob.glob(os.path.join(records["pairs"], "pair0_*")):
        (out / os.path.basename(path)).write_bytes(open(path, "rb").read())
    real_import = __import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", no_matplotlib)
    path = rollout_gain.plot_pair(str(out), 0)
    note = json.load(open(path))
    assert "matplotlib is not installed" in note["note"]
    assert set(note["series"]) == {"without", "with"}
    with_side = note["series"]["with"]
    assert len(with_side["rollouts"]) == 4 and len(with_side["kv_allocations"]) >= 5
    assert max(with_side["used_gib"]) > min(with_side["used_gib"])
    monkeypatch.setattr("builtins.__import__", real_import)
    if importlib.util.find_spec("matplotlib") is None:  # the GPU machine's image has it
        assert rollout_gain.main(["plot", str(out), "--pair", "0"]) == 0
        return
    assert rollout_gain.main(["plot", str(out), "--pair", "0"]) == 0
    assert os.path.getsize(out / "memory_pair0.png") > 0


def test_megatron_rl_gpu_merge_weighs_the_free_memory_against_what_was_freed_by_then(
        records, tmp_path):
    """Its check of the free memory at the KV allocations on the new records: in pair 1
    the suspends were over at the resume (the GPU-wide freed bytes are the gain); the
    regrow's allocation, after the engine gave its cache back, is not the one compared."""
    pairs = records["pairs"]
    summary = megatron_rl_gpu.merge(os.path.join(pairs, "pair1_without"),
                                    os.path.join(pairs, "pair1_with"), "",
                                    str(tmp_path / "summary.json"))
    checks = summary["checks"]
    key = ("free memory at KV-cache allocation rose by >= 90% of what the GPU's ranks had "
           "freed by then")
    assert checks[key] is True and all(r == pytest.approx(1.0)
                                       for r in summary["free_gain_over_freed"])
    assert checks["no collective reached a suspended group (guard resumes 0)"]
    # pair 0 grew mid-rollout: each rollout holds two allocations, and the one compared
    # is the first (the engine's resume), not the regrow's, whose free bytes count the
    # launch cache the engine's own suspend gave back
    delayed = megatron_rl_gpu.merge(os.path.join(pairs, "pair0_without"),
                                    os.path.join(pairs, "pair0_with"), "",
                                    str(tmp_path / "summary0.json"))
    for rank in (0, 1):
        allocations = load(os.path.join(pairs, "pair0_with"), rank)["kv_cache_allocations"]
        assert [a["iteration"] for a in allocations].count(1) == 2
        first = next(a for a in allocations if a["iteration"] == 1)
        assert delayed["free_at_kv_cache"][rank][1]["amem"] == first["free_bytes"]


def test_a_run_that_runs_out_of_memory_is_stopped_and_reads_as_such(tmp_path):
    """The old control logged CUDA's out-of-memory and then never exited (killed at
    its 150 s limit): a run is stopped a grace after its log says so."""
    log = str(tmp_path / "control.log")
    text = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 868.00 MiB"
    run = megatron_runs.Run("control", [sys.executable, "-c", f"print({text!r}, flush=True); "
                                        "import time; time.sleep(120)"], log, 100,
                            dict(os.environ), grace_s=0.5, poll_s=0.1)
    outcome = run.wait()
    assert outcome["stopped"] == megatron_runs.OOM and outcome["rc"] is None
    assert not outcome["hung"] and outcome["seconds"] < 30
    with open(str(tmp_path / "control.outcome.json"), "w") as f:
        json.dump(outcome, f)
    control = rollout_gain.figures(str(tmp_path / "control"))
    assert control["oom"] and not control["complete"]
    quiet = megatron_runs.Run("slow", [sys.executable, "-c", "import time; time.sleep(120)"],
                              str(tmp_path / "slow.log"), 1.0, dict(os.environ), poll_s=0.1)
    assert quiet.wait()["hung"] is True  # the time limit still applies


def test_the_campaign_runs_a_step_detached_and_polls_it_into_out(tmp_path):
    """experiments/campaign.sh's start and wait (its setup needs the GPU machine's
    carried files): the step outlives the call that started it, its environment
    pairs reach it, and each wait brings its folder's results and log into $OUT; a wait for a step this
    machine never started (a fresh machine) says so at once instead of waiting."""
    script = os.path.join(ROOT, "experiments", "campaign.sh")
    work, out, results = tmp_path / "g", tmp_path / "out", tmp_path / "step"
    out.mkdir()
    results.mkdir()
    env = dict(os.environ, AMEM_CAMPAIGN_DIR=str(work), OUT=str(out))
    step = (f"import os, time; time.sleep(1.5); print('gpu', os.environ['CUDA_VISIBLE_DEVICES']);"
            f"open({str(results / 'curve.json')!r}, 'w').write('{{}}')")
    started = subprocess.run(["bash", script, "start", "demo", "CUDA_VISIBLE_DEVICES=1", "--",
                              sys.executable, "-c", step], env=env, capture_output=True,
                             text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    early = subprocess.run(["bash", script, "wait", "demo", str(results), "0"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert early.returncode == 3 and "still running" in early.stdout
    done = subprocess.run(["bash", script, "wait", "demo", str(results), "30"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "done, rc=0" in done.stdout, done.stdout + done.stderr
    assert "gpu 1" in (out / "demo.log").read_text() and (out / "curve.json").exists()
    lost = subprocess.run(["bash", script, "wait", "other", str(results), "30"], env=env,
                          capture_output=True, text=True, timeout=10)
    assert lost.returncode == 4 and "never started on this machine" in lost.stdout
    wrong = subprocess.run(["bash", script, "launch"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert wrong.returncode == 2 and "unknown step" in wrong.stdout


def test_the_launch_point_is_the_curves_own_run_of_the_launch_buffer_where_it_has_one(tmp_path):
    """calibrate's run may share the machine (it is a memory measurement first): a
    launch-buffer run of the curve's own, timed alone, is the one the gain is read from."""
    own = rollout_gain.point_name(10.5, None)
    points = [{"run": "calibrate", "step_tokens_per_s": 90.0},
              {"run": own, "step_tokens_per_s": 100.0},
              {"run": rollout_gain.point_name(10.5, 88), "step_tokens_per_s": 60.0}]
    assert rollout_gain.launch_point(points, own)["run"] == own
    assert rollout_gain.launch_point(points[:1] + points[2:], own)["run"] == "calibrate"
    assert rollout_gain.launch_point(points, "")["run"] == "calibrate"
    assert rollout_gain._launch_run(str(tmp_path)) == ""  # no calibration.json: calibrate's
    (tmp_path / "calibration.json").write_text(json.dumps({"buffer_gb": 10.5}))
    assert rollout_gain._launch_run(str(tmp_path)) == own


def test_the_set_up_reads_the_asked_generation_length_and_the_measured_mean():
    """A sampled model ends a few requests early: the length check is on what every
    request was asked to generate, with the measured mean at 99 % of it."""
    line = "torchrun x.py --inference-max-seq-length 544 --seq-length 1088"
    assert rollout_gain.generation_length([line, line]) == 544 - presets.PROMPT_TOKENS
    assert rollout_gain.generation_length([line, line.replace("544", "64")]) is None
    assert rollout_gain.generation_length(["torchrun x.py"]) is None

    def set_up(means, lines):
        results = {side: {"generated_tokens_per_request": mean, "rollout_s": 40.0,
                          "kv_bytes": 10, "freed_bytes": 4} for side, mean in means.items()}
        pair = Pair(0, ("without", "with"), results, {"without": 1.0, "with": 1.0})
        return rollout_gain.gain_summary(Interleaved(("without", "with"), [pair]), None,
                                         lines)["set_up"]["generations_of_at_least_512_tokens"]

    assert set_up({"without": 513.0, "with": 511.6}, [line]) is True
    assert set_up({"without": 513.0, "with": 500.0}, [line]) is False  # many ended early
    assert set_up({"without": 60.0, "with": 60.0}, [line.replace("544", "64")]) is False
    assert set_up({"without": 513.0, "with": 513.0}, []) is None


def test_the_merge_refuses_records_of_another_commit_unless_told_why(records, tmp_path):
    out = tmp_path / "pairs"
    shutil.copytree(records["pairs"], out)
    (out / "rollout_gain.json").unlink(missing_ok=True)  # an earlier test's merge
    path = out / "pair1_with.rank1.json"
    record = json.load(open(path))
    record["commit"] = "f" * 40
    path.write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="not made by one commit.*pair1_with.rank1"):
        rollout_gain.main(["merge", str(out)])
    assert not (out / "rollout_gain.json").exists()
    why = "pair 1 re-run after a docs-only commit"
    assert rollout_gain.main(["merge", str(out), "--mixed-commits-why", why]) == 0
    gain = json.load(open(out / "rollout_gain.json"))
    assert gain["mixed_commits_why"] == why and gain["commit"] is None


def test_the_search_finds_the_largest_buffer_that_runs_without_the_package(
        records, tmp_path, fake_runs, monkeypatch):
    """The yardstick (issue 59): bisected over --buffer-gb + k * --search-step, each run
    without the package; one that ran out of memory is a failure. Resumable: a second
    call with the same OUT counts the runs there and starts none."""
    source, edge = os.path.join(records["pairs"], "pair0_without"), 16.0

    class Sized(FakeRun):  # fits up to the edge, runs out of memory above it
        def wait(self):
            buffer = float(last_values(parse_command(self.argv)[2])[
                "--inference-dynamic-batching-buffer-size-gb"])
            if buffer <= edge:
                FakeRun.records_from[self.name] = source
                return super().wait()
            return {"name": self.name, "rc": 1, "hung": False, "seconds": 1.0,
                    "command": " ".join(self.argv), "log": self.log,
                    "tail": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"}

    monkeypatch.setattr(megatron_runs, "Run", Sized)
    argv = ["search", str(tmp_path), "--preset", "qwen3_1_7b", "--buffer-gb", "14",
            "--search-step", "0.5", "--search-high", "18"]
    assert rollout_gain.main(argv) == 0
    assert [r.name for r in FakeRun.started] == [  # the grid's middle first, then bisected
        "search_without_16", "search_without_17", "search_without_16.5"]
    result = json.load(open(tmp_path / "search.json"))
    assert (result["largest_fit"], result["smallest_fail"], result["best_buffer_gb"]) == (
        16.0, 16.5, 16.0)
    assert result["trials"]["17.0"] == [False] and result["runs"]["16.5"] == [
        "search_without_16.5"]
    assert "18.0" not in result["trials"]  # implied by 17's failure, never run
    settings, _, train_rl = parse_command(FakeRun.started[0].argv)
    assert settings is None  # every search run is without the package
    FakeRun.started.clear()
    assert rollout_gain.main(argv) == 0 and FakeRun.started == []


def test_the_qwen3_records_whole_run_figures_are_what_the_merge_gives(tmp_path):
    """results/one_h200/rollout_gain_qwen3_dp2/whole_run.json, from its own runs.tgz by
    today's merge: every rollout counted (rollout 0 included), each job launch to exit."""
    folder = os.path.join(ROOT, "results", "one_h200", "rollout_gain_qwen3_dp2")
    with tarfile.open(os.path.join(folder, "runs.tgz")) as tar:
        tar.extractall(tmp_path, filter="data")
    assert rollout_gain.main(["merge", str(tmp_path), "--preset", "qwen3_1_7b"]) == 0
    gain = json.load(open(tmp_path / "rollout_gain.json"))
    stored = json.load(open(os.path.join(folder, "whole_run.json")))
    assert stored["whole_run"] == json.loads(json.dumps(gain["whole_run"]))
    assert 0.84 < stored["whole_run"]["seconds"]["ratio"] < 0.93  # launch to exit, with/without
