#!/usr/bin/env python3
"""nccl-tests-style bus bandwidth of every collective through torch.distributed, several network setups in one run.

Each configuration launches WORLD rank processes on GPU 0 (under CUDA MPS), each with its own NCCL_HOSTID so
every byte crosses the network transport; timing uses CUDA events, the slowest rank counts. Sizes and bus bandwidth as
in nccl-tests (size = the per-rank buffer nccl-tests reports): all_reduce busbw = algbw * 2(n-1)/n;
all_gather, reduce_scatter, all_to_all: algbw * (n-1)/n; broadcast, reduce, sendrecv: algbw.
(nccl-tests itself is not on the GPU machine and cannot be fetched there; torch's NCCL runs the same kernels.)

  python3 bench/net/nccl_bus_bw.py --plugin /abs/libnccl-net-epcomm.so --world 2 \\
      --configs "epcomm-socket,epcomm-ofi,nccl-socket" [--ofi-provider "tcp;ofi_rxm"] [--ops all] [--sizes 8K,32K]
A config may carry environment overrides after '+': "epcomm-socket+EPCOMM_NET_INLINE=262144" or
"epcomm-socket+NCCL_NET_PLUGIN=/abs/other/libnccl-net-epcomm.so" (an older build: before/after in one run).
Prints one table per op: size, busbw per config (GB/s), and every config's ratio to NCCL's Socket transport.
"""
import argparse
import json
import os
import statistics
import socket
import subprocess
import sys
import tempfile

SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv"]
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
       "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
       "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "sendrecv": lambda n: 1.0}


def make_op(op, dist, x, y, parts, rank, world):
    if op == "all_reduce":
        return lambda: dist.all_reduce(x)
    if op == "all_gather":  # x: one rank's part; y: world parts (nccl-tests reports the whole output size)
        return lambda: dist.all_gather_into_tensor(y, parts[0])
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(parts[0], x)
    if op == "broadcast":
        return lambda: dist.broadcast(x, 0)
    if op == "reduce":
        return lambda: dist.reduce(x, 0)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(y, x)
    # sendrecv: a ring, every rank sends to the next and receives from the previous (nccl-tests' sendrecv)
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def sr():
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, y, prv)])
        for r in reqs:
            r.wait()
    return sr


def worker(out_path):
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ops = os.environ["BUSBW_OPS"].split(",")
    sizes = [int(v) for v in os.environ["BUSBW_SIZES"].split(",")]
    reps, iters_scale = int(os.environ.get("BUSBW_REPS", "1")), float(os.environ.get("BUSBW_ITERS_SCALE", "1"))
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    res = {op: {} for op in ops}
    for size in sizes:
        n = size // 4
        n -= n % world
        x = torch.ones(n, device=dev)
        y = torch.empty(n, device=dev)
        parts = [torch.ones(n // world, device=dev)]
        for op in ops:
            fn = make_op(op, dist, x, y, parts, rank, world)
            iters = 20 if size <= (4 << 20) else (10 if size <= (64 << 20) else 5)
            iters = max(1, round(iters * iters_scale))
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(reps):  # the median of reps batches: one batch of 20 small collectives is noise-prone
                dist.barrier()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(iters):
                    fn()
                e.record()
                torch.cuda.synchronize()
                t = torch.tensor([s.elapsed_time(e) / 1e3 / iters], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times.append(t.item())
            algbw = n * 4 / statistics.median(times) / 1e9
            res[op][size] = algbw * BUS[op](world)
            x.fill_(1.0)  # keep reduced values bounded
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def config_env(spec, args):
    name, *overrides = spec.split("+")
    env = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0", "NCCL_MNNVL_ENABLE": "0",
           "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}
    if name == "nccl-socket":
        env.update({"NCCL_NET_PLUGIN": "none", "NCCL_NET": "Socket"})
    else:
        env.update({"NCCL_NET_PLUGIN": os.path.abspath(args.plugin), "NCCL_NET": "epcomm",
                    "EPCOMM_SOCKET_IFNAME": os.environ.get("EPCOMM_SOCKET_IFNAME", "lo"),
                    "EPCOMM_NET": "ofi" if name == "epcomm-ofi" else "socket"})
        if name == "epcomm-ofi" and args.ofi_provider:
            env["EPCOMM_OFI_PROVIDER"] = args.ofi_provider
    for kv in overrides:
        k, _, v = kv.partition("=")
        env[k] = v
    env["BUSBW_OPS"] = ",".join(args.ops)
    env["BUSBW_SIZES"] = ",".join(str(v) for v in args.sizes)
    env["BUSBW_REPS"] = str(args.reps)
    env["BUSBW_ITERS_SCALE"] = str(args.iters_scale)
    return env


def run_config(name, args, tmp, round_no=0):
    port = free_port()
    tag = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)[:80] + f"-r{round_no}"
    out = os.path.join(tmp, f"{tag}-w{args.world}.json")
    procs = []
    for r in range(args.world):
        env = dict(os.environ)
        env.update(config_env(name, args))
        env.update({"RANK": str(r), "WORLD_SIZE": str(args.world), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "NCCL_HOSTID": f"busbw-{port}-{r}"})
        log = open(os.path.join(tmp, f"{tag}-w{args.world}-rank{r}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", out], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    ok = True
    for p in procs:
        try:
            ok &= p.wait(timeout=args.timeout) == 0
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            ok = False
    if not ok or not os.path.exists(out):
        print(f"# {name}: FAILED (logs in {tmp})")
        return None
    with open(out) as f:
        return {op: {int(k): v for k, v in d.items()} for op, d in json.load(f).items()}


def fmt(size):
    return f"{size >> 20} MiB" if size >= (1 << 20) else f"{size >> 10} KiB"


def parse_size(v):
    m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(v[:-1]) * m[v[-1].upper()]) if v[-1].upper() in m else int(v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs="?", const="")
    ap.add_argument("--plugin")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--configs", default="epcomm-socket,epcomm-ofi,nccl-socket")
    ap.add_argument("--ofi-provider", default=os.environ.get("EPCOMM_OFI_PROVIDER", ""))
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--ops", default="all", help="comma list of " + ",".join(OPS) + " (default all)")
    ap.add_argument("--sizes", default="", help="comma list, e.g. 8K,32K,128K (default 8 KiB .. 256 MiB)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configs this many times, interleaved (A B C A B C ...); each cell is the median; "
                         "a config with a failed round is reported as failed")
    ap.add_argument("--reps", type=int, default=1, help="timed batches per cell within a run; their median counts")
    ap.add_argument("--iters-scale", type=float, default=1.0, help="scales the collectives per batch (20 up to 4 MiB)")
    a = ap.parse_args()
    if a.rounds < 1 or a.reps < 1 or a.iters_scale <= 0:
        ap.error(f"--rounds ({a.rounds}) and --reps ({a.reps}) must be at least 1, --iters-scale ({a.iters_scale}) "
                 "positive")
    a.ops = OPS if a.ops == "all" else [o for o in a.ops.split(",") if o]
    a.sizes = [parse_size(v) for v in a.sizes.split(",") if v] or SIZES
    if a.worker is not None:
        worker(a.worker)
        return 0
    tmp = tempfile.mkdtemp(prefix="epcomm-busbw-")
    configs = [c for c in a.configs.split(",") if c]
    runs = {c: [] for c in configs}
    for i in range(a.rounds):
        for c in configs:
            runs[c].append(run_config(c, a, tmp, i))
    results = {}
    for c in configs:
        ok = [r for r in runs[c] if r]
        results[c] = None if len(ok) < len(runs[c]) else {
            op: {size: statistics.median(r[op][size] for r in ok) for size in ok[0][op]} for op in a.ops}
    base = results.get("nccl-socket")
    worst = {}
    for op in a.ops:
        print(f"\n# {op} bus bandwidth (GB/s), world={a.world}, ranks on one GPU, every peer over the network"
              + (f", median of {a.rounds} interleaved rounds" if a.rounds > 1 else ""))
        w = {c: max(16, len(c) + 2) for c in configs}
        ratios = [c for c in configs if c != "nccl-socket" and base]
        wr = {c: max(20, len(c) + 7) for c in ratios}
        hdr = f"{'size':>10}" + "".join(f"{c:>{w[c]}}" for c in configs)
        hdr += "".join(f"{c + '/nccl':>{wr[c]}}" for c in ratios)
        print(hdr)
        for size in a.sizes:
            row = f"{fmt(size):>10}"
            for c in configs:
                v = results[c][op].get(size) if results[c] else None
                row += f"{v:{w[c]}.2f}" if v is not None else f"{'-':>{w[c]}}"
            for c in ratios:
                v, b = (results[c][op].get(size) if results[c] else None), base[op].get(size)
                row += f"{v / b:{wr[c]}.2f}" if v and b else f"{'-':>{wr[c]}}"
                if v and b:
                    worst[c] = min(worst.get(c, (9e9, "")), (v / b, f"{op} {fmt(size)}"))
            print(row)
    for c, (r, where) in worst.items():
        print(f"# lowest {c}/nccl-socket: {r:.2f} at {where}" + ("  (goal: never below 1.0)" if r < 1 else ""))
    print(f"\nlogs: {tmp}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
