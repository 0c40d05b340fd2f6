"""The DP step under XLA is compiled a bounded number of times per fit, whatever the number
of steps (the accelerator path: Keras sets jit_compile=True on any GPU/TPU machine).

The cases run in `xla_compile_worker.py` (a process with TensorFlow's device-compiler log
on; a parameter's cases one after the other in one process, each with its own model) and the
XLA compilations of each case's clipped-sum step are counted in its part of the log; the fit
takes 18 steps over 3 epochs. Every case here is nightly: the default tier runs the fast
path's case as the last job of tests/keras/test_distribute.py's process (`parse_cases` and
`check_cases` below read and check it there). Before the fix every step compiled anew (18 compilations: the batch
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


# TensorFlow's device-compiler log on (read at the process's start): the worker's environment,
# and that of tests/keras/test_distribute.py's MirroredStrategy process, which runs the
# default tier's case (`fast`) as its last job (`mirrored_jobs_worker`)
LOG_ENV = {"TF_CPP_VMODULE": "device_compiler=2", "TF_CPP_MIN_LOG_LEVEL": "0"}


def parse_cases(cases, stdout, stderr):
  """{case: (iterations, ledger samples, shapes, compiled signatures)} from the stdout and
  stderr of `xla_compile_worker.main`'s runs of `cases`, each after its markers ("CASE name"
  on stdout, "@@CASE name@@" on stderr; a case's part of the log runs to the next marker)."""
  stdout = stdout.split("CASE ")[1:]
  stderr = stderr.split("@@CASE ")[1:]
  assert [c.split()[0] for c in stdout] == [c.split("@@")[0] for c in stderr] == list(cases)
  results = {}
  for name, out_part, err_part in zip(cases, stdout, stderr):
    out = dict(line.split() for line in out_part.splitlines()
               if line.startswith(("ITER", "SAMP", "SHAPES")))
    results[name] = (int(out["ITERATIONS"]), int(out["SAMPLES"]), int(out["SHAPES"]),
                     COMPILE_LINE.findall(err_part))
  return results


def _run_worker(cases):
  """{case: (iterations, ledger samples, compiled signatures)}: the cases run in one worker
  process, one after the other (each its own model and fit, so its own compilations, told
  apart by the worker's case markers)."""
  env = dict(os.environ, **LOG_ENV)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, WORKER, *cases], capture_output=True, text=True,
                        env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return parse_cases(cases, proc.stdout, proc.stderr)


# All nightly (-m slow), each set in a worker of its own: the fast path (auto's usual route),
# whose default run is test_distribute.py's `xla_compile` job (the same worker code and
# checks, in the default tier's MirroredStrategy process, after its other jobs: one process
# less; `check_cases`), the vectorized path and band_mf noise, and the CNN (the same bound on
# compilations).
@pytest.mark.parametrize("cases", [pytest.param(("fast",), marks=pytest.mark.slow),
                                   pytest.param(("vectorized", "band_mf"),
                                                marks=pytest.mark.slow),
                                   pytest.param(("cnn",), marks=pytest.mark.slow)],
                         ids=lambda c: "-".join(c))
def test_dp_fit_under_xla_compiles_once(cases):
  check_cases(_run_worker(cases))


def check_cases(results):
  """The assertions on each case's fit: 18 steps, one ledger sample each, and a number of XLA
  compilations of the step bounded independently of the steps."""
  for case, (iterations, samples, shapes, compiles) in results.items():
    assert iterations == 18, case
    assert samples == iterations, case    # the ledger is exact: one sample per step
    step_compiles = [c for c in compiles if "dp_clipped_sum_step" in c]
    # the weight fingerprints' digest (weight_fingerprints._fused_digest), run at the states
    # a fit accepts and releases, not per step: one program per distinct shape of a variable
    # above HOST_ELEMENTS values (these models' are all smaller: digested on the host, none)
    digest_compiles = [c for c in compiles if "_fused_digest" in c]
    other = [c for c in compiles if c not in step_compiles and c not in digest_compiles]
    assert compiles, f"{case}: no XLA compilation logged: was jit_compile honoured?"
    # bounded, independent of the 18 steps (one signature per fit; 2 allows a retrace)
    assert 1 <= len(step_compiles) <= 2, (case, compiles)
    assert len(digest_compiles) <= shapes, (case, shapes, compiles)
    assert len(other) <= 1, (case, compiles)
