"""epcomm.Buffer driven the way DeepEP's own legacy test scripts drive deep_ep.Buffer (intranode and
low-latency): the same calls, arguments and kinds of checks (data tagged with the source rank and token
index, rank_prefix_matrix, worst-token padding, cached dispatch, combine by similarity, the LL layout range
and source info, and the low-latency script's --shrink-test: ranks failing on a schedule, the mask-buffer
queries, counts and combines over the unmasked ranks), written for epcomm. The workers take a device, so that the same checks run on CUDA
(tests/python/test_cuda.py)."""
import datetime

import pytest
import torch
import torch.distributed as dist

import ranks


def similarity_gap(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - cosine-like similarity of two tensors (0 when equal)."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


def to_fp8(x: torch.Tensor):
    """e4m3 with one fp32 scale per 128 columns of each row (amax / 448)."""
    t, h = x.shape
    blocks = x.float().view(t, h // 128, 128)
    scales = (blocks.abs().amax(dim=-1) / 448).clamp(min=1e-4 / 448)
    return (blocks / scales.unsqueeze(-1)).view(t, h).to(torch.float8_e4m3fn), scales


def from_fp8(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    t, h = x.shape
    return (x.float().view(t, h // 128, 128) * scales.view(t, h // 128, 1)).view(t, h).to(torch.bfloat16)


def _init(rank, world, init_method, device):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def intranode(rank, world, init_method, device="cpu"):
    import epcomm

    dev = _init(rank, world, init_method, device)
    torch.manual_seed(rank)
    num_tokens, hidden, num_topk, num_experts = 64, 256, 4, 4 * world
    buffer = epcomm.Buffer(dist.group.WORLD, int(1e9), 0, explicitly_destroy=True)

    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device=dev) * rank
    x_pure_rand = torch.randn((num_tokens, hidden), dtype=torch.bfloat16, device=dev)
    x_e4m3 = to_fp8(x) if epcomm.Buffer.is_sm90_compiled() else None
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)  # column-major scales, as DeepEP's test passes them
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32, device=dev).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=False)[1].to(epcomm.topk_idx_t)
    topk_weights = torch.ones((num_tokens, num_topk), dtype=torch.float32, device=dev) * rank
    topk_weights_pure_rand = torch.randn((num_tokens, num_topk), dtype=torch.float32, device=dev)
    rank_idx = topk_idx // (num_experts // world)
    is_token_in_rank = torch.stack([(rank_idx == r).any(dim=1) for r in range(world)], dim=1)
    num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int)
    num_tokens_per_expert = torch.stack([(topk_idx == e).sum() for e in range(num_experts)]).to(torch.int)
    gbl_per_expert = num_tokens_per_expert.cpu().clone()
    dist.all_reduce(gbl_per_expert)
    gbl_per_rank = num_tokens_per_rank.cpu().clone()
    dist.all_reduce(gbl_per_rank)

    ref_per_rank, _, ref_per_expert, ref_in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    assert torch.allclose(ref_per_rank, num_tokens_per_rank)
    assert torch.allclose(ref_per_expert, num_tokens_per_expert)
    assert torch.equal(ref_in_rank, is_token_in_rank)
    config = epcomm.Config(24, 8, 256)

    def check_data(check_x, rank_prefix_matrix):
        assert torch.allclose(check_x.amin(dim=1), check_x.amax(dim=1))
        start = 0
        for i in range(world):
            end = rank_prefix_matrix[i][rank].item()
            assert (check_x[start:end, :].int() - i).sum().item() == 0
            start = end

    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in (x_pure_rand, x, x_e4m3):
                for with_topk in (False, True):
                    args = {"x": current_x, "num_tokens_per_rank": num_tokens_per_rank,
                            "is_token_in_rank": is_token_in_rank, "num_tokens_per_expert": num_tokens_per_expert,
                            "config": config, "async_finish": async_mode}
                    if with_topk:
                        args.update({"topk_idx": topk_idx, "topk_weights":
                                     topk_weights_pure_rand if current_x is x_pure_rand else topk_weights})
                    if previous_mode:
                        args.update({"previous_event": buffer.capture()})
                    recv_x, recv_topk_idx, recv_topk_weights, recv_list, handle, event = buffer.dispatch(**args)
                    event.current_stream_wait() if async_mode else ()
                    recv_x = from_fp8(*recv_x) if isinstance(recv_x, tuple) else recv_x

                    rank_prefix_matrix = handle[0]
                    assert gbl_per_rank[rank].item() == recv_x.size(0)
                    assert gbl_per_expert.view(world, -1)[rank].tolist() == recv_list
                    if current_x is not x_pure_rand:
                        check_data(recv_x, rank_prefix_matrix)
                    recv_topk_weights_clone = None
                    if with_topk:
                        local = num_experts // world
                        assert (recv_topk_idx.eq(-1) | ((recv_topk_idx >= 0) & (recv_topk_idx < local))).all()
                        for i, count in enumerate(recv_list):
                            assert recv_topk_idx.eq(i).sum().item() == count
                        recv_topk_weights_clone = recv_topk_weights.clone()
                        if current_x is not x_pure_rand:
                            recv_topk_weights[recv_topk_idx.eq(-1)] = recv_topk_weights.amax(
                                dim=1, keepdim=True).expand_as(recv_topk_weights)[recv_topk_idx.eq(-1)]
                            check_data(recv_topk_weights, rank_prefix_matrix)

                    if with_topk:
                        worst = num_tokens * world
                        args.update({"num_worst_tokens": worst})
                        w_x, w_idx, w_w, empty_list, _, event = buffer.dispatch(**args)
                        event.current_stream_wait() if async_mode else ()
                        w_x = from_fp8(*w_x) if isinstance(w_x, tuple) else w_x
                        assert len(empty_list) == 0 and w_x.size(0) == w_idx.size(0) == w_w.size(0) == worst
                        assert torch.equal(recv_x, w_x[:recv_x.size(0)])
                        assert torch.equal(recv_topk_idx, w_idx[:recv_x.size(0)])
                        assert torch.equal(recv_topk_weights_clone, w_w[:recv_x.size(0)])
                        assert torch.all(w_idx[recv_x.size(0):] == -1).item()

                    if not with_topk:
                        cached = {"x": current_x, "handle": handle, "config": config, "async_finish": async_mode}
                        if previous_mode:
                            cached.update({"previous_event": buffer.capture()})
                        recv_x, _, _, _, _, event = buffer.dispatch(**cached)
                        event.current_stream_wait() if async_mode else ()
                        recv_x = from_fp8(*recv_x) if isinstance(recv_x, tuple) else recv_x
                        if current_x is not x_pure_rand:
                            check_data(recv_x, rank_prefix_matrix)

                    combine = {"x": recv_x, "handle": handle, "config": config, "async_finish": async_mode}
                    if with_topk:
                        combine.update({"topk_weights": recv_topk_weights})
                    if previous_mode:
                        combine.update({"previous_event": buffer.capture()})
                    combined_x, combined_w, event = buffer.combine(**combine)
                    event.current_stream_wait() if async_mode else ()
                    check_x = combined_x.float() / is_token_in_rank.sum(dim=1).unsqueeze(1)
                    ref_x = x_pure_rand if current_x is x_pure_rand else x
                    assert similarity_gap(check_x, ref_x) < 5e-6
                    if with_topk:
                        check_w = combined_w if current_x is x_pure_rand else \
                            combined_w / is_token_in_rank.sum(dim=1).unsqueeze(1)
                        ref_w = topk_weights_pure_rand if current_x is x_pure_rand else topk_weights
                        assert similarity_gap(check_w, ref_w) < 1e-9
    buffer.destroy()
    dist.barrier()
    dist.destroy_process_group()


# DeepEP's shrink test: the rank that fails when it first reaches each LL API (it stops taking part).
FAILED_AT = {"dispatch": 1, "combine": 3, "clean": 5}


def simulate_failure_and_skip(rank, world, api, expected_masked_ranks, buffer):
    """DeepEP's schedule of failures. In DeepEP the survivors' kernels time out waiting for the failed rank and
    set the mask themselves; epcomm's mask is set collectively by the survivors (a timeout raises instead), so
    here the survivors, who know the schedule, mask the failed rank through low_latency_update_mask_buffer at
    the point where it fails."""
    if rank in expected_masked_ranks:
        return True  # already failed
    failed = FAILED_AT.get(api)
    if failed is None or failed >= world or failed in expected_masked_ranks:
        return False
    expected_masked_ranks.add(failed)
    if failed == rank:
        return True
    buffer.low_latency_update_mask_buffer(failed, mask=True)
    return False


def query_mask_buffer_and_check(buffer, mask_status, expected_masked_ranks):
    buffer.low_latency_query_mask_buffer(mask_status)
    assert set(mask_status.nonzero().squeeze(-1).tolist()) == expected_masked_ranks


def low_latency(rank, world, init_method, device="cpu", shrink_test=False):
    import epcomm

    dev = _init(rank, world, init_method, device)
    torch.manual_seed(rank)
    num_tokens, hidden, num_topk, num_experts = 32, 256, 4, 4 * world
    num_local = num_experts // world
    buffer = epcomm.Buffer(dist.group.WORLD, 0, epcomm.Buffer.get_low_latency_rdma_size_hint(
        num_tokens, hidden, world, num_experts), low_latency_mode=True, num_qps_per_rank=num_local,
        explicitly_destroy=True, enable_shrink=shrink_test)
    rank_offset = 128
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device=dev) * (rank - rank_offset)
    x[:, -128:] = torch.arange(num_tokens, device=dev).to(torch.bfloat16).view(-1, 1)
    x_list = [x, torch.randn((num_tokens, hidden), dtype=torch.bfloat16, device=dev) * 0.1]
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32, device=dev).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=True)[1].to(epcomm.topk_idx_t)
    topk_weights = torch.randn((num_tokens, num_topk), dtype=torch.float32, device=dev).abs()
    gen = torch.Generator().manual_seed(rank)
    for _ in range(10):
        t, k = torch.randint(num_tokens, (1,), generator=gen).item(), torch.randint(num_topk, (1,), generator=gen).item()
        topk_idx[t, k] = -1
    all_topk_idx = torch.empty((world * num_tokens * num_topk,), dtype=topk_idx.dtype)
    dist.all_gather_into_tensor(all_topk_idx, topk_idx.cpu().reshape(-1))
    all_topk_idx = all_topk_idx.view(world, num_tokens, num_topk)

    # For failure simulation and shrink testing
    mask_status = torch.zeros((world,), dtype=torch.int, device=dev)
    expected_masked_ranks = set()
    if shrink_test:
        # epcomm sizes the communicator's LL buffers at the first LL call (re-creating it, which needs every
        # rank): that call must come before any rank fails
        _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts, use_fp8=False)
        buffer.low_latency_combine(torch.zeros((num_local, world * num_tokens, hidden), dtype=torch.bfloat16,
                                               device=dev), topk_idx, topk_weights, handle)
        query_mask_buffer_and_check(buffer, mask_status, expected_masked_ranks)

    num_times = 0
    for current_x in x_list:
        for return_recv_hook in (False, True):
            for use_fp8 in (False, True):
                if shrink_test and simulate_failure_and_skip(rank, world, "dispatch", expected_masked_ranks, buffer):
                    break
                num_times += 1
                for _ in range((num_times % 2) + 1):
                    stats = torch.zeros((num_local,), dtype=torch.int, device=dev)
                    packed_recv_x, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
                        current_x, topk_idx, num_tokens, num_experts, use_fp8=use_fp8, round_scale=False,
                        use_ue8m0=False, cumulative_local_expert_recv_stats=stats,
                        async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
                    hook() if return_recv_hook else event.current_stream_wait()
                if shrink_test:
                    query_mask_buffer_and_check(buffer, mask_status, expected_masked_ranks)
                unmasked = (mask_status == 0).cpu()
                packed_recv_x = (packed_recv_x[0], packed_recv_x[1].contiguous()) if use_fp8 else packed_recv_x
                simulated_gemm_x = from_fp8(packed_recv_x[0].view(-1, hidden), packed_recv_x[1].view(-1, hidden // 128)
                                            ).view(packed_recv_x[0].shape) if use_fp8 else packed_recv_x.clone()
                for i in range(num_local):
                    expert_id = rank * num_local + i
                    recv_x = from_fp8(packed_recv_x[0][i], packed_recv_x[1][i]) if use_fp8 else packed_recv_x[i]
                    recv_count, recv_src_info, recv_layout_range = packed_recv_count[i], handle[0][i], handle[1][i]
                    mask = (1 << 32) - 1
                    valid = recv_count.item()
                    assert stats[i].item() == valid
                    assert valid == (recv_layout_range & mask).sum().item()
                    assert valid == (all_topk_idx == expert_id).sum(dim=[1, 2])[unmasked].sum().item()
                    if valid == 0 or current_x is not x:
                        continue
                    recv_x = recv_x[:valid]
                    recv_x_amin = recv_x[:, :-128].amin(dim=-1)
                    assert torch.equal(recv_x_amin, recv_x[:, :-128].amax(dim=-1))
                    assert (recv_x[:, -128:] - recv_src_info[:valid].view(-1, 1) % num_tokens).sum().item() == 0
                    for j in range(world):
                        if shrink_test and mask_status[j]:
                            continue
                        begin, count = (recv_layout_range[j] >> 32).item(), (recv_layout_range[j] & mask).item()
                        assert (recv_x_amin == j - rank_offset).sum().item() == (all_topk_idx[j] == expert_id).sum().item()
                        assert (recv_x[begin:begin + count, :-128] - j + rank_offset).sum().item() == 0
                if shrink_test and simulate_failure_and_skip(rank, world, "combine", expected_masked_ranks, buffer):
                    break
                for zero_copy in (False, True):
                    if zero_copy:
                        buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = simulated_gemm_x
                    out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=dev)
                    combined_x, event, hook = buffer.low_latency_combine(
                        simulated_gemm_x, topk_idx, topk_weights, handle, use_logfmt=False,
                        async_finish=not return_recv_hook, zero_copy=zero_copy, return_recv_hook=return_recv_hook,
                        out=out)
                    hook() if return_recv_hook else event.current_stream_wait()
                    if shrink_test:
                        query_mask_buffer_and_check(buffer, mask_status, expected_masked_ranks)
                        # as DeepEP's test: the masked ranks' experts are dropped from the routing for good
                        owner_by_expert = torch.arange(num_experts, device=dev) // num_local
                        fail_owner_mask = (mask_status == 1).index_select(0, owner_by_expert)
                        valid_topk_idx = topk_idx >= 0
                        failed_topk_idx = torch.zeros_like(topk_idx, dtype=torch.bool)
                        failed_topk_idx[valid_topk_idx] = fail_owner_mask.index_select(0, topk_idx[valid_topk_idx])
                        topk_idx[failed_topk_idx] = -1
                    diff = similarity_gap(current_x * topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1).view(-1, 1),
                                          combined_x)
                    assert torch.isnan(combined_x).sum().item() == 0
                    assert diff < (9e-4 if use_fp8 else 1e-5), f"{diff=} {use_fp8=} {zero_copy=}"

                # Clean buffer API
                if shrink_test:
                    if simulate_failure_and_skip(rank, world, "clean", expected_masked_ranks, buffer):
                        break
                    buffer.clean_low_latency_buffer(num_tokens, hidden, num_experts)
                    query_mask_buffer_and_check(buffer, mask_status, expected_masked_ranks)

    if shrink_test:
        # the failed ranks take part in nothing more (the group's collectives would wait for them)
        if rank not in expected_masked_ranks:
            assert expected_masked_ranks == {r for r in FAILED_AT.values() if r < world}
            assert all(mask_status.cpu().tolist()[r] == (r in expected_masked_ranks) for r in range(world))
        buffer.destroy()
        return
    buffer.clean_low_latency_buffer(num_tokens, hidden, num_experts)
    buffer.destroy()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_intranode_pattern(world):
    ranks.run(world, intranode)


@pytest.mark.parametrize("world", [2, 4])
def test_low_latency_pattern(world):
    ranks.run(world, low_latency)


@pytest.mark.parametrize("world", [2, 4])
def test_low_latency_shrink_pattern(world):
    """DeepEP's --shrink-test: rank 1 fails at its first dispatch, rank 3 at its first combine."""
    ranks.run(world, low_latency, "cpu", True)  # the failed ranks return once they stop taking part
