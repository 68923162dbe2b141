"""Bad input fails at construction, naming what to write; import stays light."""

import subprocess
import sys

import pytest

from amem_callbacks import OffloadPolicy


@pytest.mark.parametrize("kwargs, message", [
    ({"backend": "ncl"}, "unknown backend 'ncl': write one of 'auto', 'nccl', 'amem', 'noop'"),
    ({"backend": 3}, "backend must be one of"),
    ({"guard": "loose"}, "unknown guard mode 'loose': write one of ('resume', 'strict', 'off')"),
    ({"keep": ["tpp"]}, "unknown group name(s) ['tpp'] in keep: use group roles"),
    ({"keep": "tp"}, "keep must be a list of group names, e.g. ['tp']"),
    ({"keep": {"rollout": "tp"}}, "keep['rollout'] must be a list"),
    ({"min_bytes": -1}, "min_bytes must be an integer >= 0"),
    ({"min_bytes": 1.5}, "min_bytes must be an integer"),
    ({"agree_timeout_s": 0}, "agree_timeout_s must be a number > 0"),
    ({"timeout_s": True}, "timeout_s must be a number > 0"),
    ({"host_memory_cap_bytes": -5}, "host_memory_cap_bytes must be an integer >= 0"),
    ({"overlap": "yes"}, "overlap must be True or False"),
    ({"device": -1}, "device must be an integer >= 0"),
    ({"workers": 0}, "workers must be an integer >= 1"),
    ({"backend_options": {"ncc": {}}}, "backend_options has unknown backends ['ncc']"),
])
def test_bad_input_names_the_valid_choices(kwargs, message):
    with pytest.raises(ValueError) as err:
        OffloadPolicy(**kwargs)
    assert message in str(err.value)


def test_unknown_keep_name_lists_known_roles():
    import amem_callbacks.adapters.megatron  # noqa: F401  registers parallel_state's roles

    with pytest.raises(ValueError) as err:
        OffloadPolicy(keep=["mystery"])
    assert "'tp'" in str(err.value) and "name_group" in str(err.value)


def test_a_group_named_by_the_user_can_be_kept():
    from types import SimpleNamespace

    from amem_callbacks import name_group

    with pytest.raises(ValueError):
        OffloadPolicy(keep=["my_sampler_group"])
    name_group(SimpleNamespace(group_name="77"), "my_sampler_group")
    policy = OffloadPolicy(keep={"rollout": ["tp", "my_sampler_group"], "eval": []})
    assert policy.keep_for("rollout") == {"tp", "my_sampler_group"}
    assert policy.keep_for("eval") == frozenset()


def test_bad_phase_names_are_refused():
    policy = OffloadPolicy()
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="a phase is a non-empty string"):
            policy.begin(bad)


def test_before_init_process_group_begin_and_end_do_nothing():
    policy = OffloadPolicy(backend="noop")
    assert policy.begin("rollout").skipped == "torch.distributed is not initialized"
    assert policy.end("rollout").skipped == "torch.distributed is not initialized"
    assert policy.end().skipped == "no phase is active"


def test_import_and_construction_do_not_import_torch():
    code = ("import sys, amem_callbacks; from amem_callbacks import OffloadPolicy;"
            "import amem_callbacks.adapters.megatron; OffloadPolicy(keep=['tp']);"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
