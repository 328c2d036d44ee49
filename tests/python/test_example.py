"""plugin/torch/examples/moe_layer.py runs under torchrun on CPU and its ways (and the plain way on gloo) agree."""
import os
import signal
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "plugin", "torch", "examples", "moe_layer.py")


def test_moe_layer_example(tmp_path):
    env = dict(os.environ, EPCOMM_HOST_CHANNELS="1", OMP_NUM_THREADS="1", EPCOMM_TIMEOUT_MS="20000")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           EXAMPLE, "--tokens", "32", "--hidden", "256", "--ffn", "128", "--experts", "8", "--iters", "2",
           "--ref-backend", "gloo"]
    # Its own session, so that a timeout takes torchrun's workers down with it.
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stdout + stderr
    assert "moe_layer buffer" in stdout and "moe_layer pg" in stdout and "moe_layer pg-gloo" in stdout, stdout
