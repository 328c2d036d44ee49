"""Extensions of an epcomm process group, as torch custom ops (with fake implementations, so that
torch.compile traces through them):

- all_to_all_v(output, input, send_counts, recv_counts_out, group): an all-to-all whose split sizes are int64
  tensors on the data's device, with a fixed-capacity output (its rows); nothing goes through the host, so on
  the GPU engine it can be captured in a CUDA graph.
- dispatch / combine: worst-token (fixed-capacity) HT dispatch and its combine on the group's communicator,
  for callers that do not want a Buffer object.
"""
from typing import Optional, Tuple

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
