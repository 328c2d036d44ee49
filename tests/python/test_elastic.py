"""Elastic ranks from Python: the communicator's active-ranks mask behind DeepEP's shrink API
(Buffer.low_latency_update_mask_buffer / query / clean, enable_shrink=True) and behind the process group's
epcomm.set_active_ranks / get_active_ranks / get_masked_drops.

After a rank is masked, LL and HT dispatch/combine run among the survivors and equal a reference computed in
Python from every survivor's inputs with the masked rank's experts dropped (their contributions absent); the
drop counters count what was not sent; unmasking (a rejoin) raises. A killed rank makes the survivors' next
operation raise once; they mask it through the Buffer API (or the process-group function) and go on. The
workers take a device so that tests/python/test_cuda.py runs the same checks on CUDA tensors."""
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import ranks

NUM_TOKENS, HIDDEN, TOPK = 24, 256, 3


def _init(rank, world, init_method, device, backend="gloo"):
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _raises_once(exc, match, dev, call):
    """The first epcomm call after a rank died fails. On the host engine that call itself raises; on CUDA its
    kernel fails at the deadline after the call returned, and the next call of that communicator raises."""
    with pytest.raises(exc, match=match) as info:
        call()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            call()
    return info


def _inputs(rank, num_experts, step):
    """x in [1, 2) (so that every missing contribution shows), routing with some -1 slots, weights in [0.5, 1)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = (1 + torch.rand((NUM_TOKENS, HIDDEN), generator=gen)).to(torch.bfloat16)
    topk_idx = torch.rand((NUM_TOKENS, num_experts), generator=gen).topk(TOPK, dim=-1).indices.to(torch.int64)
    topk_idx[torch.rand((NUM_TOKENS, TOPK), generator=gen) < 0.1] = -1
    w = 0.5 + 0.5 * torch.rand((NUM_TOKENS, TOPK), generator=gen)
    return x, topk_idx, w


def _gather(t, group, survivors):
    """{global rank: that survivor's t} over the survivors' gloo group."""
    parts = [torch.empty_like(t) for _ in survivors]
    dist.all_gather(parts, t.contiguous(), group=group)
    return dict(zip(survivors, parts))


def _owner(topk_idx, num_local):
    return torch.where(topk_idx >= 0, topk_idx // num_local, -1)


def _factor(expert):
    """The stand-in expert's scale, a power of two (exact in bf16)."""
    return float(2 ** (expert % 3))


def check_masked(buffer, rank, world, masked, surv_group, survivors, dev, step):
    """LL and HT dispatch/combine on a Buffer whose communicator has `masked` masked, against references."""
    import epcomm

    num_experts = 2 * world
    num_local = num_experts // world
    active = torch.tensor([0 if r in masked else 1 for r in range(world)], dtype=torch.bool)
    status = torch.empty(world, dtype=torch.int32, device=dev)
    buffer.low_latency_query_mask_buffer(status)
    assert set(status.cpu().nonzero().view(-1).tolist()) == set(masked)

    x, topk_idx, w = _inputs(rank, num_experts, step)
    xs, idxs, ws = (_gather(t, surv_group, survivors) for t in (x, topk_idx, w))
    owner = _owner(topk_idx, num_local)
    dropped_tokens = torch.tensor([int((owner == r).any(dim=1).sum()) if r in masked else 0 for r in range(world)])

    # --- LL dispatch: only the survivors' rows arrive; a masked source's count and range read 0 -------------
    rows0, elems0 = buffer.get_masked_drops()
    recv_x, recv_count, handle, event, _ = buffer.low_latency_dispatch(
        x.to(dev), topk_idx.to(dev), NUM_TOKENS, num_experts, use_fp8=False)
    rows1, elems1 = buffer.get_masked_drops()
    assert torch.equal(rows1 - rows0, dropped_tokens), (rows1 - rows0, dropped_tokens)
    assert torch.equal(elems1, elems0)
    src_info, layout_range = handle[0].cpu(), handle[1].cpu()
    recv_x, recv_count = recv_x.cpu(), recv_count.cpu()
    for i in range(num_local):
        e = rank * num_local + i
        assert int(recv_count[i]) == sum(int((idxs[s] == e).sum()) for s in survivors)
        for s in range(world):
            begin, count = int(layout_range[i, s] >> 32), int(layout_range[i, s] & 0xFFFFFFFF)
            if s in masked:
                assert count == 0
                continue
            tokens = (idxs[s] == e).any(dim=1).nonzero().view(-1)
            assert count == tokens.numel()
            got_tokens = src_info[i, begin:begin + count].long() % NUM_TOKENS
            assert sorted(got_tokens.tolist()) == tokens.tolist()
            assert torch.equal(recv_x[i, begin:begin + count], xs[s][got_tokens])

    # --- LL combine: the masked rank's experts contribute nothing --------------------------------------------
    y = recv_x.clone()
    for i in range(num_local):
        y[i] = (recv_x[i].float() * _factor(rank * num_local + i)).to(torch.bfloat16)
    combined, _, _ = buffer.low_latency_combine(y.to(dev), topk_idx.to(dev), w.to(dev), handle)
    ref = torch.zeros((NUM_TOKENS, HIDDEN), dtype=torch.float32)
    for k in range(TOPK):
        for t in range(NUM_TOKENS):
            e = int(topk_idx[t, k])
            if e >= 0 and bool(active[e // num_local]):
                ref[t] += float(w[t, k]) * (x[t].float() * _factor(e)).to(torch.bfloat16).float()
    assert torch.allclose(combined.cpu().float(), ref.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)

    # --- HT layout, dispatch, cached dispatch, combine ---------------------------------------------------------
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx.to(dev), num_experts)
    in_rank_ref = torch.stack([(owner == r).any(dim=1) & active[r] for r in range(world)], dim=1)
    assert torch.equal(in_rank.cpu(), in_rank_ref)
    assert per_rank.cpu().tolist() == in_rank_ref.sum(dim=0).tolist()
    assert per_expert.cpu().tolist() == [int((topk_idx == e).sum()) if active[e // num_local] else 0
                                         for e in range(num_experts)]
    rows0, elems0 = buffer.get_masked_drops()
    recv_x, recv_idx, recv_w, per_expert_list, ht_handle, _ = buffer.dispatch(
        x.to(dev), topk_idx=topk_idx.to(dev), topk_weights=w.to(dev), num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    rows1, elems1 = buffer.get_masked_drops()
    assert torch.equal(rows1 - rows0, dropped_tokens)
    # no count exchange by default (rank_prefix_matrix's own column comes from the C layout) ...
    assert torch.equal(elems1, elems0)
    # ... and with full_rank_prefix_matrix the exchange (world + num_experts int32 per destination) skips masked
    # ranks too
    buffer.full_rank_prefix_matrix = True
    try:
        *_, full_handle, _ = buffer.dispatch(
            x.to(dev), topk_idx=topk_idx.to(dev), topk_weights=w.to(dev), num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    finally:
        buffer.full_rank_prefix_matrix = False
    _, elems2 = buffer.get_masked_drops()
    assert torch.equal(elems2 - elems1, torch.tensor([world + num_experts if r in masked else 0 for r in range(world)]))
    assert torch.equal(full_handle[0][:, rank], ht_handle[0][:, rank])
    ref_x, ref_idx, ref_w, ref_counts = [], [], [], []
    for s in survivors:
        o = _owner(idxs[s], num_local)
        sel = (o == rank).any(dim=1)
        ref_x.append(xs[s][sel])
        ref_idx.append(torch.where(o[sel] == rank, idxs[s][sel] - rank * num_local, -1))
        ref_w.append(torch.where(o[sel] == rank, ws[s][sel], 0.0))
    ref_x, ref_idx, ref_w = torch.cat(ref_x), torch.cat(ref_idx), torch.cat(ref_w)
    assert torch.equal(recv_x.cpu(), ref_x) and torch.equal(recv_idx.cpu(), ref_idx)
    assert torch.equal(recv_w.cpu(), ref_w)
    assert per_expert_list == [int((ref_idx == i).sum()) for i in range(num_local)]
    recv_from = [0] * world
    for s in survivors:
        recv_from[s] = int((_owner(idxs[s], num_local) == rank).any(dim=1).sum())
    assert ht_handle[0][:, rank].tolist() == torch.tensor(recv_from).cumsum(0).tolist()

    cached_x, *_ = buffer.dispatch((x * 2).to(dev), handle=ht_handle)
    assert torch.equal(cached_x.cpu(), ref_x * 2)

    combined_x, combined_w, _ = buffer.combine(recv_x, ht_handle, topk_weights=recv_w)
    n_dest = in_rank_ref.sum(dim=1, keepdim=True).float()
    assert torch.equal(combined_x.cpu(), (x.float() * n_dest).to(torch.bfloat16))
    kept = (topk_idx >= 0) & active[owner.clamp(min=0)]
    assert torch.equal(combined_w.cpu(), torch.where(kept, w, 0.0))
    return ht_handle


def _survivor_group(world, masked):
    survivors = [r for r in range(world) if r not in masked]
    return survivors, dist.new_group(survivors, backend="gloo")  # every rank takes part in creating it


def _ll_warmup(buffer, rank, world, dev):
    """The first LL call sizes (re-creates) the communicator; it must come before any rank is masked."""
    num_experts = 2 * world
    x, topk_idx, w = _inputs(rank, num_experts, 0)
    _, _, handle, _, _ = buffer.low_latency_dispatch(x.to(dev), topk_idx.to(dev), NUM_TOKENS, num_experts,
                                                     use_fp8=False)
    buffer.low_latency_combine(torch.zeros((num_experts // world, world * NUM_TOKENS, HIDDEN), dtype=torch.bfloat16,
                                           device=dev), topk_idx.to(dev), w.to(dev), handle)


def masked_rank(rank, world, init_method, masked, device="cpu"):
    """A live rank masked by the others: survivors' operations match the references; the masked rank waits."""
    import epcomm

    dev = _init(rank, world, init_method, device)
    store = dist.distributed_c10d._get_default_store()
    survivors, surv_group = _survivor_group(world, {masked})
    plain = epcomm.Buffer(dist.group.WORLD)
    with pytest.raises(RuntimeError, match="enable_shrink=True"):
        plain.low_latency_query_mask_buffer(torch.zeros(world, dtype=torch.int32))
    buffer = epcomm.Buffer(dist.group.WORLD, int(1e8), 0, low_latency_mode=True, explicitly_destroy=True,
                           enable_shrink=True)
    _ll_warmup(buffer, rank, world, dev)
    status = torch.ones(world, dtype=torch.int32, device=dev)
    buffer.low_latency_query_mask_buffer(status)
    assert status.cpu().tolist() == [0] * world
    buffer.low_latency_clean_mask_buffer()          # nothing masked: nothing to clean
    buffer.low_latency_update_mask_buffer(masked)   # DeepEP's default mask=False unmasks: not masked, a no-op
    # an HT layout made before the mask changes (used below: refused afterwards)
    x, topk_idx, w = _inputs(rank, 2 * world, 1)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx.to(dev), 2 * world)
    old_x, _, _, _, old_handle, _ = buffer.dispatch(x.to(dev), topk_idx=topk_idx.to(dev), topk_weights=w.to(dev),
                                                    num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                    num_tokens_per_expert=per_expert)
    if rank == masked:
        store.wait(["elastic/done"], datetime.timedelta(seconds=120))  # alive, but takes part in nothing
        buffer.destroy()
        return

    with pytest.raises(ValueError, match="cannot mask itself"):
        buffer.low_latency_update_mask_buffer(rank, mask=True)
    buffer.low_latency_update_mask_buffer(masked, mask=True)  # collective among the survivors
    assert buffer.runtime.active_ranks() == [0 if r == masked else 1 for r in range(world)]

    with pytest.raises(epcomm._capi.Error, match="invalid usage") as info:
        buffer.combine(old_x, old_handle)               # a layout from before the mask change
    assert info.value.code == epcomm._capi.INVALID_USAGE

    for step in (2, 3):
        check_masked(buffer, rank, world, {masked}, surv_group, survivors, dev, step)

    # a rejoin is refused, locally and without changing anything
    for call in (lambda: buffer.low_latency_update_mask_buffer(masked),
                 lambda: buffer.low_latency_update_mask_buffer(masked, mask=False),
                 buffer.low_latency_clean_mask_buffer):
        with pytest.raises(epcomm._capi.Error, match="cannot rejoin") as info:
            call()
        assert info.value.code == epcomm._capi.INVALID_USAGE
    # masking the masked rank again masks nobody new: a resynchronization, the communicator stays usable
    buffer.low_latency_update_mask_buffer([masked], mask=True)
    check_masked(buffer, rank, world, {masked}, surv_group, survivors, dev, 4)
    buffer.destroy()
    dist.barrier(group=surv_group)
    if rank == survivors[0]:
        store.set("elastic/done", "1")


@pytest.mark.parametrize("masked", [2, 0])
def test_masked_rank(masked):
    ranks.run(4, masked_rank, masked)


def killed_rank(rank, world, init_method, device="cpu"):
    """The last rank dies between operations: the survivors' next LL dispatch raises once (timeout or remote
    error, within the deadline), they mask it through the Buffer API and go on, LL and HT matching the
    references; then another rank dies and the survivors of that mask it as well (CPU: with Buffer.recover,
    which finds it by itself)."""
    import epcomm

    dev = _init(rank, world, init_method, device)
    dead = world - 1
    survivors, surv_group = _survivor_group(world, {dead})
    survivors2, surv_group2 = _survivor_group(world, {dead, 1}) if world >= 3 else (None, None)
    buffer = epcomm.Buffer(dist.group.WORLD, int(1e8), 0, low_latency_mode=True, enable_shrink=True)
    _ll_warmup(buffer, rank, world, dev)
    buffer.runtime.barrier()  # every rank has finished the warm-up before one dies
    if rank == dead:
        os._exit(1)
    x, topk_idx, _ = _inputs(rank, 2 * world, 1)
    start = time.monotonic()
    info = _raises_once(epcomm._capi.Error, "timeout|remote", dev, lambda: buffer.low_latency_dispatch(
        x.to(dev), topk_idx.to(dev), NUM_TOKENS, 2 * world, use_fp8=False))
    assert info.value.code in (epcomm._capi.TIMEOUT, epcomm._capi.REMOTE_ERROR)
    assert time.monotonic() - start < 15
    buffer.low_latency_update_mask_buffer(dead, mask=True)
    check_masked(buffer, rank, world, {dead}, surv_group, survivors, dev, 2)

    if survivors2 is None:
        return
    # a second rank dies (rank 1) before an HT dispatch
    buffer.runtime.barrier()
    if rank == 1:
        os._exit(1)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx.to(dev), 2 * world)
    _raises_once(epcomm._capi.Error, "timeout|remote", dev, lambda: buffer.dispatch(
        x.to(dev), topk_idx=topk_idx.to(dev), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert))
    if dev.type == "cpu":  # the host engine finds the dead rank by itself (Buffer.recover, epCommRecover)
        assert buffer.recover() == [0 if r in (1, dead) else 1 for r in range(world)]
    else:
        buffer.low_latency_update_mask_buffer(1, mask=True)
    check_masked(buffer, rank, world, {dead, 1}, surv_group2, survivors2, dev, 3)
    status = torch.zeros(world, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [1 if r in (1, dead) else 0 for r in range(world)]


def test_killed_rank_buffer():
    ranks.run(4, killed_rank, env={"EPCOMM_TIMEOUT_MS": "3000"}, expect_exit={1, 3}, timeout=180)


def killed_rank_group(rank, world, init_method, device="cpu"):
    """The process group: a killed rank makes all_to_all_single raise DistBackendError once; the survivors
    call epcomm.set_active_ranks (CPU: epcomm.recover, which finds the dead rank by itself) and the group's
    epcomm operations go on among them."""
    import epcomm

    dev = _init(rank, world, init_method, device, backend="epcomm")
    dead = world - 1
    assert epcomm.get_active_ranks() == [1] * world
    out = torch.empty((world, 4), device=dev)
    dist.all_to_all_single(out, torch.full((world, 4), float(rank), device=dev))
    dist.barrier()
    if rank == dead:
        os._exit(1)
    _raises_once(dist.DistBackendError, "epcomm all_to_all_single failed: (timeout|remote)", dev,
                 lambda: dist.all_to_all_single(out, torch.full((world, 4), float(rank), device=dev)))
    active = [0 if r == dead else 1 for r in range(world)]
    if dev.type == "cpu":
        assert epcomm.recover() == active
    else:
        epcomm.set_active_ranks(active)
    assert epcomm.get_active_ranks() == active
    before = epcomm.get_masked_drops(dev)[1]
    out = torch.full((world, 4), -1.0, device=dev)
    dist.all_to_all_single(out, torch.full((world, 4), float(rank), device=dev))
    expect = torch.arange(world, dtype=torch.float32).repeat_interleave(4).view(world, 4)
    expect[dead] = -1  # nothing arrives from a masked rank: its range is left as it was
    assert torch.equal(out.cpu(), expect)
    drops = epcomm.get_masked_drops(dev)[1] - before
    assert drops.tolist() == [4 if r == dead else 0 for r in range(world)]
    # all_to_all_v: device counts of a masked source read 0
    recv_counts = torch.full((world,), -1, dtype=torch.int64, device=dev)
    out = torch.zeros((2 * world, 4), device=dev)
    epcomm.all_to_all_v(out, torch.full((2 * world, 4), float(rank), device=dev),
                        torch.full((world,), 2, dtype=torch.int64, device=dev), recv_counts)
    assert recv_counts.cpu().tolist() == [0 if r == dead else 2 for r in range(world)]
    dist.barrier()  # among the survivors
    with pytest.raises(RuntimeError):
        epcomm.set_active_ranks([1] * world)  # a rejoin: refused by epcomm (invalid usage)


def test_killed_rank_group():
    ranks.run(4, killed_rank_group, env={"EPCOMM_TIMEOUT_MS": "3000"}, expect_exit={3}, timeout=120)


def silent_rank_group(rank, world, init_method):
    """A rank that stays silent past the deadline (alive, calling nothing): the others' all_to_all_single raises
    once, epcomm.recover() masks it without being told whom (after twice the deadline), and they go on among
    themselves; the silent rank, back, is told that it must leave (host engine, CPU tensors)."""
    import epcomm

    _init(rank, world, init_method, "cpu", backend="epcomm")
    silent = world - 1
    flag = init_method[len("file://"):] + ".recovered"
    out = torch.empty((world, 4))
    dist.all_to_all_single(out, torch.full((world, 4), float(rank)))  # the CPU communicator exists on every rank
    if rank == silent:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(flag), "the others never recovered"
        with pytest.raises(RuntimeError, match="hold this rank out"):
            epcomm.recover()
        return
    with pytest.raises(dist.DistBackendError, match="epcomm all_to_all_single failed: timeout"):
        dist.all_to_all_single(out, torch.full((world, 4), float(rank)))
    active = [0 if r == silent else 1 for r in range(world)]
    assert epcomm.recover() == active
    assert epcomm.get_active_ranks() == active
    if rank == 0:
        open(flag, "w").close()
    out = torch.full((world, 4), -1.0)
    dist.all_to_all_single(out, torch.full((world, 4), float(rank)))
    expect = torch.arange(world, dtype=torch.float32).repeat_interleave(4).view(world, 4)
    expect[silent] = -1  # nothing arrives from a masked rank: its range is left as it was
    assert torch.equal(out, expect)


def test_silent_rank_group():
    ranks.run(3, silent_rank_group, env={"EPCOMM_TIMEOUT_MS": "1500"}, timeout=120)
