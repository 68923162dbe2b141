"""The fake NCCL fails like the real one: a collective that reaches a
communicator it holds suspended ends the rank (tests/fake_nccl/tripwire.py)."""

import pytest

from tests.fake_nccl.tripwire import EXIT_CODE, MARKER
from tests.harness import RankFailure, run_ranks

SCENARIOS = "tests.scenarios_fake_nccl"

#: seen by the tripwire: every path a c10d collective takes into the backend
SEEN = {
    "dist.all_reduce": {"c10d::allreduce_"},
    "all_reduce bound at import": {"c10d::allreduce_"},
    "dist.all_reduce async": {"c10d::allreduce_"},
    "dist.all_gather": {"c10d::allgather_"},
    "dist.all_gather_into_tensor": {"c10d::_allgather_base_"},
    "dist.reduce_scatter_tensor": {"c10d::_reduce_scatter_base_"},
    "dist.broadcast": {"c10d::broadcast_"},
    "dist.reduce": {"c10d::reduce_"},
    "dist.gather": {"c10d::gather_"},
    "dist.scatter": {"c10d::scatter_"},
    "dist.all_to_all_single": {"c10d::alltoall_base_"},
    "dist.barrier": {"c10d::barrier"},
    "dist.monitored_barrier": {"c10d::monitored_barrier_"},
    "dist.send/recv": {"c10d::send", "c10d::recv_"},
    "dist.isend/irecv": {"c10d::send", "c10d::recv_"},
    "dist.batch_isend_irecv": {"c10d::send", "c10d::recv_"},
    "dist.all_gather_object": {"c10d::allgather_"},
    "dist.broadcast_object_list": {"c10d::broadcast_"},
    "ProcessGroup.allreduce": {"c10d::allreduce_"},
    "ProcessGroup.allreduce(tensor)": {"c10d::allreduce_"},
    "ProcessGroup._allgather_base": {"c10d::_allgather_base_"},
    "ProcessGroup.allreduce_coalesced": {"c10d::allreduce_coalesced_"},
    "ProcessGroup.broadcast": {"c10d::broadcast_"},
    "ProcessGroup.barrier": {"c10d::barrier"},
    "_coalescing_manager": {"c10d::allreduce_coalesced_"},
    "DDP (construction broadcast + reducer all-reduce)": {"c10d::allgather_", "c10d::broadcast_",
                                                         "c10d::allreduce_"},
    "DDP reducer backward only": {"c10d::allreduce_"},
    "functional collectives (funcol.all_reduce)": {"c10d::allreduce_"},
    "torch.ops._c10d_functional.all_reduce": {"c10d::allreduce_"},
    "torch.inference_mode": {"c10d::allreduce_"},
    "no_grad, requires_grad tensor": {"c10d::allreduce_"},
}
#: not seen: it skips the dispatcher (documented in the tripwire's docstring)
UNSEEN = {"backend object called directly"}


def test_paths_the_tripwire_sees_and_the_one_it_does_not():
    ranks = [r["result"] for r in run_ranks(f"{SCENARIOS}:tripwire_paths")]
    for op in ("allreduce_", "allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_",
               "reduce_scatter_tensor_coalesced_", "_reduce_scatter_base_", "reduce_scatter_",
               "broadcast_", "barrier", "send", "recv_", "recv_any_source_", "alltoall_base_",
               "alltoall_", "allreduce_coalesced_", "allgather_coalesced_", "gather_", "scatter_",
               "reduce_", "monitored_barrier_"):
        assert f"c10d::{op}" in ranks[0]["hooked_ops"]
    assert set(ranks[0]["paths"]) == set(SEEN) | UNSEEN
    for path, ops in SEEN.items():
        seen = set().union(*(set(r["paths"][path]) for r in ranks))
        assert seen == ops, (path, seen, [r["errors"].get(path) for r in ranks])
    for path in UNSEEN:
        assert all(r["paths"][path] == [] for r in ranks)
    for r in ranks:
        assert r["errors"] == {}
        assert r["active_seen"] == [] and r["unmapped_seen"] == []  # never suspended
        assert r["amem"] == [False, True, False]  # AMem's process-wide pause counts


@pytest.mark.parametrize("call,inference", [("all_reduce", False), ("barrier", False),
                                            ("all_reduce", True)])
def test_a_collective_on_a_suspended_communicator_ends_every_calling_rank(call, inference):
    ranks = run_ranks(f"{SCENARIOS}:tripwire_dies", args={"call": call, "inference": inference},
                      expect_ok=False, allow_fake_nccl_fatal=True)
    op = {"all_reduce": "c10d::allreduce_", "barrier": "c10d::barrier"}[call]
    for r in ranks:
        assert r["returncode"] == EXIT_CODE
        assert "result" not in r and "error" not in r  # nothing after the call ran
        assert len(r["fake_nccl_fatal"]) == 1
        line = r["fake_nccl_fatal"][0]
        assert line.startswith(f"{MARKER}: {op} on group 'victim'") and "suspended" in line


def test_the_harness_fails_a_run_with_a_fatal_rank_even_when_failure_was_expected():
    with pytest.raises(RankFailure, match="reached a suspended fake NCCL communicator"):
        run_ranks(f"{SCENARIOS}:tripwire_dies", expect_ok=False)
