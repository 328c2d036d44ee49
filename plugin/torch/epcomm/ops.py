"""Extensions of an epcomm process group, as torch custom ops (with fake implementations, so that
torch.compile traces through them):

- all_to_all_v(output, input, send_counts, recv_counts_out, group): an all-to-all whose split sizes are int64
  tensors on the data's device, with a fixed-capacity output (its rows); nothing goes through the host, so on
  the GPU engine it can be captured in a CUDA graph.
- dispatch / combine: worst-token (fixed-capacity) HT dispatch and its combine on the group's communicator,
  for callers that do not want a Buffer object.
- set_active_ranks / recover / get_active_ranks / get_masked_drops: elastic ranks on the group's communicators
  (the C API's active-ranks mask), so that the survivors of a dead rank can go on with the same group.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor


def _group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _resolve(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)


def _backend_of(group: dist.ProcessGroup, device: torch.device):
    from . import _backend

    be = group._get_backend(device)
    if not isinstance(be, _backend.EpcommBackend):
        raise TypeError(f"epcomm: the group's backend for {device.type} is {type(be).__name__}, not epcomm "
                        "(create the group with backend='epcomm')")
    return be


@torch.library.custom_op("epcomm::all_to_all_v", mutates_args=("output", "recv_counts"))
def _all_to_all_v_op(output: Tensor, input: Tensor, send_counts: Tensor, recv_counts: Tensor,
                     group_name: str) -> None:
    _backend_of(_resolve(group_name), output.device).all_to_all_v(output, input, send_counts, recv_counts, False)


@_all_to_all_v_op.register_fake
def _(output, input, send_counts, recv_counts, group_name):
    return None


def all_to_all_v(output: Tensor, input: Tensor, send_counts: Tensor, recv_counts_out: Tensor,
                 group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
    """Sends input's rows to the ranks in order (send_counts[r] rows to rank r, packed by destination) and
    receives into output packed by source rank; recv_counts_out[r] gets the rows rank r sent. output's rows are
    the capacity: a call that would exceed it raises (epCapacityExceeded). Returns a Work when async_op."""
    group = _group(group)
    if async_op:
        return _backend_of(group, output.device).all_to_all_v(output, input, send_counts, recv_counts_out, True)
    torch.ops.epcomm.all_to_all_v(output, input, send_counts, recv_counts_out, group.group_name)
    return None



# --- dispatch / combine without a Buffer object ---------------------------------------------------------------
# Worst-token (fixed-capacity) dispatch, so that the shapes are static and torch.compile can trace the ops.
# Each group gets one Buffer (created at its first dispatch, collectively); a dispatch's layout is kept under
# (group, slot) until the combine of the same slot (two slots let two micro-batches overlap).

_buffers = {}
_handles = {}


def _buffer(group_name: str):
    from .buffer import Buffer

    buf = _buffers.get(group_name)
    if buf is None:
        buf = Buffer(_resolve(group_name))
        _buffers[group_name] = buf
    return buf


@torch.library.custom_op("epcomm::dispatch", mutates_args=())
def _dispatch_op(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, num_experts: int, capacity: int,
                 group_name: str, slot: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    buf = _buffer(group_name)
    _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, _, handle, _ = buf.dispatch(
        x, num_tokens_per_expert=per_expert, is_token_in_rank=in_rank, topk_idx=topk_idx,
        topk_weights=topk_weights, num_worst_tokens=capacity)
    _handles[(group_name, slot)] = handle
    num_local = num_experts // buf.group_size
    experts = torch.arange(num_local, device=recv_topk_idx.device)
    per_local_expert = (recv_topk_idx.unsqueeze(-1) == experts).sum(dim=(0, 1)).to(torch.int32)
    return recv_x, recv_topk_idx, recv_topk_weights, per_local_expert


@_dispatch_op.register_fake
def _(x, topk_idx, topk_weights, num_experts, capacity, group_name, slot):
    num_local = num_experts // dist.get_world_size(_resolve(group_name))
    topk = topk_idx.size(1)
    return (x.new_empty((capacity, x.size(1))), topk_idx.new_empty((capacity, topk)),
            topk_weights.new_empty((capacity, topk)), x.new_empty((num_local,), dtype=torch.int32))


@torch.library.custom_op("epcomm::combine", mutates_args=())
def _combine_op(x: Tensor, num_tokens: int, group_name: str, slot: int) -> Tensor:
    handle = _handles.get((group_name, slot))
    if handle is None:
        raise RuntimeError(f"epcomm.combine: no dispatch on slot {slot} of group {group_name} to combine")
    return _buffer(group_name).combine(x, handle)[0]


@_combine_op.register_fake
def _(x, num_tokens, group_name, slot):
    return x.new_empty((num_tokens, x.size(1)))


def dispatch(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, num_experts: int, capacity: int,
             group: Optional[dist.ProcessGroup] = None, slot: int = 0) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sends each token to the ranks of its experts. Returns (recv_x [capacity, H], recv_topk_idx [capacity, K]
    (local expert ids, -1 elsewhere and on unused rows), recv_topk_weights [capacity, K], tokens per local
    expert [E/R] int32). Rows are ordered by source rank, then token; more than capacity rows raise."""
    return torch.ops.epcomm.dispatch(x, topk_idx, topk_weights, num_experts, capacity, _group(group).group_name, slot)


def combine(x: Tensor, num_tokens: int, group: Optional[dist.ProcessGroup] = None, slot: int = 0) -> Tensor:
    """Sums the rows x (in the order dispatch gave, on slot) back to their tokens: [num_tokens, H] on the rank
    that dispatched them (unweighted; weight the rows before, as with Buffer.combine)."""
    return torch.ops.epcomm.combine(x, num_tokens, _group(group).group_name, slot)



# --- elastic ranks ----------------------------------------------------------------------------------------------

def _epcomm_backends(group: dist.ProcessGroup) -> list:
    """The group's distinct epcomm backends (one object may serve both cpu and cuda)."""
    from . import _backend

    found = []
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        try:
            be = group._get_backend(device)
        except RuntimeError:
            continue
        if isinstance(be, _backend.EpcommBackend) and all(be is not b for b in found):
            found.append(be)
    if not found:
        raise TypeError("epcomm: the group has no epcomm backend (create it with backend='epcomm')")
    return found


def _buffer_stream(buf) -> int:
    """The stream handle a call on buf's communicator runs on: the current CUDA stream, 0 on the CPU."""
    if buf._device.type != "cuda":
        return 0
    from ._pointers import stream_handle

    return stream_handle(torch.cuda.current_stream())


def set_active_ranks(active: Sequence[int], group: Optional[dist.ProcessGroup] = None) -> None:
    """Applies the active-ranks mask (active[r] nonzero keeps group rank r, 0 masks it) to every epcomm
    communicator of the group: the backend's (CPU, CUDA) and that of epcomm.dispatch/combine on it. Collective
    among the ranks kept, synchronous; a masked rank can never be kept again, and a rank cannot mask itself.
    The way on after a rank died: the survivors' epcomm operation raised (DistBackendError, timeout or remote
    error) once; every survivor calls this with the dead rank masked; then all_to_all_single, all_to_all,
    barrier, all_to_all_v and epcomm.dispatch/combine on the group run among the survivors (nothing is sent to
    or received from masked ranks: their receive ranges are left untouched, their device counts read 0).
    Collectives that the group delegates to gloo/NCCL (all_reduce, broadcast, ...) know no mask and keep
    failing: use a new group of the survivors for those. A call that masks nobody new resynchronizes the
    survivors (after a timeout in which no rank died)."""
    group = _group(group)
    mask: List[int] = [1 if a else 0 for a in active]
    if len(mask) != group.size():
        raise ValueError(f"epcomm.set_active_ranks: the mask has {len(mask)} entries, the group has {group.size()} "
                         "ranks")
    for be in _epcomm_backends(group):
        be.set_active_ranks(mask)
    buf = _buffers.get(group.group_name)
    if buf is not None and buf.runtime is not None:
        buf.runtime.set_active_ranks(mask, _buffer_stream(buf))


def recover(group: Optional[dist.ProcessGroup] = None) -> List[int]:
    """set_active_ranks without knowing whom to mask (epCommRecover): after a failed epcomm operation every
    survivor calls it; together they find the ranks to mask (dead, lost across hosts, gone, or silent for twice
    the deadline), agree on one mask, and apply it to every epcomm communicator of the group. Returns the mask
    (1 = active). A rank that must leave (the others hold it out: it was stopped past the deadline and came
    back; or it reaches none of them) gets a RuntimeError whose message ends "destroy the communicator", and
    must leave the group; other failures may be retried. Needs a communicator on the host engine, the backend's
    CPU one, created before the failure (its creation needs every rank: run one CPU collective on the group at
    start-up); the GPU engine has no epCommRecover: there, call set_active_ranks with the failed ranks masked."""
    group = _group(group)
    mask: Optional[List[int]] = None
    for be in _epcomm_backends(group):
        m = be.recover()
        if m:
            mask = list(m)
    buf = _buffers.get(group.group_name)
    if buf is not None and buf.runtime is not None:
        if mask is None:
            mask = list(buf.runtime.recover(_buffer_stream(buf)))
        else:
            buf.runtime.set_active_ranks(mask, _buffer_stream(buf))
    return mask if mask is not None else get_active_ranks(group)


def get_active_ranks(group: Optional[dist.ProcessGroup] = None) -> List[int]:
    """The group's active-ranks mask: one int per group rank, 1 = active, 0 = masked."""
    group = _group(group)
    mask = [1] * group.size()
    for be in _epcomm_backends(group):
        mask = [a & b for a, b in zip(mask, be.active_ranks())]
    buf = _buffers.get(group.group_name)
    if buf is not None and buf.runtime is not None:
        mask = [a & b for a, b in zip(mask, buf.runtime.active_ranks())]
    return mask


def get_masked_drops(device: Optional[torch.device] = None,
                     group: Optional[dist.ProcessGroup] = None) -> Tuple[Tensor, Tensor]:
    """(token_rows, alltoallv_elements), int64 CPU tensors of group.size(): what was not sent because the
    destination rank was masked, cumulative per destination, on the backend's communicator of device (default
    cpu): alltoallv elements (all_to_all_single, all_to_all and all_to_all_v, in units of the call's dtype, or
    bytes for dtypes the C API lacks) and dispatch rows (none: the backend's communicator dispatches nothing;
    epcomm.dispatch runs on a Buffer, see Buffer.get_masked_drops)."""
    group = _group(group)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rows, elements = _backend_of(group, device).masked_drops(device)
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(elements, dtype=torch.int64)
