"""Exceptions raised by amem_callbacks; each message says what to do."""


class AmemError(RuntimeError):
    """Base class of every error this package raises on purpose."""


class OptionError(AmemError, ValueError):
    """A setting has a wrong name, type or value; the message says what to write."""


class NcclError(AmemError):
    """An NCCL call returned something other than ncclSuccess."""

    #: ncclInvalidArgument, ncclInvalidUsage: NCCL refused the call in its own checks
    USAGE_CODES = (4, 5)

    def __init__(self, call: str, code: int, text: str):
        super().__init__(f"{call} failed: {text} (ncclResult_t {code})")
        self.call = call
        self.code = code


def suspend_left_comm_as_it_was(exc: BaseException) -> bool:
    """Whether a failed suspend cannot have changed the communicator: the package's own
    checks (raised before any NCCL call) and NCCL's usage errors, whose checks all run
    before the members meet. Any other error (a host backup that could not be allocated,
    a copy that failed) may come after they met, where NCCL has no rollback: the
    communicator is then partly offloaded, its peers' mappings gone, its suspended flag
    unset, and a resume refuses it (NCCL 2.30.7 src/mem_manager.cc, ncclCommMemSuspend
    and ncclCommMemResume). torch's own suspend() gives no code: not known, so not as it was."""
    if isinstance(exc, NcclError):
        return exc.code in NcclError.USAGE_CODES
    return isinstance(exc, AmemError)


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
