"""The same faces on CUDA tensors (GPU engine); skipped without a GPU. Ranks: EPCOMM_GPU_TEST_RANKS (default
2), rank r on GPU r % device_count; ranks that share a GPU want CUDA MPS (see the README). References: the
CPU results of the same calls (host engine, or gloo)."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

import ranks
import test_buffer
import test_deepep_pattern
import test_elastic

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
WORLD = int(os.environ.get("EPCOMM_GPU_TEST_RANKS", "2"))


def test_buffer_ht_cuda():
    ranks.run(WORLD, test_buffer.ht, 3, "cuda")


def _buffer_on(engine):
    import epcomm

    os.environ["EPCOMM_ENGINE"] = engine  # the engine of a communicator is chosen when it is created
    try:
        return epcomm.Buffer(dist.group.WORLD)
    finally:
        del os.environ["EPCOMM_ENGINE"]


def ll_cuda(rank, world, init_method):
    """LL dispatch/combine on the GPU engine equal the host engine's, or raise epNotSupported cleanly: bf16 and
    fp8, with the outputs in the communicator's zero-copy dispatch regions (the default on the GPU engine; the
    two alternate, bf16 taking one and fp8 the other) and in Buffer-owned tensors (Buffer.ll_zero_copy_dispatch =
    False)."""
    import epcomm

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    host, gpu = _buffer_on("host"), _buffer_on("gpu")
    zero_copy_default, epcomm.Buffer.ll_zero_copy_dispatch = epcomm.Buffer.ll_zero_copy_dispatch, False
    try:
        gpu_copy = _buffer_on("gpu")
    finally:
        epcomm.Buffer.ll_zero_copy_dispatch = zero_copy_default
    gen = torch.Generator().manual_seed(rank)
    num_experts, hidden, max_tokens = 4 * world, 256, 16

    def same_rows(got, count, ref, ref_count, fp8):
        """The GPU dispatch's counts and received rows (fp8: values and scales) equal the host engine's."""
        assert torch.equal(count.cpu(), ref_count)
        for e in range(num_experts // world):
            n = int(ref_count[e])
            if fp8:
                assert torch.equal(got[0][e, :n].cpu().view(torch.uint8), ref[0][e, :n].view(torch.uint8))
                assert torch.equal(got[1][e, :n].cpu(), ref[1][e, :n])
            else:
                assert torch.equal(got[e, :n].cpu(), ref[e, :n])
    for it in range(3):
        x = torch.randn((max_tokens, hidden), generator=gen).to(torch.bfloat16)
        topk_idx = torch.rand((max_tokens, num_experts), generator=gen).topk(3, dim=-1).indices
        w = torch.rand((max_tokens, 3), generator=gen)
        for fp8 in (False, True):
            ref, ref_count, ref_handle, _, _ = host.low_latency_dispatch(x, topk_idx, max_tokens, num_experts,
                                                                         use_fp8=fp8)
            for buf, zero_copy in ((gpu, True), (gpu_copy, False)):
                try:
                    got, count, handle, _, _ = buf.low_latency_dispatch(x.cuda(), topk_idx.cuda(), max_tokens,
                                                                        num_experts, use_fp8=fp8)
                except epcomm._capi.Error as e:
                    assert e.code == epcomm._capi.NOT_SUPPORTED, e
                    return
                assert buf._ll_zd == zero_copy, (buf._ll_zd, zero_copy)  # the GPU engine on one host has regions
                if zero_copy:  # the rows are in the communicator's memory, not in a Buffer-owned tensor
                    data = (got[0] if fp8 else got).data_ptr()
                    assert data in [k[1] for k in buf._ll_zd_slots], hex(data)
                torch.cuda.synchronize()
                same_rows(got, count, ref, ref_count, fp8)
                if not fp8:
                    out_ref = host.low_latency_combine(ref, topk_idx, w, ref_handle)[0]
                    out = buf.low_latency_combine(got, topk_idx.cuda(), w.cuda(), handle)[0]
                    assert torch.equal(out.cpu(), out_ref)
    # Two results held at once, through receive hooks (async_finish on the second): a zero-copy region stays valid
    # until this rank's second dispatch after the one that filled it has started, so both regions are read after
    # both dispatches, and each result is combined after the other's dispatch.
    batches = []
    for _ in range(2):
        x = torch.randn((max_tokens, hidden), generator=gen).to(torch.bfloat16)
        topk_idx = torch.rand((max_tokens, num_experts), generator=gen).topk(3, dim=-1).indices
        w = torch.rand((max_tokens, 3), generator=gen)
        ref, ref_count, ref_handle, _, _ = host.low_latency_dispatch(x, topk_idx, max_tokens, num_experts,
                                                                     use_fp8=False)
        batches.append((x, topk_idx, w, ref, ref_count, host.low_latency_combine(ref, topk_idx, w, ref_handle)[0]))
    for buf in (gpu, gpu_copy):
        held = []
        for i, (x, topk_idx, _, _, _, _) in enumerate(batches):
            got, count, handle, event, hook = buf.low_latency_dispatch(
                x.cuda(), topk_idx.cuda(), max_tokens, num_experts, use_fp8=False, async_finish=i == 1,
                return_recv_hook=True)
            hook()
            held.append((got, count, handle, event))
        if buf._ll_zd:  # the two results are the two regions
            assert held[0][0].data_ptr() != held[1][0].data_ptr()
        held[1][3].current_stream_wait()
        torch.cuda.synchronize()
        for (got, count, _, _), (_, _, _, ref, ref_count, _) in zip(held, batches):
            same_rows(got, count, ref, ref_count, False)
        for (got, _, handle, _), (_, topk_idx, w, _, _, out_ref) in zip(held, batches):
            out = buf.low_latency_combine(got, topk_idx.cuda(), w.cuda(), handle)[0]
            assert torch.equal(out.cpu(), out_ref)
    dist.destroy_process_group()


def test_ll_cuda():
    ranks.run(WORLD, ll_cuda)


def test_ll_zero_copy_cuda():
    """get_next_low_latency_combine_buffer is a view of the communicator's registered region (epLlCombineBuffer),
    zero-copy combines equal plain ones, and HT and LL share the one communicator (see test_buffer)."""
    ranks.run(WORLD, test_buffer.ll_zero_copy, "cuda")


def test_ht_zero_copy_cuda():
    """get_combine_buffer is a view of the communicator's registered region (epHtCombineBuffer), and combine from
    it equals combine from a plain tensor bit for bit, over dispatches of every mode with fresh inputs (see
    test_buffer)."""
    ranks.run(WORLD, test_buffer.ht_zero_copy, "cuda")


def test_ht_registered_cuda():
    """register_memory: HT combines from a registered tensor (read in place by the token owners) equal plain
    combines bit for bit, before and after the communicator is re-created by an LL call (see test_buffer)."""
    ranks.run(WORLD, test_buffer.ht_registered, "cuda")


def captured(rank, world, init_method):
    """Worst-token dispatch -> expert stand-in -> combine captured in a CUDA graph and replayed with fresh
    inputs equals the eager result each time."""
    import epcomm

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    buffer = epcomm.Buffer(dist.group.WORLD)
    num_tokens, hidden, num_experts = 64, 512, 4 * world
    worst = num_tokens * world
    static_x = torch.zeros((num_tokens, hidden), dtype=torch.bfloat16, device="cuda")
    static_idx = torch.zeros((num_tokens, 2), dtype=torch.int64, device="cuda")
    static_w = torch.zeros((num_tokens, 2), dtype=torch.float32, device="cuda")

    def step():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(static_idx, num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            static_x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=static_idx, topk_weights=static_w, num_worst_tokens=worst)
        y = (recv_x.float() * (recv_w.sum(dim=1, keepdim=True) + 1)).to(torch.bfloat16)
        return buffer.combine(y, handle)[0]

    def fresh(i):
        gen = torch.Generator().manual_seed(1000 * i + rank)
        static_x.copy_(torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16))
        static_idx.copy_(torch.rand((num_tokens, num_experts), generator=gen).topk(2, dim=-1).indices)
        static_w.copy_(torch.rand((num_tokens, 2), generator=gen))

    fresh(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: creates the communicator's handles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for i in range(1, int(os.environ.get("EPCOMM_GPU_TEST_REPLAYS", "50")) + 1):
        fresh(i)
        eager = step().clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager), f"replay {i} differs from eager"
    dist.destroy_process_group()


def test_graph_capture_cuda():
    ranks.run(WORLD, captured)


def backend_cuda(rank, world, init_method):
    dist.init_process_group("epcomm", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    for async_op in (False, True):
        inp = torch.full((world, 4), float(rank), device="cuda")
        out = torch.empty_like(inp)
        work = dist.all_to_all_single(out, inp, async_op=async_op)
        if async_op:
            work.wait()
        assert torch.equal(out.cpu(), torch.arange(world, dtype=torch.float32).repeat_interleave(4).view(world, 4))
    if torch.cuda.device_count() >= world:  # the inner NCCL backend needs a GPU per rank
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        assert t.sum().item() == 4 * world
    dist.barrier()
    dist.destroy_process_group()


def test_backend_cuda():
    ranks.run(WORLD, backend_cuda)


def test_deepep_intranode_pattern_cuda():
    ranks.run(WORLD, test_deepep_pattern.intranode, "cuda")


def test_deepep_low_latency_pattern_cuda():
    try:
        ranks.run(WORLD, test_deepep_pattern.low_latency, "cuda")
    except AssertionError as e:
        if "_capi.Error: not supported" in str(e):
            pytest.skip("the GPU engine of this build has no LL (epNotSupported)")
        raise


def test_deepep_low_latency_shrink_pattern_cuda():
    """DeepEP's --shrink-test schedule (rank 1 fails at dispatch, rank 3 at combine, where they exist)."""
    ranks.run(WORLD, test_deepep_pattern.low_latency, "cuda", True)


# --- elastic ranks (the same workers as tests/python/test_elastic.py, on CUDA tensors and the GPU engine) ----

def test_elastic_masked_rank_cuda():
    ranks.run(WORLD, test_elastic.masked_rank, 1, "cuda")


def test_elastic_killed_rank_buffer_cuda():
    exits = {WORLD - 1} | ({1} if WORLD >= 3 else set())
    ranks.run(WORLD, test_elastic.killed_rank, "cuda", env={"EPCOMM_TIMEOUT_MS": "3000"}, expect_exit=exits,
              timeout=240)


def test_elastic_killed_rank_group_cuda():
    """The process group on CUDA tensors (see the README's known problem of the CUDA backend)."""
    ranks.run(WORLD, test_elastic.killed_rank_group, "cuda", env={"EPCOMM_TIMEOUT_MS": "3000"},
              expect_exit={WORLD - 1}, timeout=180)


def backend_graphs(rank, world, init_method):
    """On the epcomm backend (CUDA tensors; ranks may share a GPU): all_to_all_single and epcomm.all_to_all_v captured
    in CUDA graphs and replayed with fresh inputs equal eager calls each time; then a captured MoE layer (router,
    dispatch, per-expert matmuls, combine) replayed with fresh inputs equals the eager layer."""
    import epcomm

    dist.init_process_group("epcomm", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    replays = int(os.environ.get("EPCOMM_GPU_TEST_REPLAYS", "50"))
    gen = torch.Generator(device="cuda").manual_seed(17 + rank)

    def capture(fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up outside the capture: creates communicators and handles
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = fn()
        return graph, out

    # all_to_all_single, equal splits
    inp = torch.empty((world * 8, 64), device="cuda")
    a2a_out = torch.empty_like(inp)

    def a2a():
        dist.all_to_all_single(a2a_out, inp)
        return a2a_out

    graph, static = capture(a2a)
    for i in range(replays):
        inp.normal_(generator=gen)
        graph.replay()
        got = static.clone()
        want = torch.empty_like(inp)
        dist.all_to_all_single(want, inp)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"all_to_all_single replay {i} differs from eager"

    # all_to_all_v: counts in device memory, fixed-capacity output
    cap = 8 * world
    v_in = torch.empty((8 * world, 32), device="cuda")
    counts = torch.zeros(world, dtype=torch.int64, device="cuda")
    v_out = torch.zeros((cap, 32), device="cuda")
    v_recv = torch.zeros(world, dtype=torch.int64, device="cuda")

    def a2av():
        epcomm.all_to_all_v(v_out, v_in, counts, v_recv)
        return v_out

    counts.fill_(1)
    graph, _ = capture(a2av)
    for i in range(replays):
        v_in.normal_(generator=gen)
        counts.copy_(torch.randint(0, 9, (world,), device="cuda", generator=gen))
        graph.replay()
        got, got_counts = v_out.clone(), v_recv.clone()
        want, want_counts = torch.zeros_like(v_out), torch.zeros_like(v_recv)
        epcomm.all_to_all_v(want, v_in, counts, want_counts)
        torch.cuda.synchronize()
        n = int(want_counts.sum())
        assert torch.equal(got_counts, want_counts) and torch.equal(got[:n], want[:n]), \
            f"all_to_all_v replay {i} differs from eager"

    # A DeepSeek-style MoE layer: router -> top-k -> dispatch -> per-expert matmul -> combine, in one graph.
    tokens, hidden, experts, topk = 64, 256, 4 * world, 2
    local = experts // world
    router = torch.randn((hidden, experts), device="cuda", generator=gen) / hidden ** 0.5
    weights = torch.randn((local, hidden, hidden), device="cuda", generator=gen) / hidden ** 0.5
    x = torch.empty((tokens, hidden), dtype=torch.bfloat16, device="cuda")
    buffer = epcomm.Buffer(dist.group.WORLD)

    def layer():
        probs = (x.float() @ router).softmax(dim=-1)
        w, idx = probs.topk(topk, dim=-1)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, num_worst_tokens=tokens * world)
        y = torch.zeros((recv_x.size(0), hidden), device="cuda")
        for e in range(local):
            coef = (recv_w * (recv_idx == e)).sum(dim=1, keepdim=True)
            y += coef * (recv_x.float() @ weights[e])
        return buffer.combine(y.to(torch.bfloat16), handle)[0]

    x.normal_(generator=gen)
    graph, static = capture(layer)
    for i in range(replays):
        x.copy_(torch.randn((tokens, hidden), device="cuda", generator=gen).to(torch.bfloat16))
        graph.replay()
        got = static.clone()
        want = layer()
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"MoE layer replay {i} differs from eager"
    dist.barrier()
    dist.destroy_process_group()


def test_backend_graphs_cuda():
    ranks.run(WORLD, backend_graphs)
