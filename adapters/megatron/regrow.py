"""Growing the KV cache between two engine steps, with the engine's own recompute-mode
suspend and resume (megatron-core 0.19.2; why this and not a virtual-memory buffer:
docs/megatron.md, "No wait for the suspends").

In recompute mode ``suspend()`` frees the context's tensors, deletes the CUDA graphs and
checkpoints every in-flight request (its prompt becomes prompt + tokens generated so
far) into ``resume_request_ids``; ``resume()`` re-allocates from the block allocator,
recaptures the graphs and re-adds those requests, which are prefilled again. That is
the path Megatron takes at every rollout boundary; here it runs once mid-rollout, at a
step boundary, with a bigger allocator and ``max_requests`` installed in between.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from amem_callbacks.memory import empty_cache

#: set on an engine while it is re-grown: the rollout hooks must not take its
#: suspend and resume for the rollout's end and the next rollout's start
MARK = "_amem_regrowing"


def is_regrowing(engine) -> bool:
    return bool(getattr(engine, MARK, False))


def why_not_now(engine) -> Optional[str]:
    """None at a safe point between steps; else why not (the same on every rank of a
    replica: they run the same steps)."""
    name = getattr(getattr(engine, "state", None), "name", None)
    if name is not None and name != "RUNNING":
        return f"the engine is {name.lower()}"
    if name is None and getattr(engine, "is_suspended", False):
        return "the engine is suspended"
    pending = getattr(getattr(engine, "controller", None), "_async_sched_logits", None)
    if getattr(pending, "is_valid", False):
        # async scheduling keeps the previous step's logits for the next one
        return "an overlapped step's logits are still pending"
    return None


def regrow(engine, resize: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> float:
    """Suspend the engine, ``resize()`` its context, resume it; returns the seconds it
    took. Collective over the replica's ranks (the graph capture runs the model): call
    it at the same step on each."""
    began = clock()
    state = getattr(engine, "state", None)  # 0.17+; 0.16 keeps is_suspended, set by both calls
    setattr(engine, MARK, True)
    try:
        engine.suspend()
        empty_cache()  # the old cache's blocks, for the bigger one
        resize()
        if state is not None:
            # With the coordinator, suspend()/resume() leave the state to the engine
            # loop, and resume() returns at once unless the state says suspended.
            engine.state = type(state)["SUSPENDED"]
        engine.resume()
    finally:
        if state is not None:
            engine.state = state  # the loop goes on stepping
        setattr(engine, MARK, False)
    return clock() - began
