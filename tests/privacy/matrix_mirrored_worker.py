"""Run in a fresh process: the policy matrix's MIRRORED cells (tests/privacy/matrix_runs.py)
under tf.distribute.MirroredStrategy on 2 logical CPUs, each checked by
`matrix_runs.check_cell` (tests/privacy/test_policy_matrix.py starts it).

Usage: python -m tests.privacy.matrix_mirrored_worker POLICY[,POLICY...] WORKDIR
(prints "CELL OK <policy>" per cell; exits non-zero on the first failure)
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

_CPUS = tf.config.list_physical_devices("CPU")
if tf.config.get_logical_device_configuration(_CPUS[0]) is None:   # once per process
  tf.config.set_logical_device_configuration(_CPUS[0], [tf.config.LogicalDeviceConfiguration()] * 2)

from tests.privacy import matrix_runs  # noqa: E402  pylint: disable=wrong-import-position


def main(argv, strategy=None):
  """Runs and checks the MIRRORED cell of each policy in argv[0] (comma-separated), in
  `strategy` if given (a MirroredStrategy on the 2 CPUs shared by mirrored_jobs_worker)."""
  strategy = strategy or tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  for policy in argv[0].split(","):
    workdir = os.path.join(argv[1], policy)
    os.makedirs(workdir, exist_ok=True)
    net, joined, refused = matrix_runs.run(policy, matrix_runs.MIRRORED, workdir,
                                           strategy=strategy)
    matrix_runs.check_cell(policy, matrix_runs.MIRRORED, net, joined, refused)
    print(f"CELL OK {policy}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
