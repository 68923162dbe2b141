"""``OffloadOptions``: every setting of a policy, validated once, in one place.

The policy takes it; every adapter turns its framework's input (TRL keyword
arguments, verl's config keys, Megatron's flags) into it through one table
of names, so a bad value fails the same way, at start-up, whichever door it
came in by, with a message that says what to write instead.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Mapping, Optional

from .backends import backend_class
from .checks import MAX_BYTES, MAX_C_INT, MAX_WAIT_S, MAX_WORKERS, check_bool, check_number, \
    check_phase, check_wait
from .errors import OptionError
from .groups import existing_group_names, registered_roles
from .states import BackendName, GuardMode, backend_name, guard_mode

#: Below this many suspendable bytes a group stays active: a transition costs
#: hundreds of ms per communicator whatever its size (NCCL's barrier, its
#: bookkeeping), and a network group's 12 MiB of socket buffers are not worth it.
DEFAULT_MIN_BYTES = 16 * 2**20
#: Threads per transition: groups suspend side by side, but past 4 threads NCCL's
#: own barriers dominate and more threads gain nothing (docs/evidence.md).
DEFAULT_WORKERS = 4
#: The words ``backend=`` and ``guard=`` take, from their enums (states.py),
#: for argparse ``choices=`` and messages.
BACKEND_CHOICES = BackendName.choices()
GUARD_CHOICES = GuardMode.choices()

#: Numeric options of the backends, checked here beside their own checks:
#: backend -> option -> (minimum, maximum, why the maximum).
BACKEND_NUMBERS = {
    BackendName.AMEM.value: {"group_id": (0, MAX_C_INT, "ncclSetGroupID takes a C int")}}


def _names(name: str, value) -> tuple:
    """A list of group names (not a bare string, which would iterate by letter)."""
    if isinstance(value, str):
        raise OptionError(f"{name} must be a list of group names, e.g. [{value!r}], not a string")
    try:
        names = tuple(value)
    except TypeError:
        raise OptionError(f"{name} must be a list of group names such as ['tp'], "
                          f"got {value!r}") from None
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise OptionError(f"{name} holds {bad!r}: group names are non-empty strings "
                          "such as 'tp' or 'world'")
    return names


def normalise_keep(keep, validate_names: bool = True) -> dict:
    """``keep`` as {phase or "*": frozenset(names)}, checked against known names."""
    if isinstance(keep, Mapping):
        by_phase = dict(keep)
        for phase in by_phase:
            if phase != "*":
                check_phase(phase)
    else:
        by_phase = {"*": keep}
    valid = registered_roles() | existing_group_names()
    out = {}
    for phase, names in by_phase.items():
        label = "keep" if phase == "*" and not isinstance(keep, Mapping) else f"keep[{phase!r}]"
        names = frozenset(_names(label, names))
        unknown = sorted(n for n in names if n not in valid)
        if unknown and validate_names:
            raise OptionError(
                f"unknown group name(s) {unknown} in keep: use group roles {sorted(valid)}, "
                "or name your group first with amem_callbacks.name_group(group, 'name') or "
                "new_group(..., group_desc='name')")
        out[phase] = names
    return out


def _check_backend(backend) -> None:
    if isinstance(backend, str):
        backend_name(backend)
    elif not all(hasattr(backend, a) for a in ("check", "suspend", "resume", "communicator")):
        raise OptionError(f"backend must be one of {BACKEND_CHOICES} or a Backend instance, "
                          f"got {backend!r}")


def _check_backend_options(backend_options) -> dict:
    """Each entry's keys and values against that backend's real constructor."""
    if backend_options is None:
        return {}
    if not isinstance(backend_options, Mapping):
        raise OptionError("backend_options must be a dict such as "
                          "{'nccl': {'path': 'ctypes'}} or {'amem': {'library_path': '/path/"
                          f"libnccl.so.2'}}, got {backend_options!r}")
    unknown = sorted(set(backend_options) - set(BackendName.concrete()))
    if unknown:
        raise OptionError(f"backend_options has unknown backends {unknown}: use "
                          f"{list(BackendName.concrete())}")
    for name, given in backend_options.items():
        if not isinstance(given, Mapping):
            raise OptionError(f"backend_options[{name!r}] must be a dict of that backend's "
                              f"options, got {given!r}")
        cls = backend_class(name)
        accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        extra = sorted(set(given) - set(accepted))
        if extra:
            raise OptionError(f"backend {name!r} has no option(s) {extra}: it takes "
                              f"{accepted or 'no options'}")
        check = getattr(cls, "check_options", None)
        if check is not None:
            try:
                check(**given)
            except ValueError as exc:
                raise OptionError(f"backend_options[{name!r}]: {exc}") from None
        for option, (low, high, why) in BACKEND_NUMBERS.get(name, {}).items():
            if given.get(option) is not None:
                check_number(f"backend_options[{name!r}][{option!r}]", given[option], low,
                             integer=True, maximum=high, why=why)
    return {name: dict(given) for name, given in backend_options.items()}


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """Every setting of an :class:`~amem_callbacks.OffloadPolicy`.

    Args:
        backend: "auto" (nccl, then amem, else leave training untouched),
            "nccl", "amem", "noop" (dry run), or a Backend instance.
        keep: names of groups the phase still uses (roles such as "tp", a
            ``group_desc``, "world"), for every phase; or ``{phase: names}``.
        learn_keep: a group the guard had to resume during a phase stays
            active in that phase from the next ``begin`` on.
        min_bytes: groups with less suspendable NCCL memory stay active.
        need_bytes: the phase needs only this many bytes: suspend the fewest
            groups, largest first, that free them; the rest stay active
            ("not needed"). None: every idle group.
        guard: "resume" (a call on a suspended group resumes it first),
            "strict" (such a call raises), or "off".
        overlap: ``begin``/``end`` return at once and the transition runs in
            the background; a call on a group waits for it (the guard), and
            :meth:`RolloutSession.wait_for_memory` waits for memory.
        workers: threads that suspend/resume the groups of one transition
            concurrently; 1 runs them one after another.
        resume_first: names of groups the program uses first after the
            phase: ``end`` resumes them before the others, so the first
            collective waits for one communicator, not for all.
        timeout_s: longest wait for one suspend/resume; default: the group's
            c10d timeout.
        agree_timeout_s: how long members wait for each other to agree on a
            plan before leaving a group active.
        host_memory_cap_bytes: most bytes NCCL may copy to pinned host memory;
            groups past the cap stay active.
        groups: consider only these process groups (default: all).
        backend_options: per-backend options, checked against that backend:
            ``{"nccl": {"path": "ctypes"}}``, ``{"amem": {"library_path": "...",
            "group_id": 1}}``.
        device: the CUDA device of this rank's communicators; default: the
            current device of the thread that calls the first ``begin``.
        reuse_host_backup: keep the pinned host memory NCCL backs a suspended
            communicator up into, from a resume to the next suspend, instead
            of NCCL pinning and unpinning it every time (the slow part of a
            transition); at most what one begin suspends on this rank.
            ``AMEM_HOST_BACKUP=0`` in the environment also turns it off.

    Example:
        >>> options = OffloadOptions(keep=["tp"], overlap=True)
        >>> policy = OffloadPolicy(options)
    """

    backend: object = "auto"
    keep: Mapping = dataclasses.field(default_factory=dict)
    learn_keep: bool = True
    min_bytes: int = DEFAULT_MIN_BYTES
    need_bytes: Optional[int] = None
    guard: str = "resume"
    overlap: bool = False
    workers: int = DEFAULT_WORKERS
    resume_first: tuple = ()
    timeout_s: Optional[float] = None
    agree_timeout_s: float = 120.0
    host_memory_cap_bytes: Optional[int] = None
    groups: Optional[tuple] = None
    backend_options: Mapping = dataclasses.field(default_factory=dict)
    device: Optional[int] = None
    reuse_host_backup: bool = True

    def __post_init__(self):
        _check_backend(self.backend)
        guard_mode(self.guard)
        self._check_numbers()
        for name in ("overlap", "learn_keep", "reuse_host_backup"):
            check_bool(name, getattr(self, name))
        set_ = object.__setattr__  # frozen: store the normalised forms once
        set_(self, "keep", normalise_keep(self.keep))
        set_(self, "resume_first", _names("resume_first", self.resume_first))
        set_(self, "backend_options", _check_backend_options(self.backend_options))
        if self.groups is not None:
            if isinstance(self.groups, (str, bytes)) or not hasattr(self.groups, "__iter__"):
                raise OptionError("groups must be a list of process groups (e.g. "
                                  f"[dp_group, dp_cp_group]), got {self.groups!r}")
            groups = tuple(self.groups)
            bad = [g for g in groups if g is not None and not hasattr(g, "group_name")]
            if bad:
                raise OptionError(f"groups must hold torch.distributed process groups; "
                                  f"{bad[0]!r} is not one")
            set_(self, "groups", groups)

    def _check_numbers(self) -> None:
        """Type, finiteness and range of every number, each bounded where it stops
        working (see MAX_WAIT_S and the others above)."""
        bytes_ = dict(minimum=0, integer=True, maximum=MAX_BYTES,
                      why="2**63 - 1: NCCL and CUDA count bytes in 64 bits")
        check_number("min_bytes", self.min_bytes, **bytes_)
        check_number("workers", self.workers, minimum=1, integer=True, maximum=MAX_WORKERS,
                     why="past 4 threads NCCL's own barriers dominate")
        # Members wait up to twice agree_timeout_s for a leader's decision.
        check_wait("agree_timeout_s", self.agree_timeout_s, maximum=MAX_WAIT_S / 2,
                   why="half threading.TIMEOUT_MAX: members wait up to twice it")
        if self.timeout_s is not None:
            check_wait("timeout_s", self.timeout_s)
        for name in ("host_memory_cap_bytes", "need_bytes"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), **bytes_)
        if self.device is not None:  # the device count is checked at the first begin
            check_number("device", self.device, minimum=0, integer=True, maximum=MAX_C_INT,
                         why="cudaSetDevice takes a C int")

    @property
    def backend_name(self) -> str:
        return self.backend if isinstance(self.backend, str) else getattr(
            self.backend, "name", type(self.backend).__name__)

    def keep_for(self, phase: str) -> frozenset:
        return self.keep.get(phase, frozenset()) | self.keep.get("*", frozenset())

    def keeping(self, phase: str, names) -> "OffloadOptions":
        """A copy that also keeps ``names`` active during ``phase`` (adapters add the
        groups a framework's rollout itself uses)."""
        keep = {p: set(kept) for p, kept in self.keep.items()}
        keep[phase] = keep.get(phase, set()) | set(names)
        return self.replace(keep={p: sorted(kept) for p, kept in keep.items()})

    def replace(self, **changes) -> "OffloadOptions":
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple:
        return tuple(f.name for f in dataclasses.fields(cls))


def options_from(options: Optional[OffloadOptions], kwargs: dict) -> OffloadOptions:
    """``OffloadPolicy(options)`` or ``OffloadPolicy(**kwargs)``, not both; an unknown
    keyword names the valid ones."""
    if options is not None and not isinstance(options, OffloadOptions):
        hint = (f": a backend goes by keyword, OffloadPolicy(backend={options!r})"
                if isinstance(options, str) or hasattr(options, "suspend") else "")
        raise OptionError(f"OffloadPolicy takes an OffloadOptions or keyword arguments, "
                          f"got {options!r}{hint}")
    unknown = sorted(set(kwargs) - set(OffloadOptions.names()))
    if unknown:
        raise OptionError(f"unknown option(s) {unknown}: OffloadOptions has "
                          f"{list(OffloadOptions.names())}")
    if options is None:
        return OffloadOptions(**kwargs)
    return options.replace(**kwargs) if kwargs else options
