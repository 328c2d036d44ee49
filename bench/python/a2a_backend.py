"""all_to_all_single through the process-group backend "epcomm" against a reference on the same ranks and bytes.

    python bench/python/a2a_backend.py --ranks 2 [--device cuda] [--sizes-mib 1,4,16,64,256] [--csv out.csv]
    torchrun --standalone --nproc-per-node 2 bench/python/a2a_backend.py [--device cuda] ...

The reference: gloo for CPU tensors; NCCL for CUDA tensors when every rank has a GPU of its own. When ranks
share a GPU NCCL cannot run them (it would take one network host per rank), so the reference is then the
device copy bandwidth measured in the same run: every rank copies a tensor of the same bytes (torch copy_)
at the same time, as they all share one HBM.

Per message size (bytes of the whole input tensor per rank): the median time of each and GB/s per rank.
GB/s for an all-to-all counts the bytes each rank sends to the other ranks ((R - 1) / R of its tensor), as
DeepEP and nccl-tests account them; for the copy it counts the tensor's bytes (one read and one write each).
'epcomm/ref' is the reference's time over epcomm's (above 1: epcomm faster; against the copy: the fraction
of the copy's speed that the all-to-all of the same tensor reaches).
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
import epcomm  # noqa: E402,F401 - registers the backend


def measure(fn, barrier, iters, sync):
    for _ in range(2):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    benchutil.add_common_args(ap)
    ap.add_argument("--sizes-mib", default="1,4,16,64,256", help="comma-separated MiB per rank (fractions allowed)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ref", default="auto", choices=["auto", "gloo", "nccl", "copy"],
                    help="the reference (auto: gloo on CPU; NCCL on CUDA with a GPU per rank, else copy)")
    args = ap.parse_args()
    benchutil.launch(run, args)


def run(args):
    dev = benchutil.rank_device(args.device)
    # The control group (barriers between samples, object gathers) is gloo: it needs no GPU of its own.
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctrl = dist.group.WORLD
    ep = dist.new_group(list(range(world)), backend="epcomm")
    sync = benchutil.sync_fn(dev)
    ref_name = args.ref
    if ref_name == "auto":
        ref_name = "gloo" if dev.type == "cpu" else ("copy" if benchutil.ranks_share_a_gpu(ctrl) else "nccl")
    ref = dist.new_group(list(range(world)), backend=ref_name) if ref_name in ("gloo", "nccl") else None
    rows = []
    for mib in (float(s) for s in args.sizes_mib.split(",")):
        numel = max(int(mib * (1 << 20)) // 2 // world * world, world)
        inp = torch.ones(numel, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(inp)
        tensor_bytes = numel * 2
        sent = tensor_bytes * (world - 1) / world  # bytes to the other ranks
        t_ep = measure(lambda: dist.all_to_all_single(out, inp, group=ep), lambda: dist.barrier(group=ctrl),
                       args.iters, sync)
        if ref is not None:
            t_ref = measure(lambda: dist.all_to_all_single(out, inp, group=ref), lambda: dist.barrier(group=ctrl),
                            args.iters, sync)
            ref_gbs = sent / t_ref / 1e9
        else:
            t_ref = measure(lambda: out.copy_(inp), lambda: dist.barrier(group=ctrl), args.iters, sync)
            ref_gbs = tensor_bytes / t_ref / 1e9
        rows.append((f"{mib:g}", world, args.device, t_ep * 1e3, sent / t_ep / 1e9, ref_name, t_ref * 1e3, ref_gbs,
                     t_ref / t_ep))
    if rank == 0:
        benchutil.print_table(
            f"all_to_all_single: epcomm backend vs {ref_name}, ranks={world}, device={args.device}, "
            f"median of {args.iters} (GB/s per rank)",
            ["MiB/rank", "ranks", "device", "epcomm_ms", "epcomm_GB/s", "ref", "ref_ms", "ref_GB/s", "epcomm/ref"],
            rows, args.csv)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
