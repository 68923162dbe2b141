"""The public surface (docs/design.md, "The public surface"): one policy object with
few verbs, one seam for the adapters, what a session shows written once."""

import pytest

from amem_callbacks import OffloadOptions, OffloadPolicy, RolloutSession
from amem_callbacks.session import SessionViews

POLICY = {"options", "begin", "start_suspends", "end", "phase", "wait", "close", "metrics",
          "groups", "view", "forget_learned"}
SESSION = {"phase", "history", "waited", "start", "start_suspends", "stop", "settle",
           "wait_for_memory", "freed", "store_exchange", "store_barrier", "tell_headroom",
           "free_here", "start_if_any_rank_fell_short"}
VIEWS = {"policy", "active", "headroom", "last_begin", "last_end", "metrics"}


def public(obj) -> set:
    return {name for name in dir(obj) if not name.startswith("_")}


def test_the_policy_shows_only_its_verbs_and_its_options():
    assert public(OffloadPolicy()) == POLICY


@pytest.mark.parametrize("name", OffloadOptions.names())
def test_an_option_is_read_from_options_never_from_the_policy(name):
    policy = OffloadPolicy(overlap=True)
    getattr(policy.options, name)
    if name not in POLICY:  # groups(): a verb of its own, not the option
        with pytest.raises(AttributeError):
            getattr(policy, name)


@pytest.mark.parametrize("name", ["counters", "inert", "backend", "backend_description",
                                  "last_report", "learned", "active_phase", "keep_for",
                                  "guard_mode", "placement", "wait_for_free", "store_barrier",
                                  "store_exchange"])
def test_what_moved_or_went_private_is_gone_from_the_policy(name):
    with pytest.raises(AttributeError):
        getattr(OffloadPolicy(), name)


def test_the_session_is_the_seam_and_shows_what_a_session_view_shows():
    session = RolloutSession(OffloadPolicy())
    assert public(session) == SESSION | VIEWS
    assert public(SessionViews()) == VIEWS
    # one copy: RolloutSession inherits every view, it writes none of its own
    assert not (set(vars(RolloutSession)) & VIEWS)


def test_before_the_first_begin_a_session_and_an_empty_view_show_nothing():
    policy = OffloadPolicy()
    session = RolloutSession(policy)
    assert session.policy is policy and not session.active and session.metrics() == {}
    assert session.last_begin is None and session.last_end is None and session.headroom is None
    assert session.store_exchange("x", "v") == ({}, []) and session.store_barrier("x") == []
    assert session.wait_for_memory() == 0 and session.freed().done
    view = SessionViews()  # an adapter before it made its session
    assert view.policy is None and not view.active and view.metrics() == {}
    assert view.last_begin is None and view.last_end is None and view.headroom is None


@pytest.mark.parametrize("nbytes, timeout_s", [(-1, None), (2**63, None), (1.5, None),
                                               (None, 0), (None, float("inf"))])
def test_the_memory_wait_checks_its_arguments(nbytes, timeout_s):
    with pytest.raises(ValueError):
        RolloutSession(OffloadPolicy()).wait_for_memory(nbytes, timeout_s)
