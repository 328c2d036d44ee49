"""Per-call overhead of epcomm.Buffer over the C API alone, same run, same communicator and shapes.

    python bench/python/buffer_overhead.py --ranks 2 [--device cuda] [--iters 200] [--csv out.csv]
    torchrun --standalone --nproc-per-node 2 bench/python/buffer_overhead.py [--device cuda] ...

For each operation (HT exact dispatch, HT combine, LL dispatch (into the zero-copy dispatch regions where the
Buffer uses them), LL combine, and LL combine zero-copy where the engine has the registered region): the median
time of the Buffer call and of the bare C API call (through epcomm._capi on the same tensors, its arguments and
outputs prepared once), alternating, and the difference. The host engine (CPU) runs every call synchronously;
on CUDA both are timed to completion (synchronize after each call). The ranks meet over gloo (any number of
ranks may share a GPU; under CUDA MPS for speed).
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchutil  # noqa: E402
import epcomm  # noqa: E402
from epcomm import _capi  # noqa: E402
from epcomm._pointers import ep_dtype, nbytes, ptr  # noqa: E402


def timed_pair(buffer_call, c_call, iters, sync):
    """Median microseconds of each, the two calls alternating so that both see the same machine load."""
    samples = ([], [])
    for _ in range(iters):
        for fn, out in ((buffer_call, samples[0]), (c_call, samples[1])):
            dist.barrier()
            start = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - start)
    return statistics.median(samples[0]) * 1e6, statistics.median(samples[1]) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchutil.add_common_args(ap)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    benchutil.launch(run, args)


def run(args):
    dev = benchutil.rank_device(args.device)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = benchutil.sync_fn(dev)
    buffer = epcomm.Buffer(dist.group.WORLD)
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn((T, H), generator=gen).to(dev, torch.bfloat16)
    topk_idx = torch.rand((T, E), generator=gen).topk(K, dim=-1).indices.to(dev)
    topk_w = torch.rand((T, K), generator=gen).to(dev)
    rows = []

    # HT: exact dispatch (Buffer) vs notify + dispatch (C), then combine
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_w)
    n = recv_x.size(0)
    a = _capi.HtDispatchArgs()
    a.num_tokens, a.hidden, a.topk, a.num_experts, a.dtype = T, H, K, E, ep_dtype(x.dtype)
    a.x, a.topk_idx, a.topk_weights = ptr(x), ptr(topk_idx), ptr(topk_w)
    out_x = torch.empty((n, H), dtype=x.dtype, device=dev)
    a.recv_x, a.recv_x_bytes = ptr(out_x), nbytes(out_x)
    h = _capi.HtHandle(buffer.runtime, T)
    stream = torch.cuda.current_stream().cuda_stream if args.device == "cuda" else 0

    def c_dispatch():
        buffer.runtime.ht_dispatch_notify(a, h, E // world, stream)
        buffer.runtime.ht_dispatch(a, h, stream)

    rows.append(("HT dispatch (exact)", *timed_pair(lambda: buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_w), c_dispatch, args.iters, sync)))
    c = _capi.HtCombineArgs()
    combined = torch.empty((T, H), dtype=x.dtype, device=dev)
    c.num_tokens, c.hidden, c.dtype = T, H, ep_dtype(x.dtype)
    c.x, c.x_bytes, c.combined_x, c.combined_x_bytes = ptr(recv_x), nbytes(recv_x), ptr(combined), nbytes(combined)
    rows.append(("HT combine", *timed_pair(lambda: buffer.combine(recv_x, handle),
                                           lambda: buffer.runtime.ht_combine(c, handle.state.c_handle, stream),
                                           args.iters, sync)))

    # LL: dispatch and combine
    M = T
    try:
        recv, count, ll_handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, M, E, use_fp8=False)
    except _capi.Error as e:
        if rank == 0:
            print(f"LL skipped: {e}")
        recv = None
    if recv is not None:
        L, RM = E // world, world * M
        ld = _capi.LlDispatchArgs()
        ld.num_tokens, ld.max_tokens_per_rank, ld.hidden, ld.topk, ld.num_experts = T, M, H, K, E
        ld.dtype, ld.layout, ld.phases = ep_dtype(x.dtype), _capi.LL_EXPERT_MAJOR, _capi.LL_SEND_RECV
        bufs = [torch.empty((L, RM, H), dtype=x.dtype, device=dev), torch.empty(L, dtype=torch.int32, device=dev),
                torch.empty((L, RM), dtype=torch.int32, device=dev), torch.empty((L, world), dtype=torch.int64, device=dev)]
        ld.x, ld.topk_idx = ptr(x), ptr(topk_idx)
        ld.recv_x, ld.recv_x_bytes = ptr(bufs[0]), nbytes(bufs[0])
        ld.recv_count, ld.recv_count_bytes = ptr(bufs[1]), nbytes(bufs[1])
        ld.recv_src_info, ld.recv_src_info_bytes = ptr(bufs[2]), nbytes(bufs[2])
        ld.recv_layout_range, ld.recv_layout_range_bytes = ptr(bufs[3]), nbytes(bufs[3])
        ll = buffer.runtime  # the one communicator, re-created with LL capacity by the first LL call
        if buffer._ll_zd:  # the Buffer's outputs are zero-copy dispatch regions: the C call names one too (always
            ld.recv_x = ll.ll_dispatch_buffer()[0]  # the same; bufs[0], the C combine's y, is then never written)
        rows.append(("LL dispatch", *timed_pair(lambda: buffer.low_latency_dispatch(x, topk_idx, M, E, use_fp8=False),
                                                lambda: ll.ll_dispatch(ld, stream), args.iters, sync)))
        lc = _capi.LlCombineArgs()
        lc.num_tokens, lc.max_tokens_per_rank, lc.hidden, lc.topk, lc.num_experts = T, M, H, K, E
        lc.dtype, lc.layout, lc.phases = ep_dtype(x.dtype), _capi.LL_EXPERT_MAJOR, _capi.LL_SEND_RECV
        lc.y, lc.y_bytes = ptr(bufs[0]), nbytes(bufs[0])
        lc.recv_count, lc.recv_src_info, lc.recv_layout_range = ptr(bufs[1]), ptr(bufs[2]), ptr(bufs[3])
        lc.topk_idx, lc.topk_weights, lc.out, lc.out_bytes = ptr(topk_idx), ptr(topk_w), ptr(combined), nbytes(combined)
        rows.append(("LL combine", *timed_pair(lambda: buffer.low_latency_combine(recv, topk_idx, topk_w, ll_handle),
                                               lambda: ll.ll_combine(lc, stream), args.iters, sync)))
        # zero-copy: y in the communicator's registered region (GPU engine only)
        try:
            region, _ = ll.ll_combine_buffer()
        except _capi.Error as e:
            if e.code != _capi.NOT_SUPPORTED:
                raise
            region = None
        if region is not None:
            zc = _capi.LlCombineArgs()
            zc.num_tokens, zc.max_tokens_per_rank, zc.hidden, zc.topk, zc.num_experts = T, M, H, K, E
            zc.dtype, zc.layout, zc.phases = ep_dtype(x.dtype), _capi.LL_EXPERT_MAJOR, _capi.LL_SEND_RECV
            zc.y, zc.y_bytes = region, nbytes(bufs[0])
            zc.recv_count, zc.recv_src_info, zc.recv_layout_range = ptr(bufs[1]), ptr(bufs[2]), ptr(bufs[3])
            zc.topk_idx, zc.topk_weights, zc.out, zc.out_bytes = ptr(topk_idx), ptr(topk_w), ptr(combined), nbytes(combined)
            # fresh dispatch outputs for both: the C call's describe its own dispatch
            ll.ll_dispatch(ld, stream)
            sync()
            rows.append(("LL combine zero-copy", *timed_pair(
                lambda: buffer.low_latency_combine(recv, topk_idx, topk_w, ll_handle, zero_copy=True),
                lambda: ll.ll_combine(zc, stream), args.iters, sync)))
    if rank == 0:
        benchutil.print_table(
            f"Buffer per-call overhead over the C API: ranks={world} device={args.device} tokens={T} hidden={H} "
            f"experts={E} top-{K}, median of {args.iters} (us)",
            ["operation", "ranks", "device", "buffer_us", "capi_us", "overhead_us"],
            [(name, world, args.device, b, capi, b - capi) for name, b, capi in rows], args.csv)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
