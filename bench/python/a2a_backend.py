"""all_to_all_single through the process-group backend "epcomm" against a reference backend on the same
ranks and bytes: gloo for CPU tensors, NCCL for CUDA tensors (one GPU per rank).

    torchrun --standalone --nproc-per-node 4 bench/python/a2a_backend.py [--device cuda] [--sizes-mib 1,16,256]

Prints, per message size (bytes of the whole input tensor per rank), the median time and the GB/s per rank
counting the bytes each rank sends to the other ranks, as DeepEP and nccl-tests account them.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import epcomm  # noqa: F401 - registers the backend


def measure(group, inp, out, iters, sync):
    for _ in range(2):
        dist.all_to_all_single(out, inp, group=group)
    sync()
    samples = []
    for _ in range(iters):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_to_all_single(out, inp, group=group)
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--sizes-mib", default="1,4,16,64,256")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("epcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_name = "nccl" if args.device == "cuda" else "gloo"
    ref = dist.new_group(list(range(world)), backend=ref_name)
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if rank == 0:
        print(f"all_to_all_single, ranks={world}, device={args.device}, median of {args.iters}")
        print(f"{'MiB/rank':>9s} {'epcomm ms':>10s} {'GB/s':>7s} {ref_name + ' ms':>10s} {'GB/s':>7s}")
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        numel = (mib << 20) // 2 // world * world
        inp = torch.ones(numel, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(inp)
        sent = numel * 2 * (world - 1) / world  # bytes to the other ranks
        t_ep = measure(dist.group.WORLD, inp, out, args.iters, sync)
        t_ref = measure(ref, inp, out, args.iters, sync)
        if rank == 0:
            print(f"{mib:9d} {t_ep * 1e3:10.3f} {sent / t_ep / 1e9:7.2f} {t_ref * 1e3:10.3f} {sent / t_ref / 1e9:7.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
