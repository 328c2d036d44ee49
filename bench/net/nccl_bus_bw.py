#!/usr/bin/env python3
"""NCCL all_reduce and all_to_all bus bandwidth through torch.distributed, for several network setups in one run.

Each configuration launches WORLD rank processes on GPU 0 (under CUDA MPS), each with its own NCCL_HOSTID so
every byte crosses the network transport; timing uses CUDA events, the slowest rank counts. Bus bandwidth as
in nccl-tests: all_reduce busbw = algbw * 2(n-1)/n, all_to_all busbw = algbw * (n-1)/n.

  python3 bench/net/nccl_bus_bw.py --plugin /abs/libnccl-net-epcomm.so --world 2 \\
      --configs "epcomm-socket,epcomm-ofi,nccl-socket" [--ofi-provider "tcp;ofi_rxm"]
Prints one table per op: size, busbw per config (GB/s), and epcomm/NCCL-Socket ratios.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def worker(out_path):
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    res = {"all_reduce": {}, "all_to_all": {}}
    for size in SIZES:
        n = size // 4
        n -= n % world
        x = torch.ones(n, device=dev)
        y = torch.empty(n, device=dev)
        for op in res:
            fn = (lambda: dist.all_reduce(x)) if op == "all_reduce" else (lambda: dist.all_to_all_single(y, x))
            iters = 20 if size <= (4 << 20) else (10 if size <= (64 << 20) else 5)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(iters):
                fn()
            e.record()
            torch.cuda.synchronize()
            t = torch.tensor([s.elapsed_time(e) / 1e3 / iters], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            algbw = n * 4 / t.item() / 1e9
            factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
            res[op][size] = algbw * factor
            x.fill_(1.0)  # keep all_reduce values bounded
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


def config_env(name, args):
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
    return env


def run_config(name, args, tmp):
    port = free_port()
    out = os.path.join(tmp, f"{name}-w{args.world}.json")
    procs = []
    for r in range(args.world):
        env = dict(os.environ)
        env.update(config_env(name, args))
        env.update({"RANK": str(r), "WORLD_SIZE": str(args.world), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "NCCL_HOSTID": f"busbw-{port}-{r}"})
        log = open(os.path.join(tmp, f"{name}-w{args.world}-rank{r}.log"), "w")
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs="?", const="")
    ap.add_argument("--plugin")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--configs", default="epcomm-socket,epcomm-ofi,nccl-socket")
    ap.add_argument("--ofi-provider", default=os.environ.get("EPCOMM_OFI_PROVIDER", ""))
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker)
        return 0
    tmp = tempfile.mkdtemp(prefix="epcomm-busbw-")
    configs = [c for c in a.configs.split(",") if c]
    results = {c: run_config(c, a, tmp) for c in configs}
    base = results.get("nccl-socket")
    for op in ("all_reduce", "all_to_all"):
        print(f"\n# {op} bus bandwidth (GB/s), world={a.world}, ranks on one GPU, every peer over the network")
        hdr = f"{'size':>10}" + "".join(f"{c:>16}" for c in configs)
        ratios = [c for c in configs if c != "nccl-socket" and base]
        hdr += "".join(f"{c + '/nccl':>20}" for c in ratios)
        print(hdr)
        for size in SIZES:
            row = f"{fmt(size):>10}"
            for c in configs:
                v = results[c][op].get(size) if results[c] else None
                row += f"{v:16.2f}" if v is not None else f"{'-':>16}"
            for c in ratios:
                v, b = (results[c][op].get(size) if results[c] else None), base[op].get(size)
                row += f"{v / b:20.2f}" if v and b else f"{'-':>20}"
            print(row)
    print(f"\nlogs: {tmp}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
