"""Run in a fresh process: the default suite's MirroredStrategy jobs on 2 logical CPUs, one
after the other in this one process and one MirroredStrategy (TensorFlow starts and the 2
devices are set up once, instead of once per job):

  distributed        distributed_worker.main(): noise drawn once, the ledger counts once
  mirrored_poisson   mirrored_poisson_worker.main(2): Poisson fit, without and with XLA
  matrix             matrix_mirrored_worker.main(["poisson,shuffle", WORKDIR]): the policy
                     matrix's MIRRORED cells of Poisson and shuffled passes
  apply_replicas     test_apply_replicas.mirrored_update_check: the DP optimizer's update
                     keeps Keras' sum over the replicas
  traced_loop        test_traced_loop_distribute.two_replica_checks: a custom loop's traced
                     private steps stated, and weights changed around them (one replica's
                     copy included) refused
  row_bound          mirrored_soundness_job.row_bound_refusals: a replica's batch past the
                     public row bound refused, without and with XLA
  outside_scope      mirrored_soundness_job.outside_scope: a DP optimizer created outside the
                     strategy refused at compile
  rollback_noise     mirrored_soundness_job.rollback_noise: iterations rolled back, no noise
                     reused and no step uncharged, without and with XLA
  xla_compile        xla_compile_worker.main("fast"): test_xla_compile_once.py's case, a
                     3-epoch jit_compile fit outside the strategy (on one device), last: its
                     part of TensorFlow's device-compiler log (the process runs with
                     test_xla_compile_once.LOG_ENV) runs from its "@@CASE fast@@" marker on
                     stderr to the process's end

Each job's output follows a line "JOB <name>" (tests/keras/test_distribute.py reads them and
checks each job as its own test file did).

Usage: python -m tests.keras.mirrored_jobs_worker WORKDIR
"""

import sys

import tensorflow as tf

# Each worker sets up the 2 logical CPUs at import (the first one; the others find them).
from tests.keras import distributed_worker
from tests.keras import mirrored_soundness_job
from tests.keras import mirrored_poisson_worker
from tests.keras import test_apply_replicas
from tests.keras import test_traced_loop_distribute
from tests.keras import xla_compile_worker
from tests.privacy import matrix_mirrored_worker

MATRIX_POLICIES = "poisson,shuffle"


def main(argv):
  """Runs the nine jobs in one MirroredStrategy (two strategies in a process draw the same
  collective instance keys, and their all-reduces collide); a failing job raises (a
  non-zero exit status)."""
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  # first: a refusal's op order is the graph's (the old fault showed in a fresh process)
  print("JOB row_bound", flush=True)
  mirrored_soundness_job.row_bound_refusals(strategy)
  print("JOB outside_scope", flush=True)
  mirrored_soundness_job.outside_scope(strategy)
  print("JOB rollback_noise", flush=True)
  mirrored_soundness_job.rollback_noise(strategy)
  print("JOB distributed", flush=True)
  distributed_worker.main(strategy)
  print("JOB mirrored_poisson", flush=True)
  mirrored_poisson_worker.main(2, strategy)
  print("JOB matrix", flush=True)
  matrix_mirrored_worker.main([MATRIX_POLICIES, argv[0]], strategy)
  print("JOB apply_replicas", flush=True)
  test_apply_replicas.mirrored_update_check(strategy)
  print("JOB traced_loop", flush=True)
  test_traced_loop_distribute.two_replica_checks(strategy)
  print("JOB xla_compile", flush=True)
  sys.stderr.write("@@CASE fast@@\n")
  sys.stderr.flush()
  print("CASE fast", flush=True)
  xla_compile_worker.main("fast")


if __name__ == "__main__":
  main(sys.argv[1:])
