"""Rollbacks as a table: noise correlation at an equal counter, steps released vs charged.

The runs of tests/privacy/test_rollback_noise.py (noise on: z = 10, S = 0.01, a Dense(40) on
300 features, 64 examples, Poisson batches of 16; the real fit step): for each way the step
counter goes back on the same model object in one process (an in-process retry with
BackupAndRestore, tf.train.Checkpoint.restore of an earlier step, load_weights,
iterations.assign), with the noise drawn inside the XLA program (the accelerator default,
forced on CPU) and after it. A row gives the correlation of the two updates released at one
counter (1.0: the same noise twice; independent draws ~0.01), the updates released and the
ledger's samples, and epsilon at delta = 1e-5 from the ledger (RDP) against dp-accounting by
hand on the released steps.

A second table takes every sampling policy through an in-process tf.train.Checkpoint rollback
(tests/privacy/matrix_runs.py, noise 0, one-hot probe: each step's examples are read back):
steps released against ledger samples, or "refused" (correlated noise refuses the rollback).

usage: python -m benchmarks.rollback_audit   (run from the repository root; PYTHONPATH=<tree>
to audit another checkout)
"""

import os
import platform
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from tests.privacy import matrix_runs  # noqa: E402  pylint: disable=wrong-import-position
from tests.privacy import test_rollback_noise as runs  # noqa: E402  pylint: disable=wrong-import-position
from tf_dpiter.ledger import policies  # noqa: E402  pylint: disable=wrong-import-position
import tf_dpiter as dp  # noqa: E402  pylint: disable=wrong-import-position

PATHS = ("backup_and_restore", "checkpoint", "load_weights", "iterations_assign")


def row(path, compiled_draw):
  """One row: (path, draw, correlation, released, charged, claimed eps, eps by hand)."""
  model, opt = runs._model(compiled_draw)   # pylint: disable=protected-access
  x, y = runs._data()                        # pylint: disable=protected-access
  with tempfile.TemporaryDirectory() as work:
    import pathlib  # pylint: disable=g-import-not-at-top
    if path == "backup_and_restore":
      first, second, released = runs._retry_updates(model, x, y, pathlib.Path(work))  # pylint: disable=protected-access
    else:
      first, second, released = runs._rollback_updates(path, model, x, y, pathlib.Path(work))  # pylint: disable=protected-access
  corr = runs._corr(first.ravel(), second.ravel())   # pylint: disable=protected-access
  charged = int(opt.ledger.sample_count.numpy())
  claimed = dp.accounting.epsilon(opt.ledger, runs.DELTA, accountant="rdp")
  return (path, "in XLA" if compiled_draw else "after", corr, released, charged, claimed,
          runs._hand_epsilon(released))   # pylint: disable=protected-access


def main():
  print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
        f"load {os.getloadavg()[0]:.1f}")
  print("| path | noise drawn | corr. at equal counter | released | charged | claimed eps | "
        "eps by hand |")
  print("|---|---|---|---|---|---|---|")
  for path in PATHS:
    for compiled_draw in (True, False):
      p, d, c, rel, ch, claimed, hand = row(path, compiled_draw)
      print(f"| {p} | {d} | {c:.4f} | {rel} | {ch} | {claimed:.3f} | {hand:.3f} |")
  print()
  print("| policy | steps released | ledger samples |")
  print("|---|---|---|")
  for policy in policies.names():
    with tempfile.TemporaryDirectory() as work:
      net, joined, refused = matrix_runs.run(policy, "checkpoint_rollback", work)
    charged = "refused" if refused is not None else str(int(net.ledger.sample_count.numpy()))
    print(f"| {policy} | {len(joined)} | {charged} |")


if __name__ == "__main__":
  main()
