"""Scenarios of the fake NCCL's tripwire (tests/fake_nccl/tripwire.py) and of
the mutation check; run by tests/test_fake_nccl_tripwire.py and
tests/test_mutations.py through tests.harness."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

import torch
import torch.distributed as dist
from torch.distributed import all_reduce as all_reduce_bound_at_import

from amem_callbacks import OffloadPolicy
from tests.fake_nccl import tripwire
from tests.scenarios import FakeNccl, allreduce_ok, init, ready_groups, summarize


def _path_calls(g, world: int, me: int):
    """Path name -> a callable issuing that path's collective(s) on group ``g``
    (both ranks call the same paths in the same order)."""
    peer = 1 - me
    from torch._C._distributed_c10d import AllreduceCoalescedOptions

    def t(value=1.0, n=4):
        return torch.full((n,), float(value))

    def send_recv():
        x = t(me)
        if me == 0:
            dist.send(x, dst=1, group=g)
        else:
            dist.recv(x, src=0, group=g)

    def isend_irecv():
        x = t(me)
        (dist.isend(x, dst=peer, group=g) if me == 0 else dist.irecv(x, src=peer, group=g)).wait()

    def batch_p2p():
        a, b = t(me), t()
        ops = [dist.P2POp(dist.isend, a, peer, group=g), dist.P2POp(dist.irecv, b, peer, group=g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def coalescing_manager():
        with dist.distributed_c10d._coalescing_manager(group=g, async_ops=True) as cm:
            dist.all_reduce(t(), group=g)
            dist.all_reduce(t(), group=g)
        cm.wait()

    def ddp():
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(4, 2), process_group=g)
        model(torch.ones(3, 4)).sum().backward()

    def functional():
        import torch.distributed._functional_collectives as funcol

        out = funcol.all_reduce(t(), "sum", g)
        funcol.wait_tensor(out) if hasattr(funcol, "wait_tensor") else out.wait()

    def functional_op():
        out = torch.ops._c10d_functional.all_reduce(t(), "sum", g.group_name)
        torch.ops._c10d_functional.wait_tensor(out)

    def inference_mode():
        with torch.inference_mode():
            dist.all_reduce(t(), group=g)

    def no_grad_requires_grad():
        with torch.no_grad():
            dist.all_reduce(torch.ones(4, requires_grad=True), group=g)

    def backend_direct():
        g._get_backend(torch.device("cpu")).allreduce([t()]).wait()

    calls = {
        "dist.all_reduce": lambda: dist.all_reduce(t(), group=g),
        "all_reduce bound at import": lambda: all_reduce_bound_at_import(t(), group=g),
        "dist.all_reduce async": lambda: dist.all_reduce(t(), group=g, async_op=True).wait(),
        "dist.all_gather": lambda: dist.all_gather([t(), t()], t(), group=g),
        "dist.all_gather_into_tensor": lambda: dist.all_gather_into_tensor(t(n=8), t(), group=g),
        "dist.reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t(), t(n=8), group=g),
        "dist.broadcast": lambda: dist.broadcast(t(), src=0, group=g),
        "dist.reduce": lambda: dist.reduce(t(), dst=0, group=g),
        "dist.gather": lambda: dist.gather(t(), [t(), t()] if me == 0 else None, dst=0, group=g),
        "dist.scatter": lambda: dist.scatter(t(), [t(), t()] if me == 0 else None, src=0, group=g),
        "dist.all_to_all_single": lambda: dist.all_to_all_single(t(), t(), group=g),
        "dist.barrier": lambda: dist.barrier(group=g),
        "dist.monitored_barrier": lambda: dist.monitored_barrier(group=g),
        "dist.send/recv": send_recv,
        "dist.isend/irecv": isend_irecv,
        "dist.batch_isend_irecv": batch_p2p,
        "dist.all_gather_object": lambda: dist.all_gather_object([None] * world, {"r": me}, group=g),
        "dist.broadcast_object_list": lambda: dist.broadcast_object_list([me], src=0, group=g),
        "ProcessGroup.allreduce": lambda: g.allreduce([t()]).wait(),
        "ProcessGroup.allreduce(tensor)": lambda: g.allreduce(t()).wait(),
        "ProcessGroup._allgather_base": lambda: g._allgather_base(t(n=8), t()).wait(),
        "ProcessGroup.allreduce_coalesced": lambda: g.allreduce_coalesced(
            [t(), t()], AllreduceCoalescedOptions()).wait(),
        "ProcessGroup.broadcast": lambda: g.broadcast([t()]).wait(),
        "ProcessGroup.barrier": lambda: g.barrier().wait(),
        "_coalescing_manager": coalescing_manager,
        "DDP (construction broadcast + reducer all-reduce)": ddp,
        "functional collectives (funcol.all_reduce)": functional,
        "torch.ops._c10d_functional.all_reduce": functional_op,
        "torch.inference_mode": inference_mode,
        "no_grad, requires_grad tensor": no_grad_requires_grad,
        "backend object called directly": backend_direct,
    }
    return calls


def tripwire_paths(args):
    """Every collective path on a group whose fake communicator is suspended:
    which ops the tripwire sees (recorded instead of dying), per path; and the
    same on an active mapped group and on a group the fake never mapped."""
    init()
    me, world = dist.get_rank(), dist.get_world_size()
    seen = []
    tripwire.install(on_violation=lambda op, name, detail: seen.append(
        [op, name, threading.current_thread() is threading.main_thread()]))
    sus = dist.new_group(list(range(world)), group_desc="sus")
    active = dist.new_group(list(range(world)), group_desc="active")
    unmapped = dist.new_group(list(range(world)), group_desc="unmapped")
    fake = FakeNccl()
    comm = fake.handle_of(sus)[0]
    fake.handle_of(active)
    out = {"hooked_ops": tripwire.hooked_ops(), "paths": {}, "errors": {}}
    for path, call in _path_calls(sus, world, me).items():
        seen.clear()
        assert fake.controls.suspend(comm) == 0
        try:
            call()
        except Exception as exc:  # the tripwire ran first; the error is the backend's own
            out["errors"][path] = f"{type(exc).__name__}: {str(exc)[:200]}"
        assert fake.controls.resume(comm) == 0
        out["paths"][path] = sorted({op for op, _name, _main in seen})
        dist.barrier()  # re-align the ranks after a path that failed on one of them
    # DDP's reducer alone: built while the communicator is active, backward while suspended
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(4, 2), process_group=sus)
    seen.clear()
    fake.controls.suspend(comm)
    model(torch.ones(3, 4)).sum().backward()
    fake.controls.resume(comm)
    out["paths"]["DDP reducer backward only"] = sorted({op for op, _name, _main in seen})
    out["ddp_backward_on_main_thread"] = sorted({main for _op, _name, main in seen})
    # controls: the same calls on an active mapped group and on an unmapped one
    for label, group in (("active", active), ("unmapped", unmapped)):
        seen.clear()
        for path, call in _path_calls(group, world, me).items():
            if path == "backend object called directly":
                continue
            with contextlib.suppress(Exception):
                call()
            dist.barrier()
        out[f"{label}_seen"] = list(seen)
    # AMem pauses the whole process: every group its fake build mapped counts as suspended
    amem = FakeNccl("amem")
    amem_group = dist.new_group(list(range(world)), group_desc="amem")
    amem.handle_of(amem_group)
    pause = amem.controls.lib.ncclPause
    pause.argtypes = (ctypes.c_void_p,)
    resume = amem.controls.lib.ncclResume
    resume.argtypes = (ctypes.c_void_p,)
    out["amem"] = [tripwire.suspended_comm(amem_group) is not None]
    pause(None)
    out["amem"].append(tripwire.suspended_comm(amem_group) is not None)
    resume(None)
    out["amem"].append(tripwire.suspended_comm(amem_group) is not None)
    return out


def tripwire_dies(args):
    """A collective on a suspended fake communicator ends the process with the
    marker, even inside ``except BaseException``; an active one runs on."""
    init()
    fake = FakeNccl()
    group = dist.new_group([0, 1], group_desc="victim")
    comm = fake.handle_of(group)[0]
    ok = allreduce_ok(group)
    assert fake.controls.suspend(comm) == 0
    try:
        with torch.inference_mode() if args.get("inference") else contextlib.nullcontext():
            if args.get("call") == "barrier":
                dist.barrier(group=group)
            else:
                dist.all_reduce(torch.ones(4), group=group)
    except BaseException as exc:  # noqa: BLE001 - nothing may swallow it
        return {"survived": True, "ok_before": ok, "error": repr(exc)}
    return {"survived": True, "ok_before": ok}


def representative(args):
    """The mutation check's scenario: suspend the idle groups, a call through
    the guard on a suspended group during the phase, end(), then collectives
    on every group. Passes as is; a broken guard or a skipped resume lets a
    collective reach a suspended communicator, which the tripwire turns fatal."""
    groups = ready_groups()
    fake = FakeNccl()
    policy = OffloadPolicy(backend=fake.backend(), keep=["tp"], agree_timeout_s=20, timeout_s=30)
    out = {"mutation": os.environ.get("AMEM_TEST_MUTATE", "")}
    begin = policy.begin("rollout")
    out["begin"] = summarize(begin)
    out["during"] = fake.suspended()
    out["tp_during"] = allreduce_ok(groups["tp"])  # kept: active throughout
    out["dp_during"] = allreduce_ok(groups["dp"], 3.0)  # suspended: the guard resumes it first
    end = policy.end("rollout")
    out["end"] = summarize(end)
    out["after"] = fake.suspended()
    out["exact_after"] = all(allreduce_ok(g, 5.0) for g in groups.values())
    dist.barrier()
    return out
