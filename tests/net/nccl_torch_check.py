#!/usr/bin/env python3
"""NCCL over the epcomm net plugin, end to end with torch.distributed ('nccl' backend).

Launches WORLD ranks as separate processes (all on GPU 0; run under CUDA MPS), each with its own NCCL_HOSTID
so that NCCL treats every rank as its own node and sends every byte through the net plugin. Each rank runs
all_reduce, all_gather, reduce_scatter, all_to_all_single, broadcast and send/recv on fresh random inputs and
checks them against values computed locally from the same seeds; NCCL's log (NCCL_DEBUG=INFO) must show the
plugin assigned. Prints one PASS/FAIL line per op; exit code 0 only when everything passed.

  python3 tests/net/nccl_torch_check.py --plugin /abs/libnccl-net-epcomm.so --world 2 [--log-dir DIR]
  (EPCOMM_NET=socket|ofi and other EPCOMM_* variables are passed through to the ranks.)
"""
import argparse
import os
import random
import re
import socket
import subprocess
import sys
import tempfile

OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all_single", "broadcast", "send_recv"]
SIZES = [1024 + 3, 4 << 20]  # elements (float32): LL/LL128-sized and Simple-sized messages


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


# ----------------------------------------------------------------------------------------------------------------
def worker():
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    seed = int(os.environ["EPCOMM_CHECK_SEED"])
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)

    def inp(r, n, tag):
        g = torch.Generator().manual_seed(seed * 1000003 + r * 7919 + tag * 104729 + n)
        return torch.randn(n, generator=g, dtype=torch.float32)

    results = {}

    def record(op, ok, msg=""):
        prev = results.get(op, (True, ""))
        results[op] = (prev[0] and ok, prev[1] or ("" if ok else msg))

    for n in SIZES:
        # all_reduce (sum): fp32 sums in different orders differ in the last bits -> allclose
        x = inp(rank, n, 1).to(dev)
        dist.all_reduce(x)
        exp = sum(inp(r, n, 1).double() for r in range(world)).float()
        record("all_reduce", torch.allclose(x.cpu(), exp, rtol=1e-5, atol=1e-5), f"n={n}")

        # all_gather: exact
        x = inp(rank, n, 2).to(dev)
        out = torch.empty(n * world, device=dev)
        dist.all_gather_into_tensor(out, x)
        exp = torch.cat([inp(r, n, 2) for r in range(world)])
        record("all_gather", torch.equal(out.cpu(), exp), f"n={n}")

        # reduce_scatter (sum)
        x = inp(rank, n * world, 3).to(dev)
        out = torch.empty(n, device=dev)
        dist.reduce_scatter_tensor(out, x)
        full = sum(inp(r, n * world, 3).double() for r in range(world)).float()
        record("reduce_scatter", torch.allclose(out.cpu(), full[rank * n:(rank + 1) * n], rtol=1e-5, atol=1e-5),
               f"n={n}")

        # all_to_all_single, even and uneven splits: exact
        x = inp(rank, n * world, 4).to(dev)
        out = torch.empty(n * world, device=dev)
        dist.all_to_all_single(out, x)
        exp = torch.cat([inp(r, n * world, 4)[rank * n:(rank + 1) * n] for r in range(world)])
        record("all_to_all_single", torch.equal(out.cpu(), exp), f"even n={n}")

        def split(r, p):  # elements rank r sends to rank p
            return (n // world) + ((r * 3 + p * 5) % 7) * 13

        ins = [split(rank, p) for p in range(world)]
        outs = [split(r, rank) for r in range(world)]
        x = inp(rank, sum(ins), 5).to(dev)
        out = torch.empty(sum(outs), device=dev)
        dist.all_to_all_single(out, x, output_split_sizes=outs, input_split_sizes=ins)
        parts = []
        for r in range(world):
            src = inp(r, sum(split(r, p) for p in range(world)), 5)
            off = sum(split(r, p) for p in range(rank))
            parts.append(src[off:off + split(r, rank)])
        record("all_to_all_single", torch.equal(out.cpu(), torch.cat(parts)), f"uneven n={n}")

        # broadcast from the last rank: exact
        root = world - 1
        x = inp(rank, n, 6).to(dev)
        dist.broadcast(x, src=root)
        record("broadcast", torch.equal(x.cpu(), inp(root, n, 6)), f"n={n}")

        # send/recv around a ring (batched so that no order can deadlock): exact
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        x = inp(rank, n, 7).to(dev)
        out = torch.empty(n, device=dev)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, out, prv)])
        for q in reqs:
            q.wait()
        torch.cuda.synchronize()
        record("send_recv", torch.equal(out.cpu(), inp(prv, n, 7)), f"n={n}")

    # Every rank's verdicts reach rank 0 (over NCCL too).
    flags = torch.tensor([1 if results[op][0] else 0 for op in OPS], device=dev, dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    for op in OPS:
        ok, msg = results[op]
        print(f"EPCOMM_RESULT rank={rank} op={op} {'PASS' if ok else 'FAIL ' + msg}", flush=True)
    if rank == 0:
        print("EPCOMM_ALL " + " ".join(f"{op}={int(v)}" for op, v in zip(OPS, flags.tolist())), flush=True)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
def launch(args):
    world = args.world
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="epcomm-nccl-")
    os.makedirs(log_dir, exist_ok=True)
    port = free_port()
    seed = random.SystemRandom().randrange(1, 1 << 30)  # fresh inputs every run
    backend = os.environ.get("EPCOMM_NET", "socket")
    tag = backend + ("-" + re.sub(r"[^A-Za-z0-9]", "_", os.environ["EPCOMM_OFI_PROVIDER"])
                     if backend == "ofi" and os.environ.get("EPCOMM_OFI_PROVIDER") else "")
    procs, logs = [], []
    for r in range(world):
        env = dict(os.environ)
        env.update({
            "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "NCCL_HOSTID": f"epcomm-check-{port}-{r}",  # every rank its own "node" -> all traffic via the plugin
            "NCCL_NET_PLUGIN": os.path.abspath(args.plugin),
            "NCCL_NET": "epcomm",  # fail loudly instead of falling back to NCCL's Socket transport
            "NCCL_SOCKET_IFNAME": "lo",
            "EPCOMM_SOCKET_IFNAME": env.get("EPCOMM_SOCKET_IFNAME", "lo"),
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": env.get("NCCL_DEBUG_SUBSYS", "INIT,NET"),
            "NCCL_NVLS_ENABLE": "0",
            "NCCL_MNNVL_ENABLE": "0",
            "EPCOMM_CHECK_SEED": str(seed),
        })
        log = os.path.join(log_dir, f"{tag}-w{world}-rank{r}.log")
        logs.append(log)
        f = open(log, "w")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], env=env,
                                      stdout=f, stderr=subprocess.STDOUT))
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=args.timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            rcs.append("timeout")
    text = [open(l, errors="replace").read() for l in logs]
    verdict = {}
    for t in text:
        for m in re.finditer(r"EPCOMM_RESULT rank=(\d+) op=(\S+) (PASS|FAIL.*)", t):
            ok = m.group(3) == "PASS"
            verdict[m.group(2)] = verdict.get(m.group(2), True) and ok
    # The plugin must be the network NCCL assigned, on every rank.
    plugin_ok = all(re.search(r"Using network epcomm|Assigned NET plugin epcomm", t) for t in text)
    label = f"[{tag} world={world}]"
    print(f"{label} {'PASS' if plugin_ok else 'FAIL'} plugin assigned (\"Using network epcomm\" in every rank's log)")
    all_ok = plugin_ok
    for op in OPS:
        ok = verdict.get(op, False) and all(rc == 0 for rc in rcs)
        all_ok &= ok
        print(f"{label} {'PASS' if ok else 'FAIL'} {op}")
    if not all_ok:
        print(f"{label} exit codes {rcs}; logs in {log_dir}")
        for l, t in zip(logs, text):
            tail = "\n".join(t.splitlines()[-15:])
            print(f"--- {l} (tail)\n{tail}")
    else:
        print(f"{label} logs in {log_dir}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--plugin", default=None)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--timeout", type=int, default=600)
    a = ap.parse_args()
    if a.worker:
        worker()
        sys.exit(0)
    if not a.plugin:
        ap.error("--plugin is required")
    sys.exit(launch(a))
