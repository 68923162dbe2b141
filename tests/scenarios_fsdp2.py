"""FSDP2 (``fully_shard``) with forward prefetch under the fake NCCL's tripwire:
the paths verl's FSDP2 engine and TRL's FSDP2/HSDP take, on 4 gloo ranks.

Each step: a rollout (idle, as a verl training worker is while the servers
generate; or a no-grad forward of the model itself, as TRL's transformers
generation is), then a training step that starts while the resumes are still
running (overlapped ``end``, no wait). FSDP2's prefetched all-gathers, its
reduce-scatters and HSDP's replicate all-reduce must each wait for their own
group (the guard); one that reached a suspended communicator would end the
rank (tripwire). Run by tests/test_fsdp2_paths.py through tests.harness.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from amem_callbacks import OffloadPolicy, RolloutSession, name_group
from tests.scenarios import FakeNccl, init, summarize

WIDTH = 16


def _build(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for layer, following in zip(model[:-1], model[1:]):
        layer.set_modules_to_forward_prefetch([following])  # the next layer's gather starts early
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _train_step(model, optimizer, step: int) -> float:
    torch.manual_seed(1000 + 10 * step + dist.get_rank())
    loss = model(torch.randn(8, WIDTH)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _generate(model) -> None:
    torch.manual_seed(7)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, WIDTH))


def _weights(model) -> list:
    return [round(p.full_tensor().sum().item(), 6) for p in model.parameters()]


def fsdp2_rollouts(args):
    """``args``: steps, generate (the rollout runs the model), delay_us (each fake
    suspend/resume takes that long, so training starts while resumes run)."""
    from torch.distributed.device_mesh import init_device_mesh

    from amem_callbacks.sharded import groups_gathered_over

    init()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    name_group(mesh.get_group("dp_replicate"), "dp_replicate")
    name_group(mesh.get_group("dp_shard"), "dp_shard")
    steps, generate = args.get("steps", 3), args.get("generate", False)

    model, optimizer = _build(mesh)  # without the package
    baseline = []
    for step in range(steps):
        if generate:
            _generate(model)
        baseline.append(_train_step(model, optimizer, step))
    baseline_weights = _weights(model)

    model, optimizer = _build(mesh)  # with it
    world = dist.distributed_c10d._get_default_group()
    keep = [role or "world" for group, role, _ in groups_gathered_over(model)
            if group is not world or role is None] if generate else []
    fake = FakeNccl()
    policy = OffloadPolicy(backend=fake.backend(), keep=keep, overlap=True, workers=2,
                           agree_timeout_s=30, timeout_s=60)
    losses, begins, suspended_during = [], [], []
    for step in range(steps):
        begins.append(summarize(policy.begin("rollout")))
        RolloutSession(policy).wait_for_memory()  # the suspends are done: the memory is free
        if step == 0:
            for comm in fake.comms.values():  # resumes now take delay_us: still running below
                fake.controls.delay(comm, args.get("delay_us", 200_000))
        suspended_during.append(fake.suspended())
        if generate:
            _generate(model)  # gathers over dp_shard only, which is kept
        policy.end("rollout")  # returns at once
        losses.append(_train_step(model, optimizer, step))
    policy.wait()
    totals = policy.metrics(last=False)
    return {"keep": keep, "losses": losses, "baseline": baseline,
            "weights_equal": _weights(model) == baseline_weights,
            "suspended_during": suspended_during, "suspended_after": fake.suspended(),
            "begins": begins, "auto_resumes": totals["amem/total/auto_resumes"],
            "guard_wait_seconds": totals["amem/total/guard_wait_seconds"],
            "group_suspends": totals["amem/total/group_suspends"],
            "group_resumes": totals["amem/total/group_resumes"]}
