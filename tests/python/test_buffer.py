"""epcomm.Buffer (DeepEP's legacy API) on the host engine, checked against references built from
torch.distributed's own collectives (gloo) on random routing: HT exact, worst-token and cached dispatch,
combine (with top-k weights and bias, and from get_combine_buffer), fp8 input, zero-token ranks; LL
dispatch/combine (bf16 and fp8, with and without receive hooks, zero-copy)."""
import datetime

import pytest
import torch
import torch.distributed as dist

import ranks


def _init(rank, world, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _routing(gen, num_tokens, num_experts, topk):
    scores = torch.rand((num_tokens, num_experts), generator=gen)
    topk_idx = torch.topk(scores, topk, dim=-1).indices.to(torch.int64)
    topk_idx[torch.rand((num_tokens, topk), generator=gen) < 0.1] = -1  # some slots choose no expert
    topk_weights = torch.rand((num_tokens, topk), generator=gen)
    return topk_idx, topk_weights


def _reference_dispatch(world, rank, x, topk_idx, topk_weights, num_local):
    """What each rank receives, through dist.all_to_all_single: rows by source rank, then token index."""
    dest = torch.where(topk_idx >= 0, topk_idx // num_local, -1)
    rows, idx, wts, send = [], [], [], []
    for d in range(world):
        sel = (dest == d).any(dim=1)
        rows.append(x[sel])
        local = torch.where(dest[sel] == d, topk_idx[sel] - d * num_local, -1)
        idx.append(local)
        wts.append(torch.where(dest[sel] == d, topk_weights[sel], 0.0))
        send.append(int(sel.sum()))
    recv = torch.tensor(send)
    counts = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(counts, recv)
    recv_counts = counts.tolist()

    def exchange(parts, width, dtype):
        out = torch.empty((sum(recv_counts), width), dtype=dtype)
        dist.all_to_all_single(out, torch.cat(parts).contiguous(), recv_counts, send)
        return out

    return (exchange(rows, x.size(1), x.dtype), exchange(idx, topk_idx.size(1), torch.int64),
            exchange(wts, topk_idx.size(1), torch.float32), recv_counts, send)


def _reference_combine(world, y, recv_counts, send, num_tokens, dest_mask):
    """Rows back to their owners (all_to_all_single), summed per token in ascending rank order in fp32."""
    back = torch.empty((sum(send), y.size(1)), dtype=y.dtype)
    dist.all_to_all_single(back, y.contiguous(), send, recv_counts)
    acc = torch.zeros((num_tokens, y.size(1)), dtype=torch.float32)
    off = 0
    for d in range(world):
        sel = dest_mask[:, d]
        n = int(sel.sum())
        acc[sel] += back[off:off + n].float()
        off += n
    return acc.to(y.dtype)


def _set_device(rank, device):
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ht(rank, world, init_method, seed, device="cpu"):
    """References are computed on CPU tensors over gloo; the Buffer gets the same data on `device`."""
    import epcomm

    _init(rank, world, init_method)
    dev = _set_device(rank, device)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    num_experts, topk, hidden = 4 * world, 3, 256
    num_local = num_experts // world
    buffer = epcomm.Buffer(dist.group.WORLD, int(1e8))

    def on(*ts):
        return [t.to(dev) if isinstance(t, torch.Tensor) else t for t in ts]

    def back(t):
        return t.cpu() if isinstance(t, torch.Tensor) else t

    for num_tokens in (37, 0 if rank == world - 1 else 21, 0):   # then a rank with no tokens, then none at all
        x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)
        topk_idx, topk_weights = _routing(gen, num_tokens, num_experts, topk)
        ref_x, ref_idx, ref_w, recv_counts, send = _reference_dispatch(world, rank, x, topk_idx, topk_weights, num_local)
        x_d, topk_idx_d, topk_weights_d = on(x, topk_idx, topk_weights)

        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx_d, num_experts)
        dest = torch.where(topk_idx >= 0, topk_idx // num_local, -1)
        dest_mask = torch.stack([(dest == d).any(dim=1) for d in range(world)], dim=1)
        assert torch.equal(back(in_rank), dest_mask)
        assert per_rank.tolist() == send
        assert per_expert.tolist() == [int((topk_idx == e).sum()) for e in range(num_experts)]
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

        for async_finish in (False, True):
            recv_x, recv_idx, recv_w, per_expert_list, handle, event = buffer.dispatch(
                x_d, topk_idx=topk_idx_d, topk_weights=topk_weights_d, async_finish=async_finish,
                previous_event=buffer.capture(), **layout)
            if async_finish:
                event.current_stream_wait()
            assert torch.equal(back(recv_x), ref_x) and torch.equal(back(recv_idx), ref_idx)
            assert torch.equal(back(recv_w), ref_w)
            assert per_expert_list == [int((ref_idx == e).sum()) for e in range(num_local)]
            rank_prefix = handle[0]
            assert rank_prefix[:, rank].tolist() == torch.tensor(recv_counts).cumsum(0).tolist()

        # expert_alignment rounds the per-expert counts up
        _, _, _, aligned, _, _ = buffer.dispatch(x_d, topk_idx=topk_idx_d, topk_weights=topk_weights_d,
                                                expert_alignment=4, **layout)
        assert aligned == [(c + 3) // 4 * 4 for c in per_expert_list]

        # worst-token mode: static shapes, the tail padded with -1 / 0
        worst = 37 * world
        w_x, w_idx, w_w, empty_list, w_handle, _ = buffer.dispatch(
            x_d, topk_idx=topk_idx_d, topk_weights=topk_weights_d, num_worst_tokens=worst, **layout)
        w_x, w_idx, w_w = back(w_x), back(w_idx), back(w_w)
        n = recv_x.size(0)
        assert empty_list == [] and w_x.size(0) == worst
        assert torch.equal(w_x[:n], ref_x) and torch.equal(w_idx[:n], ref_idx) and torch.equal(w_w[:n], ref_w)
        assert bool((w_idx[n:] == -1).all()) and bool((w_w[n:] == 0).all())

        # cached dispatch reuses the handle's layout (no top-k)
        x2 = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)
        ref2 = _reference_dispatch(world, rank, x2, topk_idx, topk_weights, num_local)[0]
        c_x, c_idx, c_w, c_list, c_handle, _ = buffer.dispatch(on(x2)[0], handle=handle)
        assert torch.equal(back(c_x), ref2) and c_idx is None and c_w is None and c_list is None and c_handle is None

        # routing by is_token_in_rank alone: no top-k back, per-expert counts from num_tokens_per_expert
        n_x, n_idx, n_w, n_list, _, _ = buffer.dispatch(x_d, **layout)
        assert torch.equal(back(n_x), ref_x) and n_idx is None and n_w is None and n_list == per_expert_list

        # combine: each rank scales its rows; the owner sums them in rank order in fp32
        y = (ref_x.float() * (rank + 1)).to(torch.bfloat16)
        ref = _reference_combine(world, y, recv_counts, send, num_tokens, dest_mask)
        combined, combined_w, _ = buffer.combine(on(y)[0], handle, topk_weights=recv_w)
        assert torch.equal(back(combined), ref)
        ref_w_sum = _reference_combine(world, ref_w, recv_counts, send, num_tokens, dest_mask)
        assert torch.equal(back(combined_w), ref_w_sum)
        bias = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)
        combined_b, _, _ = buffer.combine(on(y)[0], handle, bias=tuple(on(bias, bias)))
        assert torch.equal(back(combined_b), (ref.float() + bias.float() + bias.float()).to(torch.bfloat16))
        # worst-token handle: combine of the padded rows
        y_w = torch.zeros((worst, hidden), dtype=torch.bfloat16)
        y_w[:n] = y
        assert torch.equal(back(buffer.combine(on(y_w)[0], w_handle)[0]), ref)

        # fp8 input (e4m3 with per-128-column scales), scales handed in column-major as DeepEP's tests do
        scales = (x.float().view(num_tokens, hidden // 128, 128).abs().amax(dim=-1) / 448).clamp(min=1e-4)
        x_fp8 = (x.float().view(num_tokens, hidden // 128, 128) / scales.unsqueeze(-1)).view(num_tokens, hidden).to(torch.float8_e4m3fn)
        fp8_in = tuple(on(x_fp8, scales.T.contiguous().T))
        (f_x, f_s), _, _, _, _, _ = buffer.dispatch(fp8_in, topk_idx=topk_idx_d, topk_weights=topk_weights_d, **layout)
        ref_f = _reference_dispatch(world, rank, x_fp8.view(torch.uint8), topk_idx, topk_weights, num_local)[0]
        ref_s = _reference_dispatch(world, rank, scales, topk_idx, topk_weights, num_local)[0]
        assert torch.equal(back(f_x).view(torch.uint8), ref_f) and torch.equal(back(f_s), ref_s)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ht(world):
    ranks.run(world, ht, 1)


def ll(rank, world, init_method, seed):
    import epcomm

    _init(rank, world, init_method)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    num_experts, topk, hidden, max_tokens = 4 * world, 4, 256, 24
    num_local = num_experts // world
    buffer = epcomm.Buffer(dist.group.WORLD, 0, epcomm.Buffer.get_low_latency_rdma_size_hint(
        max_tokens, hidden, world, num_experts), low_latency_mode=True, num_qps_per_rank=num_local)
    for num_tokens in (max_tokens, 0 if rank == 0 else 9, 0):
        x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)
        topk_idx, topk_weights = _routing(gen, num_tokens, num_experts, topk)
        everyone = [None] * world
        dist.all_gather_object(everyone, (x, topk_idx))
        for use_fp8 in (False, True):
            for hook_mode in (False, True):
                stats = torch.zeros(num_local, dtype=torch.int32)
                recv, recv_count, handle, event, hook = buffer.low_latency_dispatch(
                    x, topk_idx, max_tokens, num_experts, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                    async_finish=not hook_mode, return_recv_hook=hook_mode)
                if hook_mode:
                    hook()
                else:
                    event.current_stream_wait()
                recv_x = recv[0].float() * recv[1].repeat_interleave(128, dim=-1) if use_fp8 else recv
                # reference: rows of each local expert, by source rank, then token (a duplicate expert once)
                for e in range(num_local):
                    g = rank * num_local + e
                    ref = torch.cat([sx[(si == g).any(dim=1)] for sx, si in everyone])
                    assert int(recv_count[e]) == ref.size(0) == int(stats[e])
                    # DeepEP's layout range: (begin << 32) | count of the rows from each source rank
                    begins, counts = (handle[1][e] >> 32).tolist(), (handle[1][e] & 0xFFFFFFFF).tolist()
                    assert counts == [int((si == g).any(dim=1).sum()) for _, si in everyone]
                    assert begins == [sum(counts[:j]) for j in range(world)]
                    assert handle[0][e, :ref.size(0)].tolist() == torch.cat(
                        [(si == g).any(dim=1).nonzero().view(-1) for _, si in everyone]).tolist()
                    got = recv_x[e, :ref.size(0)]
                    if use_fp8:
                        assert torch.allclose(got, ref.float(), rtol=0.07, atol=1e-2)
                    else:
                        assert torch.equal(got, ref)
                if use_fp8:
                    continue
                # combine: expert e's output is its rows scaled by (global id + 1) / 8
                scale = ((torch.arange(num_local) + rank * num_local + 1).float() / 8).view(-1, 1, 1)
                y = (recv_x.float() * scale).to(torch.bfloat16)
                ref = torch.zeros((num_tokens, hidden))
                for k in range(topk):
                    e = topk_idx[:, k]
                    v = (x.float() * ((e + 1).float() / 8).unsqueeze(1)).to(torch.bfloat16).float()
                    ref += torch.where((e >= 0).unsqueeze(1), topk_weights[:, k:k + 1] * v, 0.0)
                ref = ref.to(torch.bfloat16)
                for zero_copy in (False, True):
                    out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16)
                    if zero_copy:
                        buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
                    combined, event, c_hook = buffer.low_latency_combine(
                        y, topk_idx, topk_weights, handle, zero_copy=zero_copy, return_recv_hook=hook_mode, out=out)
                    if hook_mode:
                        c_hook()
                    assert combined.data_ptr() == out.data_ptr() or num_tokens == 0
                    assert torch.equal(combined, ref), (combined - ref).abs().max()
    buffer.clean_low_latency_buffer(max_tokens, hidden, num_experts)
    for call in (lambda: buffer.low_latency_update_mask_buffer(0, True),
                 lambda: buffer.low_latency_query_mask_buffer(torch.zeros(world, dtype=torch.int32)),
                 buffer.low_latency_clean_mask_buffer):
        with pytest.raises(RuntimeError, match="enable_shrink=True"):  # as DeepEP: shrink mode must be enabled
            call()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ll(world):
    ranks.run(world, ll, 2)


def api_surface(rank, world, init_method):
    import epcomm

    _init(rank, world, init_method)
    assert epcomm.topk_idx_t == torch.int64
    cfg = epcomm.Buffer.get_dispatch_config(world)
    assert isinstance(cfg, epcomm.Config) and epcomm.Buffer.get_combine_config(world).num_sms == epcomm.Buffer.num_sms
    assert cfg.get_nvl_buffer_size_hint(7168 * 2, world) > 0
    epcomm.Buffer.set_num_sms(24)
    assert epcomm.Buffer.num_sms == 24 and epcomm.Buffer.is_sm90_compiled()
    buffer = epcomm.Buffer(dist.group.WORLD, 1 << 20, explicitly_destroy=True)
    t = buffer.get_local_buffer_tensor(torch.bfloat16, torch.Size([4, 8]), offset=16)
    assert t.shape == (4, 8) and t.dtype == torch.bfloat16
    with buffer.capture():
        pass
    buffer.get_comm_stream()
    with pytest.raises(ValueError, match="on meta"):
        buffer.get_dispatch_layout(torch.zeros((2, 2), dtype=torch.int64, device="meta"), 4 * world)
    shrink = epcomm.Buffer(dist.group.WORLD, enable_shrink=True)  # the active-ranks mask (test_elastic.py)
    status = torch.ones(world, dtype=torch.int32)
    shrink.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * world
    shrink.low_latency_clean_mask_buffer()
    rows, elements = shrink.get_masked_drops()
    assert rows.tolist() == elements.tolist() == [0] * world
    # rank_prefix_matrix: by default only this rank's column (from the C layout, no communication); with
    # full_rank_prefix_matrix every column, through a count exchange on the communicator (alltoallv) or, where
    # the engine has none, on the group
    topk_idx = torch.tensor([[0, 2 * world - 1]] * (rank + 1), dtype=torch.int64)
    n_rank, _, n_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 2 * world)
    sent = torch.tensor([[r + 1 if d in (0, world - 1) else 0 for d in range(world)] for r in range(world)])
    full = sent.cumsum(dim=0).to(torch.int32)
    own_column = torch.zeros_like(full)
    own_column[:, rank] = full[:, rank]
    for full_matrix, alltoallv_unsupported, want in ((False, False, own_column), (True, False, full),
                                                     (True, True, full)):
        buffer.full_rank_prefix_matrix = full_matrix
        buffer._alltoallv_unsupported = alltoallv_unsupported
        _, _, _, _, handle, _ = buffer.dispatch(torch.ones((rank + 1, 16), dtype=torch.bfloat16), topk_idx=topk_idx,
                                                num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                                num_tokens_per_expert=n_expert)
        assert torch.equal(handle[0], want), (full_matrix, alltoallv_unsupported, handle[0], want)
    buffer.destroy()
    dist.destroy_process_group()


def test_api_surface():
    ranks.run(2, api_surface)


def _ll_expert_ref(x, topk_idx, topk_weights):
    """LL combine's result when expert e's output is its rows scaled by (e + 1) / 8 (fp32 terms, k order)."""
    ref = torch.zeros((x.size(0), x.size(1)))
    for k in range(topk_idx.size(1)):
        e = topk_idx[:, k]
        v = (x.float() * ((e + 1).float() / 8).unsqueeze(1)).to(torch.bfloat16).float()
        ref += torch.where((e >= 0).unsqueeze(1), topk_weights[:, k:k + 1] * v, 0.0)
    return ref.to(torch.bfloat16)


def ll_zero_copy(rank, world, init_method, device="cpu"):
    """get_next_low_latency_combine_buffer and low_latency_combine(zero_copy=True) on one communicator that
    also runs HT: on the GPU engine the buffer is a view of the C API's registered region (epLlCombineBuffer),
    two alternating; on the host engine (epNotSupported there) a Buffer-owned tensor, two alternating. Both
    combine like a plain combine."""
    import epcomm
    from epcomm import _capi

    _init(rank, world, init_method)
    dev = _set_device(rank, device)
    gen = torch.Generator().manual_seed(77 + rank)
    num_experts, topk, hidden, max_tokens = 4 * world, 3, 256, 16
    num_local = num_experts // world
    buffer = epcomm.Buffer(dist.group.WORLD, 0, epcomm.Buffer.get_low_latency_rdma_size_hint(
        max_tokens, hidden, world, num_experts), low_latency_mode=True, num_qps_per_rank=num_local)
    first_comm = buffer.runtime

    # the first LL call re-creates the communicator with LL capacity; from then on HT and LL share it: an HT
    # dispatch made now is combined after several LL calls
    x = torch.randn((max_tokens, hidden), generator=gen).to(torch.bfloat16)
    topk_idx, topk_weights = _routing(gen, max_tokens, num_experts, topk)
    x_d, idx_d, w_d = x.to(dev), topk_idx.to(dev), topk_weights.to(dev)
    buffer.low_latency_dispatch(x_d, idx_d, max_tokens, num_experts, use_fp8=False)
    assert buffer.runtime is not first_comm and buffer._comm_generation == 1  # re-created once, with LL capacity
    ll_comm = buffer.runtime
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx_d, num_experts)
    ht_x, _, _, _, ht_handle, _ = buffer.dispatch(x_d, topk_idx=idx_d, topk_weights=w_d, num_tokens_per_rank=per_rank,
                                                  is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    engine_region = None
    try:
        engine_region = buffer.runtime.ll_combine_buffer()
    except _capi.Error as e:
        assert e.code == _capi.NOT_SUPPORTED and "zero-copy" in str(e), e
    assert (engine_region is not None) == (dev.type == "cuda"), (dev, engine_region)

    ref = _ll_expert_ref(x, topk_idx, topk_weights)
    seen = []
    for hook_mode in (False, True, False, True):
        recv, _, handle, event, hook = buffer.low_latency_dispatch(
            x_d, idx_d, max_tokens, num_experts, use_fp8=False, async_finish=not hook_mode, return_recv_hook=hook_mode)
        hook() if hook_mode else event.current_stream_wait()
        scale = ((torch.arange(num_local, device=dev) + rank * num_local + 1).float() / 8).view(-1, 1, 1)
        y = (recv.float() * scale).to(torch.bfloat16)
        plain, _, c_hook = buffer.low_latency_combine(y, idx_d, w_d, handle, return_recv_hook=hook_mode)
        if hook_mode:
            c_hook()
        assert torch.equal(plain.cpu(), ref), (plain.cpu().float() - ref.float()).abs().max()

        zc = buffer.get_next_low_latency_combine_buffer(handle)
        assert zc.dtype == torch.bfloat16 and zc.shape == (num_local, world * max_tokens, hidden), zc.shape
        assert zc.device == dev and zc.is_contiguous()
        assert buffer.get_next_low_latency_combine_buffer(handle).data_ptr() == zc.data_ptr()  # stable until used
        if engine_region is not None:
            address, size = buffer.runtime.ll_combine_buffer()
            assert zc.data_ptr() == address and zc.numel() * 2 <= size
        zc[:, :, :] = y
        # x's data is not read in zero-copy mode (DeepEP passes its GEMM output anyway)
        out = torch.empty((max_tokens, hidden), dtype=torch.bfloat16, device=dev)
        combined, event, c_hook = buffer.low_latency_combine(torch.zeros_like(y), idx_d, w_d, handle, zero_copy=True,
                                                             async_finish=not hook_mode, return_recv_hook=hook_mode,
                                                             out=out)
        c_hook() if hook_mode else event.current_stream_wait()
        assert combined.data_ptr() == out.data_ptr()
        assert torch.equal(combined.cpu(), ref), (combined.cpu().float() - ref.float()).abs().max()
        seen.append(zc.data_ptr())
    # two buffers alternate (on the GPU engine: two combines per round, so each round starts on the same one)
    assert len(set(seen)) in (1, 2)
    if engine_region is None:
        assert len(set(seen)) == 2 and seen[0] == seen[2] and seen[1] == seen[3]

    # the HT handle from before still combines on the same communicator, after the LL calls
    assert buffer.runtime is ll_comm and buffer._comm_generation == 1
    combined, _, _ = buffer.combine(ht_x, ht_handle)
    dest = torch.where(topk_idx >= 0, topk_idx // num_local, -1)
    copies = torch.stack([(dest == d).any(dim=1) for d in range(world)], dim=1).sum(dim=1, keepdim=True)
    assert torch.equal(combined.cpu(), (x.float() * copies).to(torch.bfloat16))
    # an LL call of a smaller shape keeps the communicator; a larger one re-creates it
    buffer.low_latency_dispatch(x_d[:4], idx_d[:4], max_tokens // 2, num_experts, use_fp8=False)
    assert buffer._comm_generation == 1
    buffer.low_latency_dispatch(x_d, idx_d, 2 * max_tokens, num_experts, use_fp8=False)
    assert buffer._comm_generation == 2 and buffer._ll_shape == (2 * max_tokens, hidden, num_experts)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ll_zero_copy_one_comm(world):
    ranks.run(world, ll_zero_copy)


def _ht_dispatch_mode(buffer, x, mode, state, gen, num_experts, topk, worst):
    """One HT dispatch of x for the combine tests' rounds, returning recv_x. "cached" reuses the layout of the
    dispatch state holds; "exact", "async" (async_finish) and "worst" (num_worst_tokens=worst) route x afresh and
    keep the handle, the received weights and the token count in state. Work on the current stream afterwards is
    ordered after the dispatch (async: after its event)."""
    if mode == "cached":  # the previous dispatch's layout, fresh x
        return buffer.dispatch(x, handle=state["handle"])[0]
    topk_idx, topk_weights = (t.to(x.device) for t in _routing(gen, x.size(0), num_experts, topk))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, _, recv_w, _, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, async_finish=mode == "async",
        num_worst_tokens=worst if mode == "worst" else 0)
    if mode == "async":
        event.current_stream_wait()
    state.update(handle=handle, recv_w=recv_w, num_tokens=x.size(0))
    return recv_x


def ht_zero_copy(rank, world, init_method, device="cpu"):
    """get_combine_buffer and combine(x=that tensor): on the GPU engine a view of the C API's registered region
    (epHtCombineBuffer), on the host engine (epNotSupported there) a Buffer-owned tensor. Either combines bit
    for bit like a plain x, over dispatches of every mode (exact, async, cached, worst-token) with fresh inputs
    each, with and without topk_weights, in bf16 and fp32, and after an LL call re-created the communicator."""
    import os

    import epcomm
    from epcomm import _capi

    _init(rank, world, init_method)
    dev = _set_device(rank, device)
    gen = torch.Generator().manual_seed(91 + rank)
    num_experts, topk, hidden, max_tokens = 4 * world, 3, 256, 24
    worst = max_tokens * world
    buffer = epcomm.Buffer(dist.group.WORLD, explicitly_destroy=True)

    engine_region = None
    try:
        engine_region = buffer.runtime.ht_combine_buffer()
    except _capi.Error as e:
        assert e.code == _capi.NOT_SUPPORTED and "zero-copy" in str(e), e
    pull = os.environ.get("EPCOMM_GPU_HT_COMBINE_PULL", "1") != "0"
    assert (engine_region is not None) == (dev.type == "cuda" and pull), (dev, engine_region)

    last = {}  # the latest non-cached dispatch: its handle, weights and token count

    def one_round(i, mode):
        num_tokens = last["num_tokens"] if mode == "cached" else (0 if i == 4 and rank == world - 1 else max_tokens)
        x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16).to(dev)
        recv_x = _ht_dispatch_mode(buffer, x, mode, last, gen, num_experts, topk, worst)
        handle, recv_w = last["handle"], last["recv_w"]
        dtype = torch.float32 if i % 3 == 2 else torch.bfloat16
        y = (recv_x.float() * (rank + 1 + i / 8)).to(dtype)  # the expert stand-in
        zc = buffer.get_combine_buffer(handle, dtype)
        assert zc.shape == recv_x.shape and zc.dtype == dtype, (mode, zc.shape, recv_x.shape, zc.dtype)
        assert zc.device == dev and zc.is_contiguous()
        assert buffer.get_combine_buffer(handle, dtype).data_ptr() == zc.data_ptr()  # stable
        if engine_region is not None and zc.numel() > 0:
            address, size = buffer.runtime.ht_combine_buffer()
            assert zc.data_ptr() == address and zc.numel() * zc.element_size() <= size
        zc.copy_(y)
        weights = recv_w if i % 2 == 0 else None
        got, got_w, _ = buffer.combine(zc, handle, topk_weights=weights)
        # the plain combine after it (on the GPU engine it copies y into the region: zc is not written between)
        want, want_w, _ = buffer.combine(y, handle, topk_weights=weights)
        assert got.dtype == dtype and torch.equal(got.cpu(), want.cpu()), (mode, i)
        assert (got_w is None) == (weights is None)
        if weights is not None:
            assert torch.equal(got_w.cpu(), want_w.cpu()), (mode, i)
        return zc

    for i, mode in enumerate(("exact", "async", "cached", "worst", "exact", "cached", "worst", "async")):
        old = one_round(i, mode)

    # An LL call re-creates the communicator with LL capacity: the one whose region was handed out stays alive
    # until destroy() (the view held still points at live memory); the new one hands out its own.
    x = torch.randn((4, hidden), generator=gen).to(torch.bfloat16).to(dev)
    topk_idx = _routing(gen, 4, num_experts, topk)[0].to(dev)
    buffer.low_latency_dispatch(x, topk_idx, 8, num_experts, use_fp8=False)
    assert len(buffer._retired_runtimes) == (1 if engine_region is not None else 0)
    old.zero_()  # no peer reads it any more: each checked its last combine before the re-creation's all-gather
    for i, mode in enumerate(("exact", "cached"), start=8):
        one_round(i, mode)

    with pytest.raises(TypeError, match="dtype"):
        buffer.get_combine_buffer(last["handle"], torch.int32)
    dist.barrier()
    buffer.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.get_combine_buffer(last["handle"])
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ht_zero_copy(world):
    ranks.run(world, ht_zero_copy)


def ht_registered(rank, world, init_method, device="cpu"):
    """register_memory: combines whose x is a view of a registered tensor equal plain combines bit for bit, over
    dispatches of every mode with fresh inputs, before and after an LL call re-creates the communicator (the
    Buffer registers the tensor again there); after deregister_memory the same x combines by copy. A tensor on
    another device and an unregistered one are refused."""
    import epcomm

    _init(rank, world, init_method)
    dev = _set_device(rank, device)
    gen = torch.Generator().manual_seed(57 + rank)
    num_experts, topk, hidden, max_tokens = 4 * world, 3, 256, 24
    worst = max_tokens * world
    buffer = epcomm.Buffer(dist.group.WORLD, explicitly_destroy=True)
    ybuf = torch.empty((worst + 8, hidden), dtype=torch.float32, device=dev)  # the experts' output buffer
    buffer.register_memory(ybuf)
    if dev.type == "cuda":
        with pytest.raises(ValueError, match="is on cpu"):
            buffer.register_memory(torch.empty(4))
    with pytest.raises(ValueError, match="not registered"):
        buffer.deregister_memory(torch.empty(4, device=dev))

    def one_round(i, mode, state):
        num_tokens = state.get("num_tokens", max_tokens) if mode == "cached" else max_tokens - (i % 3)
        x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16).to(dev)
        recv_x = _ht_dispatch_mode(buffer, x, mode, state, gen, num_experts, topk, worst)
        dtype = torch.float32 if i % 2 else torch.bfloat16
        y = (recv_x.float() * (rank + 1 + i / 8)).to(dtype)
        view = ybuf.view(-1).view(torch.uint8)[:y.numel() * y.element_size()].view(dtype).view(y.shape)  # in ybuf
        view.copy_(y)
        got, got_w, _ = buffer.combine(view, state["handle"], topk_weights=state["recv_w"])
        want, want_w, _ = buffer.combine(y, state["handle"], topk_weights=state["recv_w"])
        assert torch.equal(got.cpu(), want.cpu()) and torch.equal(got_w.cpu(), want_w.cpu()), (mode, i)

    state = {}
    for i, mode in enumerate(("exact", "cached", "worst", "exact")):
        one_round(i, mode, state)
    # An LL call re-creates the communicator: the registration is made again on the new one.
    x = torch.randn((4, hidden), generator=gen).to(torch.bfloat16).to(dev)
    buffer.low_latency_dispatch(x, _routing(gen, 4, num_experts, topk)[0].to(dev), 8, num_experts, use_fp8=False)
    assert len(buffer._registered) == 1 and buffer._registered[0][1].registered
    state = {}
    for i, mode in enumerate(("exact", "worst", "cached"), start=4):
        one_round(i, mode, state)
    buffer.deregister_memory(ybuf)
    assert buffer._registered == []
    one_round(7, "exact", {})  # the same views, combined by copy now
    dist.barrier()
    buffer.destroy()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ht_registered(world):
    ranks.run(world, ht_registered)


def test_dlpack_bytes():
    """The binding's DLPack capsule aliases the memory it was given; an unconsumed capsule frees itself."""
    from epcomm import _capi

    base = torch.arange(64, dtype=torch.uint8)
    view = torch.from_dlpack(_capi.dlpack_bytes(base.data_ptr(), 64, 1))
    assert view.dtype == torch.uint8 and view.shape == (64,) and view.data_ptr() == base.data_ptr()
    view[3] = 200
    assert int(base[3]) == 200
    for _ in range(100):
        _capi.dlpack_bytes(base.data_ptr(), 64, 1)  # dropped unconsumed
    with pytest.raises(ValueError):
        _capi.dlpack_bytes(base.data_ptr(), 64, 7)
    # an owner lives as long as the storage of the tensor made from the capsule (views of it included), or as
    # the capsule when it is never consumed
    import gc
    import weakref

    class Owner:
        pass

    owner = Owner()
    alive = weakref.ref(owner)
    view = torch.from_dlpack(_capi.dlpack_bytes(base.data_ptr(), 64, 1, 0, owner))
    part = view[8:16].view(torch.int32)
    del owner, view
    gc.collect()
    assert alive() is not None and part.data_ptr() == base.data_ptr() + 8
    del part
    gc.collect()
    assert alive() is None
    owner = Owner()
    alive = weakref.ref(owner)
    _capi.dlpack_bytes(base.data_ptr(), 64, 1, 0, owner)  # dropped unconsumed
    del owner
    gc.collect()
    assert alive() is None
