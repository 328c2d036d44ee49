"""A DeepSeek-style MoE layer (sigmoid router with normalised top-k weights, routed SwiGLU experts spread over
the ranks, one shared expert) run two ways on the process group "epcomm", and checked against each other:

- "buffer": epcomm.Buffer (DeepEP's API): layout -> dispatch -> per-expert matmuls -> combine;
- "pg":     plain torch.distributed: the (token, expert) pairs go out and back with all_to_all_single;
- with --ref-backend gloo|nccl, "pg" once more on a group of that backend ("pg-gloo", "pg-nccl"): the same
  layer without epcomm, for comparison.

    torchrun --nproc-per-node 4 plugin/torch/examples/moe_layer.py                 # CPU (host engine)
    torchrun --nproc-per-node 2 plugin/torch/examples/moe_layer.py --device cuda   # one GPU per rank
    torchrun --nproc-per-node 2 plugin/torch/examples/moe_layer.py --device cuda --ref-backend nccl

Prints tokens per second (all ranks' tokens) for each way. bench/python/moe_layer_bench.py tabulates the same
layer on epcomm against it on NCCL (or gloo).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import epcomm


class MoELayer(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int, rank: int, world: int, device, dtype):
        super().__init__()
        self.topk, self.num_experts, self.rank, self.world = topk, num_experts, rank, world
        self.num_local = num_experts // world
        gen = torch.Generator().manual_seed(1234)  # the same router and shared expert on every rank

        def param(*shape, seed_gen=gen):
            return torch.nn.Parameter((torch.randn(*shape, generator=seed_gen) / shape[-1] ** 0.5).to(device, dtype))

        self.router = param(num_experts, hidden)
        self.shared = torch.nn.ParameterList([param(2 * ffn, hidden), param(hidden, ffn)])
        local_gen = torch.Generator().manual_seed(99 + rank)  # this rank's experts
        self.w13 = param(self.num_local, 2 * ffn, hidden, seed_gen=local_gen)
        self.w2 = param(self.num_local, hidden, ffn, seed_gen=local_gen)

    @staticmethod
    def _swiglu(x, w13, w2):
        gate, up = (x @ w13.t()).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w2.t()

    def route(self, x):
        scores = torch.sigmoid(x.float() @ self.router.float().t())
        weights, topk_idx = scores.topk(self.topk, dim=-1)
        return topk_idx.to(epcomm.topk_idx_t), weights / weights.sum(dim=-1, keepdim=True)

    def experts(self, rows, local_expert_of_row, weight_of_row):
        """Each row through its local expert, scaled by its weight (rows whose expert is -1 stay 0)."""
        out = torch.zeros_like(rows)
        for e in range(self.num_local):
            sel = (local_expert_of_row == e).nonzero(as_tuple=True)[0]
            if sel.numel():
                y = self._swiglu(rows[sel], self.w13[e], self.w2[e])
                out.index_add_(0, sel, (y.float() * weight_of_row[sel].unsqueeze(1)).to(out.dtype))
        return out

    def forward_buffer(self, x, buffer: epcomm.Buffer):
        topk_idx, weights = self.route(x)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, self.num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=weights)
        # a received token may name several local experts: each expert takes the rows that name it
        y = torch.zeros_like(recv_x)
        for e in range(self.num_local):
            named = recv_idx == e
            sel = named.any(dim=1).nonzero(as_tuple=True)[0]
            if sel.numel():
                w = (recv_w * named).sum(dim=1)[sel]
                y.index_add_(0, sel, (self._swiglu(recv_x[sel], self.w13[e], self.w2[e]).float()
                                      * w.unsqueeze(1)).to(y.dtype))
        combined, _, _ = buffer.combine(y, handle)
        return combined + self._swiglu(x, self.shared[0], self.shared[1])

    def forward_pg(self, x, group=None):
        topk_idx, weights = self.route(x)
        num_tokens = x.size(0)
        pairs = topk_idx.flatten()
        order = torch.argsort(pairs // self.num_local, stable=True)
        dest = pairs[order] // self.num_local
        send_counts = torch.bincount(dest, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        token_of_pair = torch.arange(num_tokens, device=x.device).repeat_interleave(self.topk)[order]
        rows = torch.empty((sum(recv), x.size(1)), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(rows, x[token_of_pair], recv, send, group=group)
        meta = torch.empty(sum(recv), dtype=torch.int64, device=x.device)
        dist.all_to_all_single(meta, pairs[order] - dest * self.num_local, recv, send, group=group)
        y = self.experts(rows, meta, torch.ones(sum(recv), device=x.device))
        back = torch.empty((sum(send), x.size(1)), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(back, y, send, recv, group=group)
        out = torch.zeros((num_tokens, x.size(1)), dtype=torch.float32, device=x.device)
        out.index_add_(0, token_of_pair, back.float() * weights.flatten()[order].unsqueeze(1))
        return out.to(x.dtype) + self._swiglu(x, self.shared[0], self.shared[1])


def step_seconds(fn, iters: int, device, barrier=dist.barrier) -> float:
    """Seconds per call of fn, after one warm-up call, from a barrier to the last rank's barrier."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    barrier()
    return (time.perf_counter() - start) / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ref-backend", default="none", choices=["none", "gloo", "nccl"],
                    help="also run the plain way on a group of this backend (NCCL: one GPU per rank)")
    args = ap.parse_args()

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        os.environ.setdefault("EPCOMM_ENGINE", "host")
        device = torch.device("cpu")
    dist.init_process_group("epcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16
    layer = MoELayer(args.hidden, args.ffn, args.experts, args.topk, rank, world, device, dtype)
    buffer = epcomm.Buffer(dist.group.WORLD)
    x = torch.randn((args.tokens, args.hidden), generator=torch.Generator().manual_seed(rank)).to(device, dtype)

    with torch.no_grad():
        a, b = layer.forward_buffer(x, buffer), layer.forward_pg(x)
        # both sum the same products; only the order of the bf16 roundings differs
        diff = (a.float() - b.float()).abs().max().item()
        assert torch.allclose(a.float(), b.float(), rtol=5e-2, atol=5e-2), f"the two ways differ by {diff}"
        ways = [("buffer", lambda: layer.forward_buffer(x, buffer)), ("pg", lambda: layer.forward_pg(x))]
        if args.ref_backend != "none":
            ref = dist.new_group(list(range(world)), backend=args.ref_backend)
            c = layer.forward_pg(x, group=ref)
            assert torch.allclose(a.float(), c.float(), rtol=5e-2, atol=5e-2), "pg on the reference backend differs"
            ways.append((f"pg-{args.ref_backend}", lambda: layer.forward_pg(x, group=ref)))
        for name, fn in ways:
            seconds = step_seconds(fn, args.iters, device)
            if rank == 0:
                print(f"moe_layer {name:7s} ranks={world} device={device.type} tokens/rank={args.tokens} "
                      f"hidden={args.hidden} experts={args.experts} top-{args.topk}: "
                      f"{args.tokens * world / seconds:,.0f} tokens/s ({seconds * 1e3:.2f} ms/step)", flush=True)
    if rank == 0:
        print(f"max |buffer - pg| = {diff:.3g}")
    buffer.destroy() if buffer.explicitly_destroy else None
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
