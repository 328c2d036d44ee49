"""torch.distributed.all_to_all_single over NCCL at a given byte count per rank, for comparison with
epcomm-bench on the same machine (one process per GPU).

    python3 bench/gpu/torch_a2a.py --ranks 2 --bytes-per-rank 58720256 [--iters 20]
Prints the median time and bytes received per rank per second (DeepEP-style accounting: all received bytes).
"""
import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", rank=rank, world_size=args.ranks)
    n = args.bytes_per_rank // 2 // args.ranks * args.ranks  # bf16 elements, divisible by ranks
    x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    times = []
    for i in range(args.warmup + args.iters):
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dist.all_to_all_single(y, x)
        b.record()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(a.elapsed_time(b) / 1e3)
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        gbs = n * 2 / t.item() / 1e9
        print(f"torch all_to_all_single (NCCL): ranks {args.ranks}, {n * 2} bytes per rank, "
              f"median {t.item() * 1e3:.3f} ms, {gbs:.2f} GB/s received per rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--bytes-per-rank", type=int, default=58720256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--port", type=int, default=29533)
    args = p.parse_args()
    mp.spawn(worker, args=(args,), nprocs=args.ranks)
