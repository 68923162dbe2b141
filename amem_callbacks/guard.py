"""Stops collectives from reaching a suspended communicator.

NCCL does not check whether a communicator is suspended; a collective on one
is undefined behaviour (measured: an illegal memory access that kills every
rank). While any group is suspended, the guard wraps the communication
methods of ``torch.distributed.ProcessGroup`` at class level; a call on a
watched group first asks its owner (the transitions engine) to make it
usable, which waits for its resume, resumes it, or raises.

Why the class methods and not the ``torch.distributed`` functions: every
Python path ends in them. ``dist.all_reduce`` calls ``group.allreduce``;
names bound at import (Megatron's ``dist_all_gather_func =
torch.distributed.all_gather_into_tensor``) still end there; the coalescing
manager's fast path calls ``group.allgather_into_tensor_coalesced`` (torch
2.11) or ``group.all_gather_single_coalesced`` (2.13) itself; the object
collectives, ``batch_isend_irecv`` and ``isend``/``irecv`` all arrive as
method calls. Wrapping module functions also broke torch's identity checks
(``op0 is all_reduce`` in the coalescing manager, ``P2POp``'s ``isend``),
which a method wrapper never touches.

Not covered, because they enter C++ without a Python method call: DDP's
C++ reducer (gradient all-reduce, ``_broadcast_coalesced``), functional
collectives (``torch.ops._c10d_functional``: DTensor redistribution,
torch.compile), and methods of a backend object (``pg._get_backend(dev)``).
Callers whose next collectives take those paths must wait for the resume
before running them (:meth:`RolloutSession.stop` does unless told
otherwise); ``docs/design.md`` lists, per framework, which path each of its
collectives takes.

The wrappers exist only while some group is watched: between phases torch's
own methods are back in place and cost nothing.
"""

from __future__ import annotations

import enum
import functools
import threading
from typing import Protocol

from .patching import mark


class CallKind(str, enum.Enum):
    """What a guarded call does to its group."""

    COLLECTIVE = "collective"
    P2P = "p2p"
    CREATE = "create"
    DESTROY = "destroy"


class GroupOwner(Protocol):
    """What the guard needs from whoever watches a group (the transitions engine)."""

    def before_use(self, group, kind: CallKind, call: str) -> None:
        """Make ``group`` usable before ``call`` runs on it, or raise with the fix."""

    def forget(self, group) -> None:
        """``group`` is being destroyed: never touch it again."""


#: ProcessGroup method -> what it does to the group. Names differ between
#: torch releases (``_allgather_base`` became ``all_gather_single``); those a
#: release lacks are skipped.
GUARDED_METHODS = {
    **{name: CallKind.COLLECTIVE for name in (
        "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
        "_allgather_base", "all_gather_single", "allgather_into_tensor_coalesced",
        "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base",
        "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
        "reduce_scatter_single_coalesced", "alltoall", "alltoall_base", "all_to_all_single",
        "broadcast", "reduce", "gather", "scatter", "barrier", "monitored_barrier")},
    # Not _start_coalescing/_end_coalescing: they bracket collective batches and
    # point-to-point batches alike, so the guard cannot tell whether every member
    # calls them; the operations inside (or the *_coalesced call at the exit) are
    # checked one by one, each with its own kind.
    **{name: CallKind.P2P for name in ("send", "recv", "recv_anysource")},
    # ncclCommSplit runs on the parent's communicator: it must be active.
    **{name: CallKind.CREATE for name in ("split_group", "merge_remote_group")},
    **{name: CallKind.DESTROY for name in ("abort", "shutdown")},
}

#: torch.distributed functions that create or destroy groups: a new group may
#: be split from the default group's communicator, and a destroyed group must
#: never be resumed later. No torch code compares these by identity.
GUARDED_FUNCTIONS = {
    "new_group": CallKind.CREATE,
    "destroy_process_group": CallKind.DESTROY,  # its group: the "group" argument, or all
}

# process group -> the tuple of its GroupOwners (several policies may hold one group
# at once, e.g. one's overlapped end still running while another begins). Empty
# whenever nothing is suspended: the fast path. Tuples, replaced under the lock, so
# the wrappers read them without it.
_guarded: dict = {}
_lock = threading.Lock()
_installed: list = []  # (owner object, attribute name, what was there, the wrapper)


def watch(group, owner: GroupOwner) -> None:
    """Route calls on ``group`` through ``owner`` (besides any other owner of
    it); wraps on first use."""
    install()
    with _lock:
        owners = _guarded.get(group, ())
        if not any(o is owner for o in owners):
            _guarded[group] = owners + (owner,)


def unwatch(group, owner: GroupOwner) -> None:
    """Stop routing ``group`` through ``owner``; another owner's hold stays. With
    nothing left to watch, the originals come back, so training between phases
    runs on torch's methods untouched."""
    with _lock:
        owners = tuple(o for o in _guarded.get(group, ()) if o is not owner)
        if owners:
            _guarded[group] = owners
        else:
            _guarded.pop(group, None)
        empty = not _guarded
    if empty:
        uninstall()


def watched() -> list:
    """The groups the guard routes now (tests read it: a finished run leaves none)."""
    with _lock:
        return list(_guarded)


def _check(call: str, kind: CallKind, group) -> None:
    for owner in _guarded.get(group, ()):
        owner.before_use(group, kind, call)


def _method_wrapper(name: str, kind: CallKind, original):
    """A call on a watched group asks its owner first; any other call costs one
    truth test (``_guarded`` is empty between phases: the wrapper is not even
    installed then) or one dict lookup."""
    if kind is CallKind.DESTROY:
        def guarded(self, *args, **kwargs):
            for owner in _guarded.get(self, ()) if _guarded else ():
                owner.forget(self)
            return original(self, *args, **kwargs)
    else:
        def guarded(self, *args, **kwargs):
            if _guarded:
                for owner in _guarded.get(self, ()):
                    owner.before_use(self, kind, name)
            return original(self, *args, **kwargs)
    guarded.__name__ = guarded.__qualname__ = name
    mark(guarded, original)  # patching's marker: a wrapper, never wrapped twice
    return guarded


def _function_wrapper(name: str, kind: CallKind, original):
    @functools.wraps(original)
    def guarded(*args, **kwargs):
        if _guarded:
            if kind is CallKind.CREATE:
                # Only the new group's members call it: not a collective on the parent.
                if not kwargs.get("use_local_synchronization"):
                    _check(name, CallKind.CREATE, _default_group())
            else:
                group = kwargs.get("group", args[0] if args else None)
                targets = list(_guarded) if group is None else [group]
                for target in targets:
                    for owner in _guarded.get(target, ()):
                        owner.forget(target)
        return original(*args, **kwargs)

    mark(guarded, original)  # patching's marker: a wrapper, never wrapped twice
    return guarded


def _default_group():
    from torch.distributed import distributed_c10d as c10d  # light import: torch

    return c10d._get_default_group()


def install() -> None:
    """Wrap the guarded methods and functions (idempotent)."""
    import torch.distributed as dist  # light import: torch (both)
    from torch.distributed import distributed_c10d as c10d

    with _lock:
        if _installed:
            return
        cls = dist.ProcessGroup
        for name, kind in GUARDED_METHODS.items():
            if name not in cls.__dict__:
                continue
            raw = cls.__dict__[name]  # the descriptor itself, restored as it was
            wrapper = _method_wrapper(name, kind, getattr(cls, name))
            setattr(cls, name, wrapper)
            _installed.append((cls, name, raw, wrapper))
        for name, kind in GUARDED_FUNCTIONS.items():
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            wrapper = _function_wrapper(name, kind, fn)
            for module in (c10d, dist):
                if getattr(module, name, None) is fn:
                    setattr(module, name, wrapper)
                    _installed.append((module, name, fn, wrapper))


def uninstall() -> None:
    """Put back what was there (only where our wrapper is still in place)."""
    with _lock:
        for owner, name, original, wrapper in reversed(_installed):
            current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(
                owner, name, None)
            if current is wrapper:
                setattr(owner, name, original)
        _installed.clear()
