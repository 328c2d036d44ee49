"""Runs a function on N ranks, each in its own spawned process, for the Python suite.

run(world, fn, *args) starts the ranks with a FileStore rendezvous (no ports), waits for all of them with a
deadline, and raises with every failing rank's traceback. fn(rank, world, init_method, *args) must be a
module-level function (the ranks import it by name).
"""
import faulthandler
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback

DEFAULT_ENV = {
    "EPCOMM_TIMEOUT_MS": "20000",       # a hang fails within the test's deadline, with epcomm's message
    "EPCOMM_HOST_CHANNELS": "1",        # 2 cores shared by up to 4 ranks: one channel thread each
    "OMP_NUM_THREADS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
}


def _fault_path(init_method, rank):
    return init_method[len("file://"):] + f".rank{rank}.fault"


def _entry(fn, rank, world, init_method, env, args, results):
    os.environ.update(env)
    # A rank that crashes (SIGSEGV, SIGABRT) leaves its Python stack here for the failure message.
    fault = open(_fault_path(init_method, rank), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(fault, all_threads=True)
    outcome = None
    try:
        fn(rank, world, init_method, *args)
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        outcome = traceback.format_exc()
    results.put((rank, outcome))
    results.close()
    results.join_thread()
    os._exit(0)  # skip interpreter teardown: a rank's peers may be gone (killed-rank tests)


def run(world, fn, *args, env=None, timeout=240, expect_exit=None):
    """expect_exit: ranks that are meant to die (they report nothing)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    full_env = dict(DEFAULT_ENV, **(env or {}))
    expect_exit = set(expect_exit or ())
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{tmp}/store"
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init_method, full_env, args, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        outcomes = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < world - len(expect_exit) and time.monotonic() < deadline:
            try:
                rank, outcome = results.get(timeout=1)
                outcomes[rank] = outcome
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()) if p.is_alive() else 0)
            if p.is_alive():
                p.kill()
                p.join()
        stacks = {}
        for r in range(world):
            try:
                with open(_fault_path(init_method, r)) as f:
                    stacks[r] = f.read().strip()
            except FileNotFoundError:  # the rank died before it started
                stacks[r] = ""
    missing = [r for r in range(world) if r not in outcomes and r not in expect_exit]
    failed = {r: o for r, o in outcomes.items() if o is not None}
    if missing or failed:
        lines = []
        for r in missing:
            lines.append(f"rank {r} did not finish (exit code {procs[r].exitcode})")
            if stacks[r]:
                lines.append(stacks[r])
        lines += [f"--- rank {r} ---\n{o}" for r, o in sorted(failed.items())]
        raise AssertionError("\n".join(lines))
