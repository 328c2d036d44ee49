"""epcomm.dispatch / epcomm.combine (torch custom ops on an epcomm group, worst-token shapes), eager and under
torch.compile, against the Buffer's results."""
import datetime

import torch
import torch.distributed as dist

import ranks


def ops(rank, world, init_method):
    import epcomm

    dist.init_process_group("epcomm", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    gen = torch.Generator().manual_seed(7 + rank)
    num_tokens, hidden, num_experts, topk = 16, 64, 4 * world, 2
    capacity = num_tokens * world
    x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)
    topk_idx = torch.rand((num_tokens, num_experts), generator=gen).topk(topk, dim=-1).indices
    topk_w = torch.rand((num_tokens, topk), generator=gen)

    recv_x, recv_idx, recv_w, per_expert = epcomm.dispatch(x, topk_idx, topk_w, num_experts, capacity)
    assert recv_x.shape == (capacity, hidden) and recv_idx.shape == (capacity, topk)
    buffer = epcomm.Buffer(dist.group.WORLD)
    n_rank, _, n_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    ref_x, ref_idx, ref_w, ref_list, _, _ = buffer.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                                          num_tokens_per_expert=n_expert, topk_idx=topk_idx,
                                                          topk_weights=topk_w)
    n = ref_x.size(0)
    assert torch.equal(recv_x[:n], ref_x) and torch.equal(recv_idx[:n], ref_idx) and torch.equal(recv_w[:n], ref_w)
    assert per_expert.tolist() == ref_list
    combined = epcomm.combine(recv_x, num_tokens)
    assert torch.equal(combined, (x.float() * in_rank.sum(dim=1, keepdim=True)).to(torch.bfloat16))

    def layer(x, topk_idx, topk_w):
        rx, ridx, rw, _ = epcomm.dispatch(x, topk_idx, topk_w, num_experts, capacity, slot=1)
        y = (rx.float() * 2).to(rx.dtype)
        return epcomm.combine(y, x.size(0), slot=1)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, topk_idx, topk_w), (combined.float() * 2).to(torch.bfloat16))
    dist.destroy_process_group()


def test_dispatch_combine_ops():
    ranks.run(2, ops)
