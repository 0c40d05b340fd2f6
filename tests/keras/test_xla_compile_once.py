"""The DP step under XLA is compiled a bounded number of times per fit, whatever the number
of steps (the accelerator path: Keras sets jit_compile=True on any GPU/TPU machine).

Each case runs `xla_compile_worker.py` in a fresh process with TensorFlow's device-compiler
log on and counts the XLA compilations of the clipped-sum step in its log; the fit takes 18
steps over 3 epochs. Before the fix every step compiled anew (18 compilations: the batch
was a compile-time constant because the backward pass went through the per-record loss map).
The ledger holds one sample per optimizer step.
"""

import os
import re
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "xla_compile_worker.py")
COMPILE_LINE = re.compile(r"Instantly compiling for signature: (\S+)")


def _run(case):
  env = dict(os.environ, TF_CPP_VMODULE="device_compiler=2", TF_CPP_MIN_LOG_LEVEL="0")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, WORKER, case], capture_output=True, text=True,
                        env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = dict(line.split() for line in proc.stdout.splitlines() if line.startswith(("ITER", "SAMP")))
  compiles = COMPILE_LINE.findall(proc.stderr)
  return int(out["ITERATIONS"]), int(out["SAMPLES"]), compiles


@pytest.mark.parametrize("case", ["fast", "vectorized", "band_mf", pytest.param("cnn", marks=pytest.mark.slow)])
def test_dp_fit_under_xla_compiles_once(case):
  iterations, samples, compiles = _run(case)
  assert iterations == 18
  assert samples == iterations          # the ledger is exact: one sample per step
  step_compiles = [c for c in compiles if "dp_clipped_sum_step" in c]
  assert compiles, "no XLA compilation logged: was jit_compile honoured?"
  # bounded, independent of the 18 steps (one signature per fit; 2 allows a retrace)
  assert 1 <= len(step_compiles) <= 2, compiles
  assert len(compiles) <= 3, compiles
