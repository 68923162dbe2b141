"""The fake NCCL's tripwire: a collective on a communicator it holds suspended
kills the process, as real NCCL does (an illegal memory access on every rank).

Where it sits. ``install()`` registers a Python kernel for every ``c10d::`` op
that takes a ProcessGroup (``allreduce_``, ``allgather_``, ``_allgather_base_``,
``allgather_into_tensor_coalesced_``, ``reduce_scatter_tensor_coalesced_``,
``broadcast_``, ``barrier``, ``send``, ``recv_``, ``alltoall_base_``, ... found
from the dispatcher's op table, so new ops are covered too) on the
``BackendSelect`` dispatch key. That key is in every call's key set (the
dispatcher's default TLS include set, also under ``torch.inference_mode``, where
the Autograd keys are absent) and runs just before the backend kernel
(CPU/CUDA), so the kernel checks the group, then ``redispatch``es to torch's own
kernel below it. Every ``ProcessGroup`` method (``allreduce``, ``allgather``,
``_allgather_base``, ``broadcast``, ``barrier``, ``send``, ``recv``, ...) is a
C++ function that calls these ops through the dispatcher, so the check sees
what actually reaches the backend, whichever caller issued it. Nothing here
depends on ``amem_callbacks`` or its guard; the guard works above this level.

Seen (each shown by ``test_paths_the_tripwire_sees_and_the_one_it_does_not`` in
tests/test_fake_nccl_tripwire.py, a
two-rank scenario that calls every path on a fake-suspended group with a
recording hook instead of dying): ``torch.distributed`` functions (all_reduce,
sync and async, all_gather, all_gather_into_tensor, reduce_scatter_tensor,
broadcast, reduce, gather, scatter, all_to_all_single, barrier,
monitored_barrier, send/recv, isend/irecv, batch_isend_irecv,
all_gather_object, broadcast_object_list); names bound with ``from
torch.distributed import all_reduce`` at import; ProcessGroup methods called
directly (``pg.allreduce``, ``pg._allgather_base``, ``pg.allreduce_coalesced``,
``pg.broadcast``, ``pg.barrier``); ``_coalescing_manager`` (its fast path's
``allreduce_coalesced``); DDP's C++ reducer (construction's parameter check and
``_broadcast_coalesced``, and the gradient all-reduce its autograd hook issues
in backward); functional collectives (``torch.ops._c10d_functional.*`` and
``torch.distributed._functional_collectives``, whose CPU kernels call the
group's C++ methods); all of these under ``torch.inference_mode()`` too (no
Autograd key there, which is why the kernel is not on ``AutogradCPU``).

Not seen: methods called on a group's backend object directly
(``pg._get_backend(device).allreduce(...)``, ``ProcessGroupGloo``'s own
methods) skip the dispatcher (the same test shows that too); whatever a
backend does internally (gloo's connection set-up, the c10d store, which the
package's agreement uses); groups the fake never mapped (never passed to
``FakeNccl.handle_of``), by design. Not tried: torch.compile'd graphs (they
call the same ``_c10d_functional`` ops at run time) and CUDA tensors (the
kernel is on BackendSelect, not on CPU, so their calls would be checked too).

Why not the other level the issue named: wrapping ``ProcessGroup``'s Python
methods at class level (as the guard now does) sees nothing of DDP's reducer
or of functional collectives, which enter C++ without a Python method call.
Measured on torch 2.13 CPU (one rank, wrappers on allreduce, broadcast,
allgather, _allgather_base, allreduce_coalesced): DDP construction, DDP
backward and ``funcol.all_reduce`` reached the class-level wrappers 0 times,
these kernels 3, 1 and 1 times; ``dist.all_reduce`` reached both. A kernel on
the ``CPU`` key itself replaces torch's (torch warns "Overriding a previously
registered kernel") and asking for the CPU kernel from inside it re-enters the
override: the original cannot be called.

"Suspended" is the fake library's own state: ``fakeCommSuspended`` of the
communicator(s) FakeNccl mapped the group to, and for the AMem build,
``fakeAmemPaused`` (AMem pauses the whole process) for every group that build
mapped. A violation prints the Python stack, then one line starting with
:data:`MARKER` naming the op, the group and the communicator, and ends the
process with ``os._exit(EXIT_CODE)``: no ``except`` clause can swallow it and
no later step of the scenario runs, like real NCCL.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
import weakref

MARKER = "FAKE-NCCL-FATAL"
EXIT_CODE = 86

_lock = threading.Lock()
# process group -> list of (controls, comm, name, amem): what FakeNccl mapped it to
_mapped: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_library = None  # the torch.library.Library holding the kernels (kept alive)
_hooked_ops: list = []
_on_violation = None  # tests of this module only: record instead of dying


def register(group, controls, comm: int, name: str, amem: bool = False) -> None:
    """Note that ``group``'s communicator is fake ``comm`` of ``controls``' library."""
    entry = (controls, comm, name, amem)
    with _lock:
        entries = _mapped.setdefault(group, [])
        if not any(e[0] is controls and e[1] == comm for e in entries):
            entries.append(entry)


def suspended_comm(group):
    """``(name, comm)`` of a suspended fake communicator behind ``group``, else None."""
    entries = _mapped.get(group)
    if not entries:
        return None
    for controls, comm, name, amem in list(entries):
        if controls.suspended(comm):
            return name, f"communicator {comm:#x} suspended"
        if controls.partial(comm):  # its peers' mappings are gone: NCCL faults there too
            return name, f"communicator {comm:#x} partly suspended (a suspend failed part-way)"
        if amem and controls.amem_paused():
            return name, f"communicator {comm:#x} paused process-wide (AMem)"
    return None


def hooked_ops() -> list:
    return list(_hooked_ops)


def installed() -> bool:
    return _library is not None


def install(on_violation=None) -> list:
    """Register the kernels (idempotent); return the hooked op names.

    ``on_violation(op, group_name, detail)``, for this module's own path test
    only, replaces dying with a call (and the original kernel still runs).
    """
    global _library, _on_violation
    import torch
    import torch.distributed  # noqa: F401  (loads the c10d ops)

    with _lock:
        if on_violation is not None:
            _on_violation = on_violation
        if _library is not None:
            return list(_hooked_ops)
        lib = torch.library.Library("c10d", "IMPL")
        after = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
        if after.has(torch._C.DispatchKey.PythonDispatcher):  # listed by full_after; never ours
            after = after.remove(torch._C.DispatchKey.PythonDispatcher)
        for qualified in sorted(torch._C._dispatch_get_all_op_names()):
            if not qualified.startswith("c10d::"):
                continue
            name = qualified.split("::", 1)[1]
            packet = getattr(torch.ops.c10d, name)
            for overload_name in packet.overloads():
                op = getattr(packet, overload_name)
                position = _group_position(op._schema)
                if position is None:
                    continue
                lib.impl(op._schema.name.split("::", 1)[1]
                         + (f".{overload_name}" if overload_name != "default" else ""),
                         _kernel(op, qualified, position, after), "BackendSelect",
                         with_keyset=True)
                _hooked_ops.append(qualified)
        _library = lib
        return list(_hooked_ops)


def _group_position(schema):
    for i, argument in enumerate(schema.arguments):
        if "c10d.ProcessGroup" in str(argument.type):
            return i, argument.name
    return None


def _kernel(op, qualified, position, after):
    index, arg_name = position

    def check_then_run(keyset, *args, **kwargs):
        boxed = kwargs.get(arg_name) if arg_name in kwargs else (
            args[index] if index < len(args) else None)
        found = _suspended_behind(boxed)
        if found is not None:
            _violation(qualified, *found)
        return op.redispatch(keyset & after, *args, **kwargs)

    return check_then_run


def _suspended_behind(boxed):
    if not _mapped or boxed is None:
        return None
    try:
        from torch._C._distributed_c10d import ProcessGroup

        group = ProcessGroup.unbox(boxed)
    except Exception:  # a fake/traced script object: not a real group of this process
        return None
    return suspended_comm(group)


def _violation(op: str, name: str, detail: str) -> None:
    if _on_violation is not None:
        _on_violation(op, name, detail)
        return
    thread = threading.current_thread().name
    try:
        stack = "".join(traceback.format_stack()[:-2])
    except Exception:
        stack = ""
    line = (f"{MARKER}: {op} on group {name!r} ({detail}) from thread {thread!r}, "
            f"rank {os.environ.get('RANK', '?')}: real NCCL would crash here (illegal memory "
            f"access); exiting with {EXIT_CODE}\n")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    try:  # straight to fd 2: the rank's log, whatever sys.stderr has become
        os.write(2, (stack + line).encode("utf-8", "replace"))
    finally:
        os._exit(EXIT_CODE)
