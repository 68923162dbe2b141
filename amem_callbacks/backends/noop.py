"""The dry-run backend: plans, agrees and reports, but frees nothing."""

from __future__ import annotations

from .base import Backend


class NoopBackend(Backend):
    """Treats every process group as a candidate and suspends nothing.

    Chosen by name it runs the whole policy (plan, rank agreement, guard,
    report) so a CPU machine can show what would happen. When ``auto`` falls
    back to it because nothing else works, the policy does not even plan:
    training then runs exactly as without the package.
    """

    name = "noop"
    dry_run = True

    def check(self) -> str:
        return "dry run: nothing is freed, groups are only reported"

    def communicator(self, group) -> tuple:
        return group, None

    def suspend(self, handle) -> None:
        return None

    def resume(self, handle) -> None:
        return None
