"""Probe (2026-12-02c, issue 32): does Qwen3-1.7B's run train with Megatron's own sequence
packing (--rl-use-sequence-packing, bins of --seq-length tokens: 4 sequences of 544),
and how long do its log-prob passes and training step take against ~150 s unpacked?
One iteration, without the package, no stand-in allocation."""
import json, os, sys
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "experiments")]
import presets
from tests.gpu import megatron_runs as runs

out = sys.argv[1]; bin_tokens = int(sys.argv[2]); timeout = float(sys.argv[3])
os.makedirs(out, exist_ok=True)
p = presets.PRESETS["qwen3_1_7b"]
flags = p.train_rl_flags(1, p.buffer_gb)
for name in ("--seq-length", "--max-position-embeddings"):
    flags[flags.index(name) + 1] = str(bin_tokens)
flags.append("--rl-use-sequence-packing")
prefix = os.path.join(out, f"pack{bin_tokens}")
argv = runs.command(2, 29700, prefix, f"/tmp/amem-gain/pack{bin_tokens}", False, flags,
                    p.wrapper_flags(None, 0))
outcome = runs.Run(f"pack{bin_tokens}", argv, prefix + ".log", timeout,
                   runs.environment({"AMEM_TEXT_GEN_PORT": "29701"})).wait()
json.dump(outcome, open(prefix + ".outcome.json", "w"), indent=1)
print(json.dumps({k: outcome[k] for k in ("rc", "hung", "seconds")}))
