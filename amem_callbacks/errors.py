"""Exceptions raised by amem_callbacks; each message says what to do."""


class AmemError(RuntimeError):
    """Base class of every error this package raises on purpose."""


class OptionError(AmemError, ValueError):
    """A setting has a wrong name, type or value; the message says what to write."""


class NcclError(AmemError):
    """An NCCL call returned something other than ncclSuccess."""

    def __init__(self, call: str, code: int, text: str):
        super().__init__(f"{call} failed: {text} (ncclResult_t {code})")
        self.call = call
        self.code = code


class BackendUnavailable(AmemError):
    """A backend cannot work in this process; ``fix`` says how to make it work."""

    def __init__(self, reason: str, fix: str = ""):
        super().__init__(reason + (f" Fix: {fix}" if fix else ""))
        self.reason = reason
        self.fix = fix


class SuspendedGroupError(AmemError):
    """An operation was issued on a suspended group and could not be resumed safely."""


class TransitionTimeout(AmemError):
    """A suspend or resume did not finish in time (a peer rank is missing or dead)."""


class AdapterError(AmemError):
    """A framework adapter cannot serve this job (it cannot find or hook what it needs)."""


class PhaseError(AmemError, ValueError):
    """``begin``/``end``/``phase()`` called out of order (a phase entered while one
    is open, an ``end`` naming another phase); the open phase stays as it was."""


class TransitionError(AmemError):
    """A ``begin`` or ``end`` failed partway; the message names every group this
    rank still holds suspended (no phase is left open)."""
