"""tf.distribute.MirroredStrategy on 2 logical CPU devices (in a subprocess: the device
configuration must precede TensorFlow's initialization)."""

import json
import os
import subprocess
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_mirrored_noise_once_and_ledger_counts_once():
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, os.path.join(HERE, "distributed_worker.py")],
                        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  out = json.loads(lines[-1][len("RESULT "):])
  assert out["replicas"] == 2
  # noise 0: same update as on one device
  assert out["update_norm"] > 1e-3
  assert out["max_abs_diff"] < 1e-5
  # each step counted once
  assert out["ledger_after_1"] == 1
  # the fast path under the strategy: same update as one device (per example) and as the
  # vectorized path under the strategy (2 microbatches per replica)
  for mb in ("None", "2"):
    assert out[f"fast_clipping_{mb}"] == "fast"
    assert out[f"fast_update_{mb}"] > 1e-3
    assert out[f"fast_max_abs_diff_{mb}"] < 1e-5, out
  assert out["ledger_noisy"] == 10
  # noise drawn once on the global sum: std ratio 1 (sqrt(2) = 1.41 if once per replica).
  # 2000 x 6 draws: relative standard error of the std is 1/sqrt(2 * 12000) = 0.65%; allow 5%.
  assert abs(out["std_ratio"] - 1.0) < 0.05, out
  assert out["replicas_equal"] is True   # replicas applied the same noised update
