"""plugin/torch/examples/moe_layer.py runs under torchrun on CPU and its two ways agree."""
import os
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "plugin", "torch", "examples", "moe_layer.py")


def test_moe_layer_example(tmp_path):
    env = dict(os.environ, EPCOMM_HOST_CHANNELS="1", OMP_NUM_THREADS="1", EPCOMM_TIMEOUT_MS="20000")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           EXAMPLE, "--tokens", "32", "--hidden", "256", "--ffn", "128", "--experts", "8", "--iters", "2"]
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "moe_layer buffer" in out.stdout and "moe_layer pg" in out.stdout, out.stdout
