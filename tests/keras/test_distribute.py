"""tf.distribute.MirroredStrategy on 2 logical CPU devices (in a subprocess: the device
configuration must precede TensorFlow's initialization).

The default suite's MirroredStrategy jobs share that one subprocess
(`mirrored_jobs_worker.py`): this file's noise-and-ledger job, test_mirrored_poisson.py's
two Poisson fits, test_policy_matrix.py's MIRRORED cells of Poisson and shuffled passes,
test_apply_replicas.py's sum over the replicas, test_traced_loop_distribute.py's custom
loop traced under 2 replicas and mirrored_soundness_job.py's replica batch past the public
row bound, optimizer created outside the strategy and iterations rolled back; last,
test_xla_compile_once.py's fast-path fit under XLA (not distributed: it shares the process,
which runs with TensorFlow's device-compiler log on, to save a process of its own). Each job
is checked here by its own file's check. Their `-m slow` variants start processes of their
own.
"""

import json
import os
import subprocess
import sys

from tests.keras import mirrored_soundness_job
from tests.keras import test_apply_replicas
from tests.keras import test_mirrored_poisson
from tests.keras import test_traced_loop_distribute
from tests.keras import test_xla_compile_once
from tests.privacy import test_policy_matrix

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run_jobs(module, *args, env=None):
  """({job name: its stdout lines}, the stdout, the stderr) of one run of the job module
  `module` (a process of its own, whose jobs each print "JOB name" and then their lines);
  `env`: variables added to its environment."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             **(env or {}))
  proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        timeout=900, env=env, cwd=ROOT, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  jobs, name = {}, None
  for line in proc.stdout.splitlines():
    if line.startswith("JOB "):
      name = line[len("JOB "):]
      jobs[name] = []
    elif name is not None:
      jobs[name].append(line)
  return jobs, proc.stdout, proc.stderr


def _jobs(workdir):
  """({job name: its stdout lines}, the stderr), from one run of mirrored_jobs_worker (with
  TensorFlow's device-compiler log on, for the xla_compile job)."""
  jobs, stdout, stderr = run_jobs("tests.keras.mirrored_jobs_worker", workdir,
                                  env=test_xla_compile_once.LOG_ENV)
  assert list(jobs) == ["row_bound", "outside_scope", "rollback_noise", "distributed",
                        "mirrored_poisson", "matrix", "apply_replicas", "traced_loop",
                        "xla_compile"], stdout[-2000:]
  return jobs, stderr


def _check_noise_once_and_ledger_once(lines):
  results = [l for l in lines if l.startswith("RESULT ")]
  assert results, lines
  out = json.loads(results[-1][len("RESULT "):])
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


def test_mirrored_noise_once_and_ledger_counts_once(tmp_path):
  jobs, stderr = _jobs(str(tmp_path))
  _check_noise_once_and_ledger_once(jobs["distributed"])
  test_mirrored_poisson.check_runs(jobs["mirrored_poisson"], 2)
  test_policy_matrix.check_mirrored_cells(jobs["matrix"], "poisson,shuffle")
  test_apply_replicas.check_mirrored(jobs["apply_replicas"])
  test_traced_loop_distribute.check_two_replicas(jobs["traced_loop"])
  mirrored_soundness_job.check_refusals(jobs["row_bound"])
  mirrored_soundness_job.check_outside_scope(jobs["outside_scope"])
  mirrored_soundness_job.check_rollback_noise(jobs["rollback_noise"])
  # the last job: its part of the log from its marker on
  test_xla_compile_once.check_cases(test_xla_compile_once.parse_cases(
      ["fast"], "\n".join(jobs["xla_compile"]), stderr))
