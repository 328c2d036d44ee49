"""Tokens per second of plugin/torch/examples/moe_layer.py's MoE layer on epcomm against the same layer written
with dist.all_to_all_single over NCCL (CUDA, a GPU per rank) or gloo (CPU).

    python bench/python/moe_layer_bench.py --ranks 2 [--device cuda] [--tokens 4096] [--csv out.csv]
    torchrun --standalone --nproc-per-node 2 bench/python/moe_layer_bench.py [--device cuda] ...

Ways (--ways, comma-separated, default all):
  buffer      epcomm.Buffer (DeepEP's API): layout -> dispatch -> expert matmuls -> combine
  pg-epcomm   the plain layer (all_to_all_single of rows, routing and counts) on an "epcomm" group
  pg-ref      the same plain layer on the reference group: NCCL on CUDA, gloo on CPU
The ranks meet over a gloo group (the Buffer's group too), so any number of them may share a GPU; NCCL cannot
run ranks that share one (it would take one network host per rank), and pg-ref is then left out (a row says
so). Each way is checked against pg-ref (or the Buffer) before it is timed. 'vs ref' is tokens/s over
pg-ref's.
"""
import argparse
import importlib.util
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchutil  # noqa: E402
import epcomm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "plugin", "torch", "examples", "moe_layer.py")
WAYS = ("buffer", "pg-epcomm", "pg-ref")


def load_example():
    spec = importlib.util.spec_from_file_location("moe_layer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchutil.add_common_args(ap)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ways", default=",".join(WAYS))
    args = ap.parse_args()
    unknown = set(args.ways.split(",")) - set(WAYS)
    if unknown:
        ap.error(f"unknown ways {sorted(unknown)}; choose from {WAYS}")
    benchutil.launch(run, args)


def run(args):
    example = load_example()
    dev = benchutil.rank_device(args.device)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctrl = dist.group.WORLD
    ways = args.ways.split(",")
    ref_backend = "gloo" if dev.type == "cpu" else "nccl"
    ref_note = None
    if "pg-ref" in ways and dev.type == "cuda" and benchutil.ranks_share_a_gpu(ctrl):
        ways.remove("pg-ref")
        ref_note = "ranks share a GPU: NCCL cannot run them"
    layer = example.MoELayer(args.hidden, args.ffn, args.experts, args.topk, rank, world, dev, torch.bfloat16)
    x = torch.randn((args.tokens, args.hidden), generator=torch.Generator().manual_seed(rank)).to(dev, torch.bfloat16)
    fns = {}
    if "buffer" in ways:
        buffer = epcomm.Buffer(ctrl)
        fns["buffer"] = lambda: layer.forward_buffer(x, buffer)
    if "pg-epcomm" in ways:
        ep = dist.new_group(list(range(world)), backend="epcomm")
        fns["pg-epcomm"] = lambda: layer.forward_pg(x, group=ep)
    if "pg-ref" in ways:
        ref = dist.new_group(list(range(world)), backend=ref_backend)
        fns["pg-ref"] = lambda: layer.forward_pg(x, group=ref)
    rows, rate = [], {}
    with torch.no_grad():
        results = {name: fn() for name, fn in fns.items()}
        base = results.get("pg-ref", results.get("buffer"))
        for name, out in results.items():
            # the ways sum the same products; only the order of the bf16 roundings differs
            diff = (out.float() - base.float()).abs().max().item() if out.numel() else 0.0
            assert torch.allclose(out.float(), base.float(), rtol=5e-2, atol=5e-2), f"{name} differs by {diff}"
        for name in WAYS:
            if name not in fns:
                continue
            seconds = example.step_seconds(fns[name], args.iters, dev, barrier=lambda: dist.barrier(group=ctrl))
            rate[name] = args.tokens * world / seconds
            backend = {"buffer": "epcomm", "pg-epcomm": "epcomm", "pg-ref": ref_backend}[name]
            rows.append([name, backend, world, args.device, args.tokens, seconds * 1e3, rate[name]])
    for row in rows:
        row.append(row[-1] / rate["pg-ref"] if "pg-ref" in rate else None)
    if ref_note and "pg-ref" in args.ways.split(","):
        rows.append(["pg-ref", f"{ref_backend} ({ref_note})", world, args.device, args.tokens, None, None, None])
    if rank == 0:
        benchutil.print_table(
            f"moe_layer tokens/s (all ranks' tokens): ranks={world} device={args.device} tokens/rank={args.tokens} "
            f"hidden={args.hidden} ffn={args.ffn} experts={args.experts} top-{args.topk}, mean of {args.iters}",
            ["way", "backend", "ranks", "device", "tokens/rank", "ms/step", "tokens/s", "vs ref"], rows, args.csv)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
