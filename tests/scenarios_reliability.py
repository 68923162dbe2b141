"""Reliability scenarios on gloo ranks with the fake NCCL (run by tests.harness)."""

from __future__ import annotations

import logging
import os
import threading
import time

import torch
import torch.distributed as dist

from amem_callbacks import OffloadPolicy
from amem_callbacks.errors import TransitionTimeout
from amem_callbacks.memory import host_rss_bytes
from tests.scenarios import FakeNccl, allreduce_ok, init, is_inert, make_groups, rank, summarize, \
    total, totals

MiB = 2**20


def rank_dies(args):
    """A peer dies while groups are suspended: the survivor's end() fails with a
    timeout naming the groups instead of hanging. The fake resume blocks as
    NCCL's would, waiting in its barrier for the dead peer."""
    init()
    groups = make_groups(dist.get_world_size())
    fake = FakeNccl()
    policy = OffloadPolicy(backend=fake.backend(), keep=["tp"], agree_timeout_s=2,
                           timeout_s=args.get("timeout_s", 2))
    policy.begin("rollout")
    if rank() == 1:
        os._exit(0)  # dies mid-phase, without a word
    for g in groups.values():
        fake.controls.delay(fake.handle_of(g)[0], 60_000_000)  # "waits for the peer"
    start = time.monotonic()
    try:
        policy.end("rollout")
        return {"error_message": None}
    except TransitionTimeout as exc:
        return {"error_message": str(exc), "took": time.monotonic() - start}


def cycles_flat(args):
    """Many begin/end cycles: host memory, threads and store keys stay flat."""
    init()
    groups = make_groups(dist.get_world_size())
    fake = FakeNccl()
    policy = OffloadPolicy(backend=fake.backend(), keep=["tp"], agree_timeout_s=20)
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    samples = {}
    for cycle in range(1, args["cycles"] + 1):
        policy.begin("rollout")
        allreduce_ok(groups["tp"])
        policy.end("rollout")
        if cycle in (args["warmup"], args["cycles"]):
            samples[cycle] = {"rss": host_rss_bytes(), "threads": threading.active_count(),
                              "store_keys": store.num_keys()}
    return {"samples": samples, "exact": all(allreduce_ok(g) for g in groups.values()),
            "counters": totals(policy)}


def ddp_identical(args):
    """A small DDP run with and without offload, same seeds: identical losses and
    parameters (the policy and its guard must not perturb training)."""
    init()
    fake = FakeNccl()

    def train(with_policy: bool):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        policy = OffloadPolicy(backend=fake.backend(), agree_timeout_s=20) if with_policy else None
        data = torch.Generator().manual_seed(rank())
        losses = []
        for _step in range(args.get("steps", 8)):
            x = torch.randn(16, 32, generator=data)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if policy is not None:
                policy.begin("rollout")
                torch.randn(64, 64) @ torch.randn(64, 64)  # "generation"
                policy.end("rollout")
        params = [p.detach().clone() for p in model.parameters()]
        return losses, params, policy

    base_losses, base_params, _ = train(False)
    losses, params, policy = train(True)
    return {"losses_equal": losses == base_losses,
            "params_equal": all(torch.equal(a, b) for a, b in zip(params, base_params)),
            "suspends": total(policy, "group_suspends"), "losses": losses}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def unusable(args):
    """Each way a backend cannot work: one clear line with the fix, training unchanged."""
    from amem_callbacks.backends.amem import AmemBackend
    from amem_callbacks.backends.nccl import NcclBackend

    init()
    groups = make_groups(dist.get_world_size())
    case = args["case"]
    if case == "old_nccl":
        backend = FakeNccl("old").backend()
    elif case == "cumem_off":
        os.environ["NCCL_CUMEM_ENABLE"] = "0"
        backend = FakeNccl().backend()
    elif case == "amem_missing":
        plain = FakeNccl()
        backend = AmemBackend(library=plain.library, handle_of=plain.handle_of)
    elif case == "amem_wrong_path":
        plain = FakeNccl()
        backend = AmemBackend(library_path="/nonexistent/amem/libnccl.so.2",
                              library=plain.library, handle_of=plain.handle_of)
    elif case == "auto_cpu":
        backend = "auto"
    else:
        raise ValueError(case)
    lines = _Lines()
    logging.getLogger("amem_callbacks").addHandler(lines)
    policy = OffloadPolicy(backend=backend, agree_timeout_s=20)
    for _ in range(3):
        begin = policy.begin("rollout")
        exact = allreduce_ok(groups["dp"])
        policy.end("rollout")
    assert isinstance(backend, str) or isinstance(backend, (NcclBackend, AmemBackend))
    warnings = [m for level, m in lines.lines if level in ("WARNING", "ERROR")]
    return {"inert": is_inert(policy), "skipped": begin.skipped, "warnings": warnings,
            "exact": exact and all(allreduce_ok(g) for g in groups.values())}


def host_cap(args):
    """A cap on NCCL's pinned host backups leaves the groups past it active."""
    init()
    groups = make_groups(dist.get_world_size())
    fake = FakeNccl(default_mib=480)
    policy = OffloadPolicy(backend=fake.backend(), host_memory_cap_bytes=1000 * MiB,
                           agree_timeout_s=20)
    begin = policy.begin("rollout")
    during = fake.suspended()
    policy.end("rollout")
    return {"begin": summarize(begin), "during": during,
            "bytes": {g.name: g.suspendable_bytes for g in begin.groups},
            "exact": all(allreduce_ok(g) for g in groups.values())}
