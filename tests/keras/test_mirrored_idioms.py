"""Keras idioms under a real 2-replica tf.distribute.MirroredStrategy, nightly only
(tools/suite_tiers.py NIGHTLY_ONLY): a tf.train.Checkpoint restore (iterations go back, the
ledger does not, no noise repeated), model.save / load_model then fit (the ledger
continues), BackupAndRestore, BandMF noise and physical chunks (one ledger sample per step),
and steps_per_execution (a non-divisor refused). The jobs run in one fresh process
(`mirrored_idioms_job.py`: the 2 logical CPUs must be configured before TensorFlow starts)
and each is checked here by its check; the numbers they expect are in the checks'
docstrings.
"""

import pytest

from tests.keras import mirrored_idioms_job
from tests.keras import test_distribute


def _jobs():
  """{job name: its stdout lines}, from one run of mirrored_idioms_job."""
  jobs, stdout, _ = test_distribute.run_jobs("tests.keras.mirrored_idioms_job")
  assert tuple(jobs) == mirrored_idioms_job.JOBS, stdout[-3000:]
  return jobs


@pytest.mark.slow
def test_mirrored_idioms_charge_every_step_once():
  """Every job's check (a failing one does not hide the others' verdicts)."""
  jobs = _jobs()
  failures = []
  for name in mirrored_idioms_job.JOBS:
    try:
      mirrored_idioms_job.CHECKS[name](jobs[name])
    except AssertionError as e:
      failures.append(f"{name}: {e!r}"[:3000])
  assert not failures, "\n".join(failures)
