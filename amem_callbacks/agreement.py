"""Members of each group agree on its plan over the c10d store, never over the
NCCL communicator that is about to be suspended.

For each group and round: every member writes its vote; the lowest member
(the leader) waits for all votes up to a deadline and writes the decision with
an atomic ``compare_set``; a member that hears nothing from the leader in time
writes "keep" with the same ``compare_set``. Whoever writes first wins and every
member reads the one stored value, so all members act alike even when a rank is
late, missing or dead, and nobody waits longer than about twice the timeout.
"""

from __future__ import annotations

import collections
import time

from .states import Verdict

# A vote, and an agreed value, is one store string "<verdict>|<detail>": for
# SUSPEND the backend name, then ";bytes=N" (this rank's suspendable bytes, for
# the order) and ";first=1" (resume it before the others) where they apply;
# for KEEP the reason.


#: what a member seals into a peer's exchange slot after waiting for it in vain
MISSING = "\x00missing"
#: a wait checks the store after this long, then twice as long each time, up to the
#: most (a check is one short request, so each costs the store little)
POLL_FIRST_S, POLL_MAX_S = 0.0005, 0.005


def vote_suspend(backend_name: str, nbytes=None, first: bool = False) -> str:
    extra = "" if nbytes is None else f";bytes={int(nbytes)}"
    return f"{Verdict.SUSPEND.value}|{backend_name}{extra}{';first=1' if first else ''}"


def suspend_details(value: str) -> dict:
    """``{"backend": ..., "bytes": int or None, "first": bool}`` of a suspend value."""
    backend, *fields = reason_of(value).split(";")
    pairs = dict(f.split("=", 1) for f in fields if "=" in f)
    return {"backend": backend, "bytes": int(pairs["bytes"]) if "bytes" in pairs else None,
            "first": pairs.get("first") == "1"}


def vote_keep(reason: str) -> str:
    return f"{Verdict.KEEP.value}|{reason}"


def verdict_of(value: str) -> Verdict:
    return Verdict.SUSPEND if value.split("|", 1)[0] == Verdict.SUSPEND.value else Verdict.KEEP


def reason_of(value: str) -> str:
    return value.split("|", 1)[1] if "|" in value else value


class Agreement:
    """Store-based agreement for groups of ranks; every method is bounded in time.

    Args:
        store: a c10d Store shared by all ranks (the default group's store).
        rank: this process's global rank.
        timeout_s: how long a leader waits for votes, and a member for outcomes.
    """

    def __init__(self, store, rank: int, timeout_s: float, namespace: str = "amem_callbacks",
                 rounds: collections.Counter = None):
        self.store = store
        self.rank = rank
        self.timeout_s = timeout_s
        self.namespace = namespace
        self._rounds = rounds if rounds is not None else collections.Counter()

    def _base(self, topic: str, key: str) -> tuple:
        round_no = self._rounds[(topic, key)]
        self._rounds[(topic, key)] += 1
        return f"{self.namespace}/{topic}/{key}/{round_no}", round_no

    def _wait(self, keys, deadline: float) -> bool:
        """Whether every key is set by ``deadline``, asking with non-blocking checks.
        Not ``store.wait``: a TCPStore client runs one request at a time, so a wait
        in one thread (an overlapped begin's outcome round) held back the writes of
        the process's other thread (the KV growth's round), whose peer waited for
        them in turn: both stood still until the timeout (tests/test_agreement.py)."""
        pause = POLL_FIRST_S
        while not self.store.check(keys):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(pause, remaining))
            pause = min(2 * pause, POLL_MAX_S)
        return True

    def _forget(self, topic: str, key: str, round_no: int, members) -> None:
        """The leader drops round ``round_no - 2``: every member left it long ago."""
        old = round_no - 2
        if old < 0 or self.rank != min(members):
            return
        base = f"{self.namespace}/{topic}/{key}/{old}"
        for name in [f"{base}/decision"] + [f"{base}/{r}" for r in members]:
            try:
                self.store.delete_key(name)
            except RuntimeError:
                pass

    def decide(self, proposals: dict) -> dict:
        """Collective over each group's members: agree on suspending it.

        Args:
            proposals: group key -> ``(member ranks, this rank's vote)``.
        Returns:
            group key -> the agreed value (``"suspend|backend"`` or
            ``"keep|reason"``), identical on every member.
        """
        start = time.monotonic()
        bases = {}
        for key, (members, vote) in proposals.items():
            base, round_no = self._base("plan", key)
            bases[key] = base
            self.store.set(f"{base}/{self.rank}", vote)
            self._forget("plan", key, round_no, members)

        vote_deadline = start + self.timeout_s
        for key, (members, _vote) in proposals.items():
            if self.rank != min(members):
                continue
            base = bases[key]
            vote_keys = [f"{base}/{r}" for r in members]
            if self._wait(vote_keys, vote_deadline):
                votes = dict(zip(members, (v.decode() for v in self.store.multi_get(vote_keys))))
                decision = _combine(votes)
            else:
                late = [r for r, k in zip(members, vote_keys) if not self.store.check([k])]
                decision = vote_keep(f"rank(s) {late} did not reach this transition within "
                                   f"{self.timeout_s:g} s")
            self.store.compare_set(f"{base}/decision", "", decision)

        decisions = {}
        member_deadline = start + 2 * self.timeout_s
        for key, (members, _vote) in proposals.items():
            dkey = f"{bases[key]}/decision"
            if not self._wait([dkey], member_deadline):
                self.store.compare_set(
                    dkey, "", vote_keep(f"leader rank {min(members)} did not decide within "
                                      f"{2 * self.timeout_s:g} s"))
            decisions[key] = self.store.get(dkey).decode()
        return decisions

    def exchange(self, values: dict) -> dict:
        """Collective over each group's members: share one string, bounded wait.

        Returns group key -> {rank: value or None if it did not arrive in time},
        the same on every member: each member's slot is written with an atomic
        ``compare_set``, and a member that waited for a slot in vain seals it
        as missing the same way. Whoever writes a slot first wins, so a rank
        that arrives after its peers gave up on it reads itself missing too
        instead of a set of values they never saw, and all act alike.
        """
        deadline = time.monotonic() + self.timeout_s
        bases = {}
        for key, (members, value) in values.items():
            base, round_no = self._base("outcome", key)
            bases[key] = base
            self.store.compare_set(f"{base}/{self.rank}", "", value)
            self._forget("outcome", key, round_no, members)
        result = {}
        for key, (members, _value) in values.items():
            keys = [f"{bases[key]}/{r}" for r in members]
            if not self._wait(keys, deadline):
                for slot in keys:
                    if not self.store.check([slot]):
                        self.store.compare_set(slot, "", MISSING)
            got = [v.decode() for v in self.store.multi_get(keys)]
            result[key] = {r: (None if v == MISSING else v) for r, v in zip(members, got)}
        return result

    def share(self, name: str, value: str, members) -> tuple:
        """Collective over ``members``: share one string under ``name`` (an
        adapter's own round: a barrier, the KV growth's sizes), bounded like
        :meth:`exchange`. Returns ``({rank: value}, [ranks that did not arrive
        in time])``, the same on every member."""
        key = f"__exchange__/{name}"
        seen = self.exchange({key: (tuple(sorted(members)), value)})[key]
        return ({r: v for r, v in seen.items() if v is not None},
                [r for r, v in seen.items() if v is None])


# Round numbers must continue across every policy of a process: two policies
# that started both at round 0 would read each other's stored decisions, and a
# rank whose plan keeps a group could meet a peer that read a stale "suspend"
# (measured: a suspend waiting forever for its peer). Every rank makes the same
# collective calls in the same order, whatever policy object makes them.
_shared_rounds: dict = {}  # the default process group -> its round counter


def shared_rounds(default_group) -> collections.Counter:
    """The round counter of every Agreement over ``default_group``'s store."""
    for group, rounds in _shared_rounds.items():
        if group is default_group:
            return rounds
    _shared_rounds.clear()  # a new default group (re-initialised): a new store, start again
    rounds = _shared_rounds[default_group] = collections.Counter()
    return rounds


def _combine(votes: dict) -> str:
    """All members say suspend with the same backend -> suspend; else keep, saying why."""
    refusals = [f"rank {r}: {reason_of(v)}" for r, v in sorted(votes.items()) 
                if verdict_of(v) is not Verdict.SUSPEND]
    if refusals:
        return vote_keep("; ".join(refusals))
    details = [suspend_details(v) for v in votes.values()]
    backends = {d["backend"] for d in details}
    if len(backends) > 1:
        return vote_keep(f"ranks use different backends {sorted(backends)}")
    # Every member reads this one value, so the order built from it (largest
    # first) and the resume tier are the same on every rank.
    sizes = [d["bytes"] for d in details if d["bytes"] is not None]
    return vote_suspend(backends.pop(), min(sizes) if sizes else None,
                        any(d["first"] for d in details))
