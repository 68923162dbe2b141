"""What every backend provides; the policy talks to backends only through this."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class CommMemory:
    """NCCL's own account of one communicator's device memory, in bytes."""

    suspendable: int
    persist: int
    total: int
    suspended: bool
    #: bytes of the group's other communicators that this backend cannot
    #: reach (nccl-lazy's per-peer ones), and why; they stay allocated
    unreached_bytes: int = 0
    unreached_why: str = ""


class Backend:
    """Suspends and resumes the communicators behind process groups.

    A backend is picked once per process; ``check`` says whether it can work
    here and raises :class:`~amem_callbacks.errors.BackendUnavailable` (with a
    fix) when it cannot.
    """

    name = "base"
    #: True when one pause covers every communicator of the process (AMem), so
    #: individual groups cannot be kept active.
    process_wide = False
    #: True when the backend frees nothing and only reports (dry run).
    dry_run = False

    def check(self) -> str:
        """Raise BackendUnavailable, or return a one-line description for the log."""
        raise NotImplementedError

    def communicator(self, group) -> tuple:
        """``(handle, None)`` for a group this backend can act on, else ``(None, why)``."""
        raise NotImplementedError

    def holds_gil(self, handle) -> bool:
        """True when suspend/resume of ``handle`` keep the GIL for the whole NCCL
        call (torch's own methods): the policy then runs them one at a time and
        waits for them, since no Python thread could overlap them anyway."""
        return False

    def path_of(self, handle) -> str:
        """How this backend reaches ``handle`` (for reports and the doctor)."""
        return self.name

    def memory(self, handle) -> Optional[CommMemory]:
        """NCCL's memory stats for one communicator, or None if unknown."""
        return None

    def suspend(self, handle) -> None:
        """Collective over the communicator's ranks: free its device memory."""
        raise NotImplementedError

    def resume(self, handle) -> None:
        """Collective over the communicator's ranks: bring its memory back."""
        raise NotImplementedError
