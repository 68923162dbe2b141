"""Bad input fails at construction, naming what to write; import stays light."""

import subprocess
import sys

import pytest

from amem_callbacks import OffloadPolicy, RolloutSession


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
    ({"backend_options": {"nccl": 3}}, "backend_options['nccl'] must be a dict"),
    ({"backend_options": {"nccl": {"bogus": 1}}}, "backend 'nccl' has no option(s) ['bogus']"),
    ({"backend_options": {"nccl": {"path": "fast"}}}, "unknown nccl path 'fast'"),
    ({"backend_options": {"amem": {"group_id": -2}}}, "group_id must be an integer >= 0"),
    ({"backend_options": {"noop": {"x": 1}}}, "backend 'noop' has no option(s) ['x']"),
    ({"backend_options": []}, "backend_options must be a dict"),
    ({"keep": 5}, "keep must be a list of group names"),
    ({"keep": [5]}, "group names are non-empty strings"),
    ({"keep": {"": ["tp"]}}, "a phase is a non-empty string"),
    ({"groups": 5}, "groups must be a list of process groups"),
    ({"groups": "tp"}, "groups must be a list of process groups"),
    ({"groups": ["tp"]}, "groups must hold torch.distributed process groups"),
    ({"need_bytes": -1}, "need_bytes must be an integer >= 0"),
    ({"resume_first": "world"}, "resume_first must be a list of group names"),
    ({"learn_keep": 1}, "learn_keep must be True or False"),
    ({"workers": 2.0}, "workers must be an integer"),
    ({"bogus": 1}, "unknown option(s) ['bogus']: OffloadOptions has"),
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
    assert policy.options.keep_for("rollout") == {"tp", "my_sampler_group"}
    assert policy.options.keep_for("eval") == frozenset()


def test_bad_phase_names_are_refused():
    policy = OffloadPolicy()
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="a phase is a non-empty string"):
            policy.begin(bad)


def test_every_bad_input_is_an_amem_error_and_a_value_error():
    from amem_callbacks import AmemError, OptionError

    with pytest.raises(OptionError) as err:
        OffloadPolicy(keep=5)
    assert isinstance(err.value, AmemError) and isinstance(err.value, ValueError)


def test_options_object_or_keywords_and_not_a_stray_positional():
    from amem_callbacks import OffloadOptions

    options = OffloadOptions(keep=["world"], overlap=True)
    assert OffloadPolicy(options).options.overlap and OffloadPolicy(overlap=True).options.overlap
    with pytest.raises(AttributeError):  # options are read from policy.options only
        OffloadPolicy(overlap=True).overlap
    assert OffloadPolicy(options, min_bytes=0).options.keep_for("x") == {"world"}
    with pytest.raises(ValueError, match=r"by keyword, OffloadPolicy\(backend='noop'\)"):
        OffloadPolicy("noop")
    with pytest.raises(ValueError, match="takes an OffloadOptions or keyword arguments"):
        OffloadPolicy(5)
    with pytest.raises(AttributeError):
        OffloadOptions(keep=["world"]).keep = []  # frozen


def test_name_group_refuses_what_is_not_a_group():
    from amem_callbacks import name_group

    with pytest.raises(ValueError, match="name_group needs a process group"):
        name_group(None, "tp")
    with pytest.raises(ValueError, match="a group role must be a non-empty string"):
        name_group(None, "")


def test_before_init_process_group_begin_warns_once_and_leaves_no_phase(caplog, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # one process of a launched job: the advice applies
    policy = OffloadPolicy(backend="noop")
    with caplog.at_level("WARNING", logger="amem_callbacks"):
        first = policy.begin("rollout")
        second = policy.begin("rollout")
    assert "call init_process_group before begin()" in first.skipped
    # no phase opened: the second begin was not refused as "already active"
    assert not RolloutSession(policy).active and second.skipped == first.skipped
    assert len([r for r in caplog.records if "init_process_group" in r.getMessage()]) == 1
    assert policy.end("rollout").skipped == "no phase is active"
    assert policy.end().skipped == "no phase is active"


def test_import_and_construction_do_not_import_torch():
    code = ("import sys, amem_callbacks; from amem_callbacks import OffloadPolicy;"
            "import amem_callbacks.adapters.megatron; OffloadPolicy(keep=['tp']);"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
