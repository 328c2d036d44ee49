"""The Python benchmarks in bench/python run on CPU (host engine) with minimal sizes, print their table and
write their CSV: through their own spawn helper (--ranks) and, for one of them, under torchrun."""
import csv
import os
import signal
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python")
ENV = dict(os.environ, EPCOMM_HOST_CHANNELS="1", OMP_NUM_THREADS="1", EPCOMM_TIMEOUT_MS="20000")

SCRIPTS = {
    "buffer_overhead.py": (["--iters", "3", "--tokens", "8", "--hidden", "128", "--experts", "4", "--topk", "2"],
                           "Buffer per-call overhead", {"HT dispatch (exact)", "HT combine", "LL dispatch", "LL combine"}),
    "a2a_backend.py": (["--iters", "2", "--sizes-mib", "0.0625,0.25"], "all_to_all_single", {"0.0625", "0.25"}),
    "moe_layer_bench.py": (["--iters", "2", "--tokens", "16", "--hidden", "128", "--ffn", "64", "--experts", "4",
                            "--topk", "2"], "moe_layer tokens/s", {"buffer", "pg-epcomm", "pg-ref"}),
}


def _run(cmd, cwd):
    # Its own session, so that a timeout takes the ranks down with it.
    proc = subprocess.Popen(cmd, env=ENV, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stdout + stderr
    return stdout


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_bench_script_cpu(script, tmp_path):
    extra, title, first_column = SCRIPTS[script]
    out_csv = tmp_path / "out.csv"
    stdout = _run([sys.executable, os.path.join(BENCH, script), "--ranks", "2", "--csv", str(out_csv), *extra],
                  tmp_path)
    assert title in stdout, stdout
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    assert {r[next(iter(rows[0]))] for r in rows} == first_column, rows
    assert all(r["ranks"] == "2" and r["device"] == "cpu" for r in rows), rows


def test_bench_script_torchrun(tmp_path):
    extra, title, _ = SCRIPTS["a2a_backend.py"]
    stdout = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   os.path.join(BENCH, "a2a_backend.py"), *extra], tmp_path)
    assert title in stdout and "gloo" in stdout, stdout
