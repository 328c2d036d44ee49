"""epcomm.Buffer: DeepEP's (legacy) Buffer API — names, arguments, defaults, return values — on epcomm's C API.

One communicator (Buffer.runtime) carries every call, HT and LL. It is created over the group given (any
backend) through the C API's all-gather callback. Its engine decides the tensors it takes: the host engine (CPU
tensors; what runs without a GPU, or with EPCOMM_ENGINE=host) or the GPU engine (CUDA tensors of the current
device). The C API sizes a communicator's LL buffers at creation (epConfig_t.ll_max_tokens_per_rank,
ll_max_hidden, ll_num_experts), and DeepEP's constructor does not say them (num_rdma_bytes does not determine
them): so the Buffer creates its communicator without LL capacity, and the first LL call re-creates it with
that call's (num_max_dispatch_tokens_per_rank, hidden, num_experts) -- collectively, as every rank makes the
same LL call -- as does a later LL call that needs more. Every difference from DeepEP is listed in the README
("Differences from DeepEP").
"""
import array
import math
import os
import weakref
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _capi, comm as _comm
from ._pointers import ep_dtype, nbytes, ptr, stream_handle
from ._launch import Launch as _Launch
from .config import Config
from .event import EventHandle, EventOverlap
from .handles import HtHandle, LowLatencyHandle, HtState

topk_idx_t = torch.int64


def _current_raw_stream(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # the same, without making a Stream object per call
    _current_raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811


class _LlSlot:
    """One set of LL dispatch outputs (see Buffer._ll_recv_slot) and the C API argument structs that go with
    it: the dispatch's (everything but the call's x, topk_idx, token count, top-k, dtype and phases) and the
    combine's over its layout (everything but the combine's own tensors), filled once per set."""

    def __init__(self, key, dev: torch.device, num_ranks: int, max_tokens: int, num_experts: int,
                 region: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
        num_local, slots, hidden, dtype, use_fp8 = key
        self.key = key
        # region: uint8 views of a zero-copy dispatch region (recv_x bytes, scales bytes), which the senders write
        # the rows into: no receive-side copy, no tensor of the slot's own
        # recv_scales row-major for the C API, scales_out the same scales column-major as DeepEP hands them out
        x_shape, sc_shape = (num_local, slots, hidden), (num_local, slots, hidden // 128)
        if region is None:
            self.recv_x = torch.empty(x_shape, dtype=dtype, device=dev)
            self.recv_scales = torch.empty(sc_shape, dtype=torch.float32, device=dev) if use_fp8 else None
        else:
            self.recv_x = region[0][:math.prod(x_shape) * dtype.itemsize].view(dtype).view(x_shape)
            self.recv_scales = region[1][:math.prod(sc_shape) * 4].view(torch.float32).view(sc_shape) \
                if use_fp8 else None
        self.scales_out = torch.empty((num_local, hidden // 128, slots), dtype=torch.float32,
                                      device=dev).transpose(1, 2) if use_fp8 else None
        self.recv_count = torch.empty(num_local, dtype=torch.int32, device=dev)
        self.src_info = torch.empty((num_local, slots), dtype=torch.int32, device=dev)
        # as the C API writes it ((count << 32) | begin), and as DeepEP hands it out ((begin << 32) | count)
        self.layout_range = torch.empty((num_local, num_ranks), dtype=torch.int64, device=dev)
        self.deepep_range = torch.empty((num_local, num_ranks), dtype=torch.int64, device=dev)
        self.tensors = tuple(t for t in (self.recv_x, self.recv_scales, self.scales_out, self.recv_count,
                                         self.src_info, self.layout_range, self.deepep_range) if t is not None)
        # host memory: the binding rewrites the range in C++ after the receive; device memory: one index_select
        # that swaps the two int32 halves of each entry
        self.host_range = self.deepep_range.data_ptr() if dev.type == "cpu" else 0
        if dev.type != "cpu":
            self._swap_src = self.layout_range.view(torch.int32).view(num_local, num_ranks, 2)
            self._swap_dst = self.deepep_range.view(torch.int32).view(num_local, num_ranks, 2)
            self._swap_idx = torch.arange(1, -1, -1, device=dev)  # [1, 0], made by a kernel (capturable)
        a = _capi.LlDispatchArgs()
        a.max_tokens_per_rank, a.hidden, a.num_experts = max_tokens, hidden, num_experts
        a.use_fp8, a.layout = int(use_fp8), _capi.LL_EXPERT_MAJOR
        a.recv_x, a.recv_x_bytes = ptr(self.recv_x), nbytes(self.recv_x)
        a.recv_x_scales, a.recv_x_scales_bytes = ptr(self.recv_scales), nbytes(self.recv_scales)
        a.recv_count, a.recv_count_bytes = ptr(self.recv_count), nbytes(self.recv_count)
        a.recv_src_info, a.recv_src_info_bytes = ptr(self.src_info), nbytes(self.src_info)
        a.recv_layout_range, a.recv_layout_range_bytes = ptr(self.layout_range), nbytes(self.layout_range)
        self.dispatch_args = a
        c = _capi.LlCombineArgs()
        c.max_tokens_per_rank, c.hidden, c.num_experts = max_tokens, hidden, num_experts
        c.layout = _capi.LL_EXPERT_MAJOR
        c.recv_count, c.recv_src_info, c.recv_layout_range = ptr(self.recv_count), ptr(self.src_info), \
            ptr(self.layout_range)
        self.combine_args = c

    def received(self, stats: Optional[torch.Tensor]) -> None:
        """What follows a dispatch's receive, on the current stream: DeepEP's layout range (device memory;
        the binding wrote it in host memory), the column-major scales, the caller's stats."""
        if self.host_range == 0:
            torch.index_select(self._swap_src, 2, self._swap_idx, out=self._swap_dst)
        if self.scales_out is not None:
            self.scales_out.copy_(self.recv_scales)
        if stats is not None:
            stats.add_(self.recv_count)


class Buffer:
    """The expert-parallel communication buffer (DeepEP's legacy Buffer): HT dispatch/combine (exact,
    worst-token, cached) and LL dispatch/combine (with receive hooks) between the ranks of group."""

    num_sms: int = 20
    # Exact-mode HT dispatch fills only this rank's column of the handle's rank_prefix_matrix (from the C layout,
    # without communication; DeepEP's own checks read only that column). True (or EPCOMM_FULL_RANK_PREFIX_MATRIX=1)
    # fills every column, at the price of one more exchange of the counts per dispatch. Per instance or class.
    full_rank_prefix_matrix: bool = os.environ.get("EPCOMM_FULL_RANK_PREFIX_MATRIX", "0") not in ("", "0")
    # LL dispatch outputs straight in the communicator's memory (the GPU engine's zero-copy dispatch regions,
    # ranks of one host): the senders write the final rows, the receive half copies none. Two alternate, as the
    # slots do, but the peers may write a region again as soon as this rank's second dispatch after has started
    # its send half (hook mode too), and the views are valid until destroy() (they keep the communicator alive).
    # False (or EPCOMM_LL_ZERO_COPY_DISPATCH=0) keeps Buffer-owned outputs and the copy. Read when the Buffer is
    # made; the regions are taken only where every rank wants them.
    ll_zero_copy_dispatch: bool = os.environ.get("EPCOMM_LL_ZERO_COPY_DISPATCH", "1") not in ("", "0")

    def __init__(self,
                 group: Optional[dist.ProcessGroup],
                 num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False,
                 enable_shrink: bool = False,
                 comm: Optional["mpi4py.MPI.Comm"] = None) -> None:  # noqa: F821
        if group is not None:
            self.rank, self.group_size, self.group = group.rank(), group.size(), group
            self._allgather = _comm.group_allgather(group)
        elif comm is not None:
            self.rank, self.group_size, self.group = comm.Get_rank(), comm.Get_size(), comm
            self._allgather = _comm.mpi_allgather(comm)
        else:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.runtime = _comm.create(self.group_size, self.rank, self._allgather, num_sms=Buffer.num_sms)
        self._device = _comm.engine_device(self.runtime)
        self._cuda = self._device.type == "cuda"
        self._comm_stream = torch.cuda.Stream() if self._device.type == "cuda" else None
        # reused by every call's stream waits (_launch.Launch): compute -> comm, and comm -> compute
        self._fork_event = torch.cuda.Event() if self._cuda else None
        self._join_event = torch.cuda.Event() if self._cuda else None
        self._free_ht_handles: List = []
        self._graph_ht_handles: List = []  # held by captured CUDA graphs for the Buffer's lifetime
        self._alltoallv_unsupported = False
        self._comm_generation = 0  # bumped when the communicator is re-created (HT handles of an older one die)
        self._ll_shape = (0, 0, 0)  # LL capacity of the communicator: (max tokens per rank, hidden, experts)
        self._ll_zero_copy = True  # the engine hands out zero-copy regions (epLlCombineBuffer); else a fallback
        self._ll_region_views = {}  # address of a zero-copy region -> (bytes, shape, bf16 view of that shape)
        self._ht_zero_copy = True  # the engine hands out the HT zero-copy region (epHtCombineBuffer); else a fallback
        self._ht_region: Optional[torch.Tensor] = None  # uint8 over the communicator's HT region, once handed out
        self._ht_combine_fallback: Optional[torch.Tensor] = None  # uint8, Buffer-owned, where the engine has none
        # Communicators replaced by a larger LL one after they handed out zero-copy views: kept alive (unused) until
        # destroy(), so that a tensor a caller still holds never points at freed memory.
        self._retired_runtimes: list = []
        self._ll_combine_buffers: List[torch.Tensor] = []
        self._ll_recv_slots: List = [None, None]
        self._ll_slot_idx = 0
        # Zero-copy LL dispatch (config.ll_zero_copy_dispatch, GPU engine, one host): the slots whose outputs are the
        # communicator's two dispatch regions, by region address; False once the engine has said it has none.
        self._ll_zd = self.ll_zero_copy_dispatch
        self._ll_zd_slots: dict = {}
        self._ll_buffer_idx = 0
        self._local_buffers = {}
        self._mask_wanted: set = set()  # ranks an update asked to mask (kept when the update itself failed)
        # register_memory: [tensor, _capi.MemRegion on the current communicator], in registration order, and the
        # registrations of replaced communicators (freed once those are destroyed)
        self._registered: list = []
        self._retired_regions: list = []

    # --- lifecycle and static helpers ----------------------------------------------------------------------

    def destroy(self) -> None:
        assert self.explicitly_destroy, '`explicitly_destroy` flag must be set'
        self._free_ht_handles.clear()
        self._graph_ht_handles.clear()
        self._ll_region_views.clear()
        self._ll_zd_slots.clear()
        self._ht_region = None
        self._ht_combine_fallback = None
        if self.runtime is not None:
            self.runtime.destroy()
        self.runtime = None
        for old in self._retired_runtimes:  # the caller's zero-copy views of them end here too
            old.destroy()
        self._retired_runtimes.clear()
        self._registered.clear()  # their communicators are gone: the handles free themselves
        self._retired_regions.clear()

    @staticmethod
    def is_sm90_compiled() -> bool:
        return True  # fp8 (e4m3 with per-128-column scales) runs on every engine

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, 'The SM count must be even'
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """DeepEP's sizing (two buffers of bf16 messages with a 16-byte header), so that callers that size
        num_rdma_bytes from it get a similar number; epcomm sizes its LL buffers itself."""
        msg = 16 + max(hidden * 2, hidden + hidden // 128 * 4)
        send = num_max_dispatch_tokens_per_rank * max(msg, hidden * 2)
        recv = num_experts * num_max_dispatch_tokens_per_rank * max(msg, hidden * 2)
        per_buffer = send + recv + num_experts * 4 * 2
        return ((2 * per_buffer) + 127) // 128 * 128

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        table = {2: 24, 4: 6, 8: 6, 16: 36, 24: 32, 32: 32, 48: 32, 64: 32, 96: 20, 128: 20, 144: 32, 160: 28}
        recv = {16: 288, 24: 288, 32: 288, 48: 288, 64: 288, 96: 480, 128: 560, 144: 720, 160: 720}
        assert num_ranks in table, f'Unsupported number of EP ranks: {num_ranks}'
        return Config(Buffer.num_sms, table[num_ranks], recv.get(num_ranks, 256), 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        table = {2: 10, 4: 9, 8: 4, 16: 4, 24: 1, 32: 1, 48: 1, 64: 1, 96: 1, 128: 1, 144: 2, 160: 2}
        recv = {16: 288, 24: 288, 32: 288, 48: 288, 64: 288, 96: 480, 128: 560, 144: 720, 160: 720}
        assert num_ranks in table, f'Unsupported number of EP ranks: {num_ranks}'
        return Config(Buffer.num_sms, table[num_ranks], recv.get(num_ranks, 256), 6, 128)

    def get_comm_stream(self):
        return self._comm_stream if self._comm_stream is not None else torch.cpu.current_stream()

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A tensor over this rank's num_nvl_bytes (or num_rdma_bytes) buffer, owned by the Buffer. epcomm's
        communication buffers are internal to the C library, so this memory is local scratch, not visible to
        peers."""
        num_bytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        raw = self._local_buffers.get(use_rdma_buffer)
        if raw is None:
            raw = torch.empty(num_bytes, dtype=torch.uint8, device=self._device)
            self._local_buffers[use_rdma_buffer] = raw
        item = torch.empty((), dtype=dtype).element_size()
        tensor = raw[: num_bytes // item * item].view(dtype)[offset:]
        if size is None:
            return tensor
        assert tensor.numel() >= size.numel()
        return tensor[: size.numel()].view(size)

    # --- checks ---------------------------------------------------------------------------------------------

    def _check(self, name: str, t: Optional[torch.Tensor]) -> None:
        if t is not None and t.device != self._device:
            engine = "GPU" if self._device.type == "cuda" else "host"
            raise ValueError(f"epcomm.Buffer: {name} is on {t.device}, but this Buffer runs epcomm's {engine} engine, "
                             f"which takes tensors on {self._device} (EPCOMM_ENGINE=host|gpu chooses the engine)")

    # --- layout ---------------------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        self._check("topk_idx", topk_idx)
        topk_idx = topk_idx.contiguous()
        num_tokens, topk = topk_idx.shape
        with _Launch(self, previous_event, async_finish) as launch:
            per_rank = torch.empty(self.group_size, dtype=torch.int32, device=self._device)
            per_expert = torch.empty(num_experts, dtype=torch.int32, device=self._device)
            in_rank = torch.empty((num_tokens, self.group_size), dtype=torch.bool, device=self._device)
            self.runtime.layout(ptr(topk_idx), num_tokens, topk, num_experts, ptr(per_rank), ptr(per_expert),
                                ptr(in_rank), launch.stream)
        event = launch.finish((topk_idx, per_rank, per_expert, in_rank))
        return per_rank, None, per_expert, in_rank, event

    # --- high-throughput dispatch / combine -----------------------------------------------------------------

    def _take_ht_handle(self, num_tokens: int):
        while self._free_ht_handles:
            h = self._free_ht_handles.pop()
            if h.max_tokens >= num_tokens:
                return h
        return _capi.HtHandle(self.runtime, max(num_tokens, 1))

    def _give_back_ht_handle(self, h, generation: Optional[int] = None) -> None:
        if generation is None or generation == self._comm_generation:  # a re-created communicator's are gone
            self._free_ht_handles.append(h)

    def _exchange_counts(self, per_rank: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """[R, R + E] int32: every rank's tokens per destination rank and per expert. The C API keeps these
        inside its layout, so they take one all-gather: on the Buffer's own communicator (an alltoallv of
        R copies) where its engine has alltoallv, else on the group."""
        mine = torch.cat([per_rank.to(torch.int32), per_expert.to(torch.int32)])
        n, world = mine.numel(), self.group_size
        if not self._alltoallv_unsupported:
            send = mine.repeat(world)
            out = torch.empty(world * n, dtype=torch.int32, device=self._device)
            counts, displs = [n] * world, [i * n for i in range(world)]
            stream = stream_handle(torch.cuda.current_stream()) if self._device.type == "cuda" else 0
            try:
                self.runtime.alltoallv(ptr(send), counts, displs, ptr(out), counts, displs, _capi.INT32, stream)
                out = out.view(world, n)
                active = self.runtime.active_ranks()
                if not all(active):  # a masked source sends nothing and its range is left as it was
                    out[torch.tensor(active, device=self._device) == 0] = 0
                return out
            except _capi.Error as e:
                if e.code != _capi.NOT_SUPPORTED:
                    raise
                self._alltoallv_unsupported = True  # the same answer on every rank: all take the group's path
        if isinstance(self.group, dist.ProcessGroup):
            device = self._gather_device()
            out = torch.empty(world * n, dtype=torch.int32, device=device)
            dist.all_gather_into_tensor(out, mine.to(device), group=self.group)
            return out.view(world, n).to(self._device)
        rows = self.group.allgather(mine.cpu().tolist())
        return torch.tensor(rows, dtype=torch.int32, device=self._device)

    def _own_rank_prefix_column(self, c_handle) -> torch.Tensor:
        """rank_prefix_matrix with this rank's column only: [R, R] int32 whose [i, rank] is the number of rows
        received from ranks 0..i (the C layout's own counts, host-visible after notify: no communication); the
        other columns (what the other ranks receive) are 0. See full_rank_prefix_matrix."""
        world, rank = self.group_size, self.rank
        flat = array.array("i", bytes(4 * world * world))
        acc = 0
        for i, n in enumerate(c_handle.recv_counts(world)):
            acc += n
            flat[i * world + rank] = acc
        matrix = torch.frombuffer(flat, dtype=torch.int32).view(world, world)  # shares (and holds) flat
        # pageable host memory is staged before the copy call returns: non_blocking adds no host sync
        return matrix.to(self._device, non_blocking=True) if self._cuda else matrix

    def _gather_device(self) -> torch.device:
        # CPU tensors where the group takes them (gloo, epcomm, cpu:gloo,...); CUDA for a CUDA-only group (NCCL).
        try:
            self.group._get_backend(torch.device("cpu"))
            return torch.device("cpu")
        except RuntimeError:
            return torch.device("cuda", torch.cuda.current_device())

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None, num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        """Sends each token to every rank that hosts one of its experts (see DeepEP's Buffer.dispatch).
        Received rows are ordered by source rank, then source token index."""
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        for name, t in (("x", x), ("x_scales", x_scales), ("topk_idx", topk_idx), ("topk_weights", topk_weights),
                        ("is_token_in_rank", is_token_in_rank)):
            self._check(name, t)
        if x.dim() != 2:
            raise ValueError(f"epcomm.Buffer.dispatch: x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
        num_tokens, hidden = x.shape
        x = x.contiguous()
        x_scales = x_scales.contiguous() if x_scales is not None else None

        if handle is not None:
            assert topk_idx is None and topk_weights is None, "cached dispatch takes no top-k"
            return self._cached_dispatch(x, x_scales, handle, num_worst_tokens, previous_event, async_finish)

        assert num_tokens_per_expert is not None, "num_tokens_per_expert is required (from get_dispatch_layout)"
        num_experts = num_tokens_per_expert.numel()
        num_local = num_experts // self.group_size
        routed_by_topk = topk_idx is not None
        if not routed_by_topk:
            # Routing given by is_token_in_rank alone: each chosen rank receives the token through its first
            # expert; no top-k comes back (as in DeepEP).
            assert is_token_in_rank is not None, "dispatch without topk_idx needs is_token_in_rank"
            if self.group_size > _capi.MAX_TOPK:
                raise ValueError(f"epcomm.Buffer.dispatch: routing by is_token_in_rank alone supports at most "
                                 f"{_capi.MAX_TOPK} ranks")
            first_expert = torch.arange(self.group_size, device=self._device, dtype=torch.int64) * num_local
            topk_idx = torch.where(is_token_in_rank.bool(), first_expert, torch.full_like(first_expert, -1))
        topk_idx = topk_idx.contiguous()
        topk_weights = topk_weights.contiguous() if topk_weights is not None else None
        topk = topk_idx.size(1)

        with _Launch(self, previous_event, async_finish) as launch:
            args = _capi.ht_dispatch_args(num_tokens, hidden, topk, num_experts, ep_dtype(x.dtype), 0, 0, ptr(x),
                                          ptr(x_scales), ptr(topk_idx), ptr(topk_weights))
            c_handle = self._take_ht_handle(num_tokens)
            try:
                if num_worst_tokens > 0:
                    rows = num_worst_tokens
                    args.num_worst_tokens = num_worst_tokens
                    per_expert_list: List[int] = []
                    num_recv = -1
                else:
                    num_recv, per_expert_list = self.runtime.ht_dispatch_notify(args, c_handle, num_local, launch.stream)
                    rows = num_recv
                recv = self._alloc_recv(args, rows, hidden, x, x_scales, topk, routed_by_topk, topk_weights is not None)
                self.runtime.ht_dispatch(args, c_handle, launch.stream)
            except BaseException:
                self._give_back_ht_handle(c_handle)
                raise
        recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights = recv

        rank_prefix_matrix = None
        if num_worst_tokens == 0:
            if routed_by_topk and not self.full_rank_prefix_matrix:
                rank_prefix_matrix = self._own_rank_prefix_column(c_handle)
            else:
                if num_tokens_per_rank is None:
                    num_tokens_per_rank = is_token_in_rank.sum(dim=0) if is_token_in_rank is not None else \
                        self.get_dispatch_layout(topk_idx, num_experts)[0]
                counts = self._exchange_counts(num_tokens_per_rank, num_tokens_per_expert)
                rank_prefix_matrix = counts[:, : self.group_size].cumsum(dim=0).to(torch.int32)
                if not routed_by_topk:
                    mine = counts[:, self.group_size + self.rank * num_local:
                                  self.group_size + (self.rank + 1) * num_local]
                    per_expert_list = mine.sum(dim=0).tolist()
            if expert_alignment > 1:
                per_expert_list = [(c + expert_alignment - 1) // expert_alignment * expert_alignment
                                   for c in per_expert_list]

        state = HtState(c_handle, num_tokens, topk, num_experts, num_recv, num_worst_tokens, hidden)
        if self._device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # A captured graph writes and reads this layout at every replay: never lend it to another dispatch.
            self._graph_ht_handles.append(c_handle)
        else:
            weakref.finalize(state, self._give_back_ht_handle, c_handle, self._comm_generation)
        new_handle = HtHandle((rank_prefix_matrix, None, None, None, is_token_in_rank, None), state)
        event = launch.finish((x, x_scales, topk_idx, topk_weights, *recv))
        out_x = (recv_x, recv_x_scales) if x_scales is not None else recv_x
        return out_x, recv_topk_idx, recv_topk_weights, per_expert_list, new_handle, event

    def _alloc_recv(self, args, rows: int, hidden: int, x, x_scales, topk: int, with_topk: bool, with_weights: bool):
        recv_x = torch.empty((rows, hidden), dtype=x.dtype, device=self._device)
        args.recv_x, args.recv_x_bytes = ptr(recv_x), nbytes(recv_x)
        recv_x_scales = None
        if x_scales is not None:
            recv_x_scales = torch.empty((rows, x_scales.size(1)), dtype=torch.float32, device=self._device)
            args.recv_x_scales, args.recv_x_scales_bytes = ptr(recv_x_scales), nbytes(recv_x_scales)
        recv_topk_idx = recv_topk_weights = None
        if with_topk:
            recv_topk_idx = torch.empty((rows, topk), dtype=torch.int64, device=self._device)
            args.recv_topk_idx, args.recv_topk_idx_bytes = ptr(recv_topk_idx), nbytes(recv_topk_idx)
            if with_weights:
                recv_topk_weights = torch.empty((rows, topk), dtype=torch.float32, device=self._device)
                args.recv_topk_weights, args.recv_topk_weights_bytes = ptr(recv_topk_weights), nbytes(recv_topk_weights)
        return recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights

    def _cached_dispatch(self, x, x_scales, handle, num_worst_tokens, previous_event, async_finish):
        state: HtState = handle.state
        if x.size(0) != state.num_tokens:
            raise ValueError(f"epcomm.Buffer.dispatch: cached dispatch of {x.size(0)} tokens with a handle of "
                             f"{state.num_tokens}")
        rows = num_worst_tokens if num_worst_tokens > 0 else (state.num_worst if state.num_recv < 0 else state.num_recv)
        with _Launch(self, previous_event, async_finish) as launch:
            args = _capi.ht_dispatch_args(x.size(0), x.size(1), state.topk, state.num_experts, ep_dtype(x.dtype),
                                          _capi.HT_USE_HANDLE_LAYOUT,
                                          num_worst_tokens if num_worst_tokens > 0 else max(state.num_worst, 0),
                                          ptr(x), ptr(x_scales), 0, 0)
            recv_x, recv_x_scales, _, _ = self._alloc_recv(args, rows, x.size(1), x, x_scales, 0, False, False)
            self.runtime.ht_dispatch(args, state.c_handle, launch.stream)
        event = launch.finish((x, x_scales, recv_x, recv_x_scales))
        out_x = (recv_x, recv_x_scales) if x_scales is not None else recv_x
        return out_x, None, None, None, None, event

    def combine(self, x: torch.Tensor, handle: Tuple,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Sums each token's rows back from the ranks that received it (no weights), in ascending rank order
        in fp32; topk_weights, when given, are summed the same way. x may be get_combine_buffer(handle): on
        the GPU engine that combine copies nothing, the token owners read the rows where the experts wrote them."""
        self._check("x", x)
        self._check("topk_weights", topk_weights)
        state: HtState = handle.state
        # A view of the zero-copy region is contiguous, so it reaches epHtCombine at the region's start, unchanged.
        x = x.contiguous()
        hidden = x.size(1)
        bias_0, bias_1 = (bias if isinstance(bias, tuple) else (bias, None)) if bias is not None else (None, None)
        with _Launch(self, previous_event, async_finish) as launch:
            combined_x = self._ht_combine(state, x, hidden, launch.stream)
            combined_topk_weights = None
            if topk_weights is not None:
                # The weights take a second combine in fp32, their row padded to the C API's 8-element unit.
                topk = topk_weights.size(1)
                padded = torch.zeros((x.size(0), (topk + 7) // 8 * 8), dtype=torch.float32, device=self._device)
                padded[:, :topk] = topk_weights
                combined_topk_weights = self._ht_combine(state, padded, padded.size(1), launch.stream)[:, :topk]
            if bias_0 is not None or bias_1 is not None:
                acc = combined_x.float()
                for b in (bias_0, bias_1):
                    if b is not None:
                        acc += b.float()
                combined_x = acc.to(combined_x.dtype)
        event = launch.finish((x, topk_weights, combined_x, combined_topk_weights))
        return combined_x, combined_topk_weights, event

    def _ht_combine(self, state: HtState, x: torch.Tensor, hidden: int, stream: int) -> torch.Tensor:
        out = torch.empty((state.num_tokens, hidden), dtype=x.dtype, device=self._device)
        self.runtime.ht_combine_with(state.c_handle, state.num_tokens, hidden, ep_dtype(x.dtype), ptr(x), nbytes(x),
                                     ptr(out), nbytes(out), stream)
        return out

    # --- registered memory (an epcomm extension) -----------------------------------------------------------

    def register_memory(self, tensor: torch.Tensor) -> None:
        """Registers the memory of tensor's storage with the communicator (the C API's epCommRegister).
        Collective: every rank calls it, each with its own tensor, in the same order. On the GPU engine an HT
        combine whose x lies in registered memory copies nothing into the communicator: the token owners read
        x where it is, and the combine completes only once they have, so x may be reused after it as after
        any combine. Meant for the buffer the experts write their outputs into, step after step. The tensor is
        kept alive until deregister_memory(tensor) or destroy(), and registered again on every communicator the
        Buffer creates later (its first LL call). The peers map the whole CUDA allocation that holds it; memory
        CUDA IPC cannot share (cudaMallocAsync, PyTorch's expandable segments) raises epcomm._capi.Error with
        code NOT_SUPPORTED on every rank. The host engine accepts and ignores it (its combine reads x in place)."""
        if self.runtime is None:
            raise RuntimeError("epcomm.Buffer: the Buffer was destroyed")
        if tensor.device != self._device:
            raise ValueError(f"epcomm.Buffer.register_memory: the tensor is on {tensor.device}, the communicator's "
                             f"engine takes {self._device} tensors")
        storage = tensor.untyped_storage()
        region = _capi.MemRegion(self.runtime, storage.data_ptr(), max(storage.nbytes(), 1))
        self._registered.append([tensor, region])

    def deregister_memory(self, tensor: torch.Tensor) -> None:
        """Ends register_memory(tensor) (the C API's epCommDeregister; collective, in the same order on every
        rank). Waits for this rank's device work first. Combines from it copy again afterwards."""
        for i, (t, region) in enumerate(self._registered):
            if t is tensor:
                region.deregister()
                del self._registered[i]
                return
        raise ValueError("epcomm.Buffer.deregister_memory: the tensor was not registered (register_memory)")

    def get_combine_buffer(self, handle: Tuple, dtype: torch.dtype = torch.bfloat16,
                           hidden: Optional[int] = None) -> torch.Tensor:
        """The [num_recv_tokens, hidden] tensor (num_worst_tokens rows in worst-token mode; hidden: the
        dispatch's unless given) into which the experts write combine(x, handle)'s x. On the GPU engine it is a
        view of the communicator's registered region (the C API's epHtCombineBuffer, the same memory for every
        handle): combine(x=this view, handle) then copies nothing, the token owners read the rows from it.

        Lifetime: write it only after the HT dispatch (any mode) that precedes its combine has been issued --
        on CUDA, on a stream ordered after that dispatch (the current stream once dispatch returned; with
        async_finish, after its event) -- and until that combine is issued; not after that until the next HT
        dispatch. The combine's own later steps (topk_weights) and every later combine use the same memory,
        so do not read x back from it after the combine. The tensor stays valid until destroy() (after the
        communicator is re-created by an LL call, ask again: the old view then combines as a plain x).

        On the host engine (epHtCombineBuffer answers epNotSupported: its combine reads x in place anyway) and
        on the GPU engine with EPCOMM_GPU_HT_COMBINE_PULL=0 it is a Buffer-owned tensor that the combine
        reads like any x."""
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"epcomm.Buffer.get_combine_buffer: dtype must be torch.bfloat16, torch.float16 or "
                            f"torch.float32 (the combine's), got {dtype}")
        if self.runtime is None:
            raise RuntimeError("epcomm.Buffer: the Buffer was destroyed")
        state: HtState = handle.state
        rows = state.num_recv if state.num_recv >= 0 else state.num_worst
        hidden = state.hidden if hidden is None else hidden
        need = rows * hidden * dtype.itemsize
        if self._ht_zero_copy and self._ht_region is None:
            try:
                address, size = self.runtime.ht_combine_buffer()
            except _capi.Error as e:
                if e.code != _capi.NOT_SUPPORTED:
                    raise
                self._ht_zero_copy = False  # the engine's answer, the same on every rank
            else:
                self._ht_region = self._region_bytes(address, size)
        if self._ht_region is not None:
            raw = self._ht_region
            if need > raw.numel():
                raise RuntimeError(f"epcomm.Buffer.get_combine_buffer: the zero-copy region has {raw.numel()} bytes, "
                                   f"[{rows}, {hidden}] {dtype} needs {need} (it holds ht_max_tokens_per_rank x "
                                   "num_ranks rows of ht_max_hidden bf16 values)")
        else:
            raw = self._ht_combine_fallback
            if raw is None or raw.numel() < need:
                raw = torch.empty(need, dtype=torch.uint8, device=self._device)
                self._ht_combine_fallback = raw
        # row i at byte i * hidden * dtype size from the start: the region's layout of a combine's x
        return raw[:need].view(dtype).view(rows, hidden)

    # --- low-latency dispatch / combine ---------------------------------------------------------------------

    def _ll_runtime(self, max_tokens: int, hidden: int, num_experts: int) -> "_capi.Comm":
        """The communicator, re-created first when it lacks the LL capacity of this call (see the module's
        docstring). Collective: every rank makes the same LL call, so every rank gets here together."""
        m, h, e = self._ll_shape
        if max_tokens <= m and hidden <= h and num_experts == e:
            return self.runtime
        if self.runtime is None:
            raise RuntimeError("epcomm.Buffer: the Buffer was destroyed")
        if not all(self.runtime.active_ranks()):
            raise RuntimeError(
                "epcomm.Buffer: this LL call needs the communicator re-created with LL capacity "
                f"(num_max_dispatch_tokens_per_rank={max_tokens}, hidden={hidden}, num_experts={num_experts}), but "
                "ranks are masked and a communicator cannot be created without them; make the first LL call, with "
                "the largest shape, before a rank is masked")
        if self._graph_ht_handles:
            raise RuntimeError(
                "epcomm.Buffer: this LL call needs the communicator re-created with LL capacity "
                f"(num_max_dispatch_tokens_per_rank={max_tokens}, hidden={hidden}, num_experts={num_experts}), but "
                "CUDA graphs captured on this Buffer use the current one; make the first LL call, with the largest "
                "shape, before capturing")
        engine = self.runtime.engine
        self._free_ht_handles.clear()
        if self._ll_region_views or self._ll_zd_slots or self._ht_region is not None:
            self._retired_runtimes.append(self.runtime)  # views of its memory are out there: keep it alive
        else:
            self.runtime.destroy()  # HT handles still held by the caller no longer combine (epcomm says so if used)
        self._ll_region_views.clear()
        self._ll_zd_slots.clear()
        self._ht_region = None  # the new communicator has its own
        self.runtime = None
        shape = (max(max_tokens, m), max(hidden, h), num_experts)
        zd = int(self._ll_zd and engine == _capi.ENGINE_GPU)  # the regions only where dispatch can name them
        # Every rank must take the same path (a mix of zero-copy and plain dispatches times out), whatever each
        # one's EPCOMM_LL_ZERO_COPY_DISPATCH: the regions only where all ranks want them.
        zd = int(all(self._allgather(bytes([zd]))))
        self._ll_zd = zd == 1
        self.runtime = _comm.create(self.group_size, self.rank, self._allgather, num_sms=Buffer.num_sms,
                                    engine=engine, ll_max_tokens_per_rank=shape[0], ll_max_hidden=shape[1],
                                    ll_num_experts=shape[2], ll_zero_copy_dispatch=zd)
        self._comm_generation += 1
        self._ll_shape = shape
        # Registrations belong to a communicator: made again on the new one, in the same order on every rank.
        for entry in self._registered:
            self._retired_regions.append(entry[1])
            storage = entry[0].untyped_storage()
            entry[1] = _capi.MemRegion(self.runtime, storage.data_ptr(), max(storage.nbytes(), 1))
        return self.runtime

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """epcomm's LL needs no zeroed buffer between modes: nothing to clean."""

    def _ll_recv_slot(self, num_local: int, slots: int, hidden: int, dtype: torch.dtype, use_fp8: bool,
                      max_tokens: int, num_experts: int) -> "_LlSlot":
        """LL dispatch outputs, from two sets that alternate, as DeepEP's two buffers do (so at most two LL
        dispatches' results can be held at once): no allocation per call, and fixed addresses for CUDA graphs.
        Each set also caches the C API's argument structs of the dispatch and of the combines that use its
        layout, filled once (see _LlSlot)."""
        key = (num_local, slots, hidden, dtype, use_fp8)
        if self._ll_zd:
            slot = self._ll_zd_slot(key, max_tokens, num_experts)
            if slot is not None:
                return slot
        idx = self._ll_slot_idx
        self._ll_slot_idx ^= 1
        slot = self._ll_recv_slots[idx]
        if slot is None or slot.key != key:
            # Allocated on the current stream, outside any comm-stream context: the set lives as long as the
            # Buffer (or the next shape), and every use of it is ordered after the current stream's work.
            slot = _LlSlot(key, self._device, self.group_size, max_tokens, num_experts)
            self._ll_recv_slots[idx] = slot
        return slot

    def _ll_zd_slot(self, key, max_tokens: int, num_experts: int) -> Optional["_LlSlot"]:
        """The slot over the zero-copy dispatch region that the next dispatch takes (epLlDispatchBuffer; the
        library alternates two, so at most two dispatches' results can be held at once, as with the slots), or
        None where the engine has none (host engine, ranks of other hosts: the same answer on every rank) or the
        call's rows do not fit a region (rows wider than bf16)."""
        try:
            xa, xb, sa, sb = self.runtime.ll_dispatch_buffer()
        except _capi.Error as e:
            if e.code not in (_capi.NOT_SUPPORTED, _capi.INVALID_USAGE):
                raise
            self._ll_zd = False
            return None
        num_local, slots, hidden, dtype, use_fp8 = key
        if num_local * slots * hidden * dtype.itemsize > xb:
            return None
        slot = self._ll_zd_slots.get((key, xa))
        if slot is None:
            region = (self._region_bytes(xa, xb), self._region_bytes(sa, sb))
            slot = _LlSlot(key, self._device, self.group_size, max_tokens, num_experts, region)
            self._ll_zd_slots[(key, xa)] = slot
        return slot

    def _current_stream(self) -> int:
        """cudaStream_t of the current CUDA stream (of the Buffer's device)."""
        return _current_raw_stream(self._device.index)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor, Tuple, EventOverlap, Callable]:
        """Sends each (token, expert) pair to the expert's rank into fixed slots (expert-major). As with DeepEP,
        the outputs live in one of two alternating sets: at most two dispatches' results can be held at once.

        Stream discipline: with async_finish on CUDA, as every Buffer call (the communication stream after the
        current one, an event back). Otherwise the call is ordered within the current stream (as DeepEP's hook
        mode is): the communication stream would be waited for right away, which orders the same work the same
        way, so this saves the two events and the stream switch."""
        if round_scale or use_ue8m0:
            raise NotImplementedError("epcomm.Buffer.low_latency_dispatch: round_scale / use_ue8m0 (power-of-2 and "
                                      "UE8M0 scales) are not supported; epcomm's fp8 scales are amax / 448 in fp32")
        dev = self._device
        if x.device != dev or topk_idx.device != dev:
            self._check("x", x)
            self._check("topk_idx", topk_idx)
        x, topk_idx = x.contiguous(), topk_idx.contiguous()
        num_tokens, hidden = x.shape
        max_tokens = num_max_dispatch_tokens_per_rank
        runtime = self._ll_runtime(max_tokens, hidden, num_experts)
        num_ranks = self.group_size
        slot = self._ll_recv_slot(num_experts // num_ranks, num_ranks * max_tokens, hidden,
                                  torch.float8_e4m3fn if use_fp8 else x.dtype, use_fp8, max_tokens, num_experts)
        dtype, topk, xp, tp = ep_dtype(x.dtype), topk_idx.size(1), ptr(x), ptr(topk_idx)
        stats = cumulative_local_expert_recv_stats
        cuda = self._cuda
        phases = _capi.LL_SEND if return_recv_hook else _capi.LL_SEND_RECV
        keep = (x, topk_idx, stats)
        if cuda and async_finish:
            with _Launch(self, None, True) as launch:
                runtime.ll_dispatch_with(slot.dispatch_args, num_tokens, topk, dtype, xp, tp, phases, 0, launch.stream)
                if not return_recv_hook:
                    slot.received(stats)
            event = launch.finish(keep + slot.tensors)
            stream = None  # the receive hook runs on its caller's current stream (see hook)
        else:
            stream = self._current_stream() if cuda else 0
            runtime.ll_dispatch_with(slot.dispatch_args, num_tokens, topk, dtype, xp, tp, phases, slot.host_range,
                                     stream)
            if not return_recv_hook:
                slot.received(stats)
            event = EventOverlap(EventHandle() if async_finish else None)
        send_stream = torch.cuda.current_stream() if cuda and return_recv_hook and stream is not None else None

        def hook() -> None:
            if stream is not None:  # on the stream of the send half
                if send_stream is None:  # host engine
                    runtime.ll_dispatch_with(slot.dispatch_args, num_tokens, topk, dtype, xp, tp, _capi.LL_RECV,
                                             slot.host_range, stream)
                    slot.received(stats)
                    return
                with torch.cuda.stream(send_stream):  # received()'s torch ops too
                    runtime.ll_dispatch_with(slot.dispatch_args, num_tokens, topk, dtype, xp, tp, _capi.LL_RECV, 0,
                                             stream)
                    slot.received(stats)
                return
            with _Launch(self, None, False) as recv_launch:  # after the send half on the communication stream
                runtime.ll_dispatch_with(slot.dispatch_args, num_tokens, topk, dtype, xp, tp, _capi.LL_RECV, 0,
                                         recv_launch.stream)
                slot.received(stats)
            recv_launch.finish(keep + slot.tensors)

        handle = LowLatencyHandle((slot.src_info, slot.deepep_range, max_tokens, hidden, num_experts),
                                  slot.recv_count, slot.layout_range, slot.combine_args)
        out_x = (slot.recv_x, slot.scales_out) if use_fp8 else slot.recv_x
        return out_x, slot.recv_count, handle, event, (hook if return_recv_hook else None)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> \
            Tuple[torch.Tensor, EventOverlap, Callable]:
        """out[t] = sum over k of topk_weights[t, k] * x[e_k][slot(t, k)], in fp32 in k order. Streams as in
        low_latency_dispatch."""
        if use_logfmt:
            raise NotImplementedError("epcomm.Buffer.low_latency_combine: use_logfmt (LogFMT-compressed combine) is "
                                      "not supported")
        max_tokens, hidden, num_experts = handle[2], handle[3], handle[4]
        runtime = self._ll_runtime(max_tokens, hidden, num_experts)
        dev = self._device
        if zero_copy:
            y = self._ll_combine_buffer(handle, advance=True)  # x's data is not read: y already holds it
        else:
            if x.device != dev:
                self._check("x", x)
            y = x.contiguous()
        if topk_idx.device != dev or topk_weights.device != dev:
            self._check("topk_idx", topk_idx)
            self._check("topk_weights", topk_weights)
        topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous().float()
        num_tokens, topk = topk_idx.shape
        base = handle.combine_args
        cuda = self._cuda
        phases = _capi.LL_SEND if return_recv_hook else _capi.LL_SEND_RECV
        dtype = ep_dtype(y.dtype)
        yp, yb, tp, wp = ptr(y), nbytes(y), ptr(topk_idx), ptr(topk_weights)
        if cuda and async_finish:
            with _Launch(self, None, True) as launch:
                combined = out if out is not None else torch.empty((num_tokens, hidden), dtype=y.dtype, device=dev)
                self._check("out", combined)
                op, ob = ptr(combined), nbytes(combined)
                runtime.ll_combine_with(base, num_tokens, topk, dtype, yp, yb, tp, wp, op, ob, phases, launch.stream)
            keep = (y, topk_idx, topk_weights, handle[0], handle.c_layout_range, handle.recv_count, combined)
            event = launch.finish(keep)
            stream = None
        else:
            combined = out if out is not None else torch.empty((num_tokens, hidden), dtype=y.dtype, device=dev)
            if out is not None:
                self._check("out", combined)
            op, ob = ptr(combined), nbytes(combined)
            stream = self._current_stream() if cuda else 0
            runtime.ll_combine_with(base, num_tokens, topk, dtype, yp, yb, tp, wp, op, ob, phases, stream)
            keep = (y, topk_idx, topk_weights, combined)
            event = EventOverlap(EventHandle() if async_finish else None)

        def hook() -> None:  # holds the call's tensors (keep) until it has run
            if stream is not None:  # on the stream of the send half
                runtime.ll_combine_with(base, num_tokens, topk, dtype, yp, yb, tp, wp, op, ob, _capi.LL_RECV, stream)
                return
            with _Launch(self, None, False) as recv_launch:  # after the send half on the communication stream
                runtime.ll_combine_with(base, num_tokens, topk, dtype, yp, yb, tp, wp, op, ob, _capi.LL_RECV,
                                        recv_launch.stream)
            recv_launch.finish(keep)

        return combined, event, (hook if return_recv_hook else None)

    def _ll_combine_buffer(self, handle, advance: bool) -> torch.Tensor:
        """The next zero-copy combine's y: a view of the communicator's registered region (epLlCombineBuffer,
        GPU engine; the C library alternates two, one per combine), or -- where the engine has none (the host
        engine answers epNotSupported: its combine reads y in place anyway) -- one of two Buffer-owned tensors
        that alternate per zero-copy combine (advance=True: this call is that combine)."""
        max_tokens, hidden, num_experts = handle[2], handle[3], handle[4]
        shape = (num_experts // self.group_size, self.group_size * max_tokens, hidden)
        runtime = self._ll_runtime(max_tokens, hidden, num_experts)
        if self._ll_zero_copy:
            try:
                address, size = runtime.ll_combine_buffer()
            except _capi.Error as e:
                if e.code != _capi.NOT_SUPPORTED:
                    raise
                self._ll_zero_copy = False  # the engine's answer, the same on every rank
            else:
                return self._ll_region_view(address, size, shape)
        if not self._ll_combine_buffers or self._ll_combine_buffers[0].shape != shape:
            self._ll_combine_buffers = [torch.empty(shape, dtype=torch.bfloat16, device=self._device) for _ in range(2)]
        buf = self._ll_combine_buffers[self._ll_buffer_idx]
        if advance:
            self._ll_buffer_idx ^= 1
        return buf

    def _region_bytes(self, address: int, size: int) -> torch.Tensor:
        """uint8 tensor over size bytes of the communicator's memory at address (this rank's device). It keeps the
        communicator alive: a Buffer collected while a view is held frees nothing under it (destroy() still ends
        the views)."""
        device_type, device_id = (2, self._device.index) if self._device.type == "cuda" else (1, 0)
        return torch.from_dlpack(_capi.dlpack_bytes(address, size, device_type, device_id, self.runtime))

    def _ll_region_view(self, address: int, size: int, shape) -> torch.Tensor:
        """shape in bf16 over the first bytes of the region at address (size bytes, this rank's device)."""
        need = shape[0] * shape[1] * shape[2] * 2
        if need > size:
            raise RuntimeError(f"epcomm.Buffer: the zero-copy region has {size} bytes, the combine needs {need}")
        cached = self._ll_region_views.get(address)
        if cached is None or cached[0] != size or cached[1] != shape:
            raw = self._region_bytes(address, size)
            cached = (size, shape, raw[:need].view(torch.bfloat16).view(shape))
            self._ll_region_views[address] = cached
        return cached[2]

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """The bf16 [num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden] tensor that the
        next low_latency_combine(..., zero_copy=True) combines from. On the GPU engine it is a view of the
        communicator's registered memory: the combine then copies nothing on the send side, the peers read the
        rows from it. Write it only between the return of the dispatch (or its receive hook) and that combine;
        it stays valid until the Buffer is destroyed or its communicator re-created. On the host engine it is a
        Buffer-owned tensor (two alternate) that the combine reads in place."""
        return self._ll_combine_buffer(handle, advance=False)

    # --- elastic EP (active-ranks mask) ---------------------------------------------------------------------
    # DeepEP keeps a per-rank int mask in device memory that each rank sets locally (and its LL kernels set on a
    # timeout). Here the mask is the communicator's active-ranks mask (epCommSetActiveRanks): setting it is
    # collective among the ranks it keeps, and a masked rank can never be kept again. It applies to every
    # operation of the Buffer (HT too, not only LL). See the README's "Differences from DeepEP".

    def _require_shrink(self, what: str) -> None:
        if not self.enable_shrink:
            raise RuntimeError(f"epcomm.Buffer.{what}: shrink mode must be enabled (Buffer(..., enable_shrink=True))")
        if self.runtime is None:
            raise RuntimeError("epcomm.Buffer: the Buffer was destroyed")

    def _mask_error(self, msg: str) -> "_capi.Error":
        err = _capi.Error(f"invalid usage: {msg}")
        err.code = _capi.INVALID_USAGE
        return err

    def low_latency_update_mask_buffer(self, rank_to_mask: Union[int, Sequence[int]], mask: bool = False) -> None:
        """Masks (mask=True) rank_to_mask -- an int, or (an epcomm extension) a sequence of ranks masked in one
        step -- on the Buffer's communicator: every later operation runs among the other ranks; dispatch rows
        to a masked rank are dropped (see get_masked_drops) and its contributions are absent from combines.

        Unlike DeepEP's local write, mask=True is collective and synchronous: every surviving rank calls it with
        the same ranks (a masked rank does not call it). It is also how survivors recover after an operation
        failed (epcomm._capi.Error with code TIMEOUT or REMOTE_ERROR, because a rank died): mask the dead rank
        and go on. Ranks asked for in an earlier update that failed (say a second rank was dead too and did not
        take part) are masked again with these, so masking the dead ranks one call at a time converges. A call
        that masks nobody new resynchronizes the survivors (after a timeout in which no rank died).

        mask=False (DeepEP's default: unmask) on a masked rank raises epcomm._capi.Error (invalid usage): a
        masked rank cannot rejoin this communicator. On a rank that is not masked it does nothing."""
        self._require_shrink("low_latency_update_mask_buffer")
        targets = [rank_to_mask] if isinstance(rank_to_mask, int) else [int(r) for r in rank_to_mask]
        for r in targets:
            if not 0 <= r < self.group_size:
                raise ValueError(f"epcomm.Buffer.low_latency_update_mask_buffer: rank {r} is not in [0, "
                                 f"{self.group_size})")
        active = self.runtime.active_ranks()
        if not mask:
            rejoin = [r for r in targets if not active[r]]
            if rejoin:
                raise self._mask_error(f"low_latency_update_mask_buffer: rank(s) {rejoin} are masked and cannot "
                                       "rejoin: epcomm's active-ranks mask only shrinks (create a new Buffer over "
                                       "a new group to bring ranks back)")
            self._mask_wanted.difference_update(targets)  # asked for by an update that failed, never applied
            return
        if self.rank in targets:
            raise ValueError("epcomm.Buffer.low_latency_update_mask_buffer: a rank cannot mask itself (the masked "
                             "rank does not take part; the survivors mask it)")
        self._mask_wanted.update(targets)
        self._mask_wanted.discard(self.rank)
        wanted = [0 if (r in self._mask_wanted or not active[r]) else 1 for r in range(self.group_size)]
        stream = stream_handle(torch.cuda.current_stream()) if self._device.type == "cuda" else 0
        self.runtime.set_active_ranks(wanted, stream)  # raises epcomm's message; the wish is kept for a retry
        self._mask_wanted.clear()

    def recover(self) -> List[int]:
        """An epcomm extension (epCommRecover): low_latency_update_mask_buffer without knowing whom to mask.
        After an operation raised (epcomm._capi.Error, TIMEOUT or REMOTE_ERROR) every surviving rank calls it;
        together they find the ranks to mask (dead, lost across hosts, gone, or silent for twice the deadline),
        agree on one mask and apply it, as a mask=True update would. Returns the mask (1 = active). On failure
        it raises epcomm._capi.Error with .active, the mask as far as it got: .active[rank] == 0 (REMOTE_ERROR)
        means this rank must leave (the others hold it out: it was stopped past the deadline, then resumed; or
        it reaches none of them) and stop using the Buffer; otherwise the call may be retried. Host engine (CPU
        tensors); the GPU engine raises NOT_SUPPORTED: use low_latency_update_mask_buffer with the failed
        ranks."""
        self._require_shrink("recover")
        stream = stream_handle(torch.cuda.current_stream()) if self._device.type == "cuda" else 0
        mask = list(self.runtime.recover(stream))
        self._mask_wanted.clear()
        return mask

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes the mask into mask_status ([num_ranks] torch.int32, any device): 1 = masked, 0 = active. It
        is the communicator's mask in force (what every survivor agreed on), read on the host."""
        self._require_shrink("low_latency_query_mask_buffer")
        if mask_status.numel() != self.group_size or mask_status.dtype != torch.int32:
            raise ValueError(f"epcomm.Buffer.low_latency_query_mask_buffer: mask_status must be [{self.group_size}] "
                             f"torch.int32, got {tuple(mask_status.shape)} {mask_status.dtype}")
        masked = torch.tensor([0 if a else 1 for a in self.runtime.active_ranks()], dtype=torch.int32)
        mask_status.copy_(masked.view(mask_status.shape))

    def low_latency_clean_mask_buffer(self) -> None:
        """DeepEP's clean un-masks every rank. epcomm's mask cannot shrink back: with no rank masked this does
        nothing (and forgets the ranks a failed update asked for); with ranks masked it raises
        epcomm._capi.Error (invalid usage) and changes nothing."""
        self._require_shrink("low_latency_clean_mask_buffer")
        self._mask_wanted.clear()
        active = self.runtime.active_ranks()
        if not all(active):
            masked = [r for r, a in enumerate(active) if not a]
            raise self._mask_error(f"low_latency_clean_mask_buffer: rank(s) {masked} are masked and cannot rejoin: "
                                   "epcomm's active-ranks mask only shrinks")

    def get_masked_drops(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(token_rows, alltoallv_elements): int64 CPU tensors of num_ranks, cumulative per destination rank
        since the communicator was created (the first LL call re-creates it, see the README): dispatch rows
        (HT and LL; one per token and destination rank) and alltoallv elements (the Buffer's own count exchange
        of exact-mode HT dispatch, made only for the full rank_prefix_matrix; int32 units) not sent because the destination was masked. An epcomm
        extension (DeepEP has no such counters)."""
        if self.runtime is None:
            raise RuntimeError("epcomm.Buffer: the Buffer was destroyed")
        stream = stream_handle(torch.cuda.current_stream()) if self._device.type == "cuda" else 0
        rows, elements = self.runtime.masked_drops(stream)
        return torch.tensor(rows, dtype=torch.int64), torch.tensor(elements, dtype=torch.int64)
