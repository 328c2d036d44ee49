"""What the Python benchmarks share: starting the ranks (under torchrun, or spawned here with --ranks N), the
device of a rank, and printing a table (and, with --csv PATH, writing it as CSV).

Under torchrun (RANK and WORLD_SIZE set) a script runs as the rank torchrun made. Run directly, it spawns
--ranks processes itself on this machine (a free loopback port for the env:// rendezvous), which needs no
torchrun; with --device cuda, rank r takes GPU r % device_count, so more ranks than GPUs share them (start a
CUDA MPS daemon first, see the README).
"""
import argparse
import csv
import multiprocessing as mp
import os
import socket
import sys
from typing import Callable, List, Sequence

import torch

DEFAULT_ENV = {"OMP_NUM_THREADS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ranks", type=int, default=2, help="ranks to spawn when not started by torchrun")
    ap.add_argument("--csv", default=None, help="also write the table to this CSV file (rank 0)")


def _spawned(fn, args, rank, world, port):
    os.environ.update(DEFAULT_ENV)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    fn(args)


def launch(fn: Callable, args) -> None:
    """fn(args) on every rank: this process under torchrun, else args.ranks spawned processes."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        fn(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spawned, args=(fn, args, r, args.ranks, port)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        sys.exit(f"ranks failed (rank, exit code): {bad}")


def rank_device(kind: str) -> torch.device:
    """cpu, or this rank's GPU (LOCAL_RANK % device_count), made current. On CPU the C library's host engine."""
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    os.environ.setdefault("EPCOMM_ENGINE", "host")
    os.environ.setdefault("EPCOMM_HOST_CHANNELS", "1")
    return torch.device("cpu")


def ranks_share_a_gpu(ctrl_group) -> bool:
    """Whether two ranks of the group run on one GPU (then NCCL cannot run them, except as separate hosts)."""
    import torch.distributed as dist

    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    everyone: List = [None] * dist.get_world_size(ctrl_group)
    dist.all_gather_object(everyone, uuid, group=ctrl_group)
    return len(set(everyone)) < len(everyone)


def sync_fn(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence], csv_path=None) -> None:
    """A fixed-width table on stdout (floats with 2 decimals; None as '-') and, with csv_path, the same rows."""
    def cell(v):
        if v is None:
            return "-"
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    print(title)
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))))
    for r in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    sys.stdout.flush()
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            for row in rows:
                w.writerow(["" if v is None else (f"{v:.4f}" if isinstance(v, float) else v) for v in row])
