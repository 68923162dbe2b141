"""One random program of phase changes, collectives and waits, shared by the
CPU interleaving scenario and the GPU reliability suite."""

from __future__ import annotations

import time

CHOICES = ("phase", "call", "call", "call", "wait")


def run_random_program(policy, groups: dict, exact, same, jitter, actions: int,
                       max_sleep_s: float) -> tuple:
    """Run ``actions`` steps: begin/end, an exact-checked collective on a random
    group, or ``policy.wait()``. ``same`` is seeded alike on every rank (so all
    ranks issue the same collective calls in the same order); ``jitter`` differs
    per rank and shifts the timing; the policy's phase must be closed at the start.
    Returns ``(trace, exact results)``."""
    trace, results = [], []
    open_ = False  # the program's own account of its phase: it alone calls begin and end
    for _ in range(actions):
        choice = same.choice(CHOICES)
        if choice == "phase":
            trace.append("end" if open_ else "begin")
            (policy.end if open_ else policy.begin)("rollout")
            open_ = not open_
        elif choice == "call":
            name = same.choice(sorted(groups))
            results.append(exact(groups[name], same.randint(1, 9)))
            trace.append(name)
        else:
            policy.wait()
            trace.append("wait")
        time.sleep(jitter.random() * max_sleep_s)
    return trace, results
