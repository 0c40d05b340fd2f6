"""Every sampling policy x {one fit, several fits with steps_per_epoch, a new dataset, a crash
and BackupAndRestore, save/load, an in-process rollback (tf.train.Checkpoint restore of an
earlier step; weights and iterations assigned back), an in-process retry with
BackupAndRestore on the same model, jit_compile with the noise drawn inside the XLA
program, a journal resumed by a model loaded from a save taken before a crash,
steps_per_execution 2 (participations counted per execution), MirroredStrategy on 2 logical
CPUs (in a process of its own; Poisson's and shuffle's cells in the process that
tests/keras/test_distribute.py shares among the default suite's MirroredStrategy jobs)}:
participations never exceed the ledger's claim. (Not here, since this probe needs noise 0:
StopAtPrivacyBudget is checked in
tests/keras/test_budget_fit_steps.py and tests/privacy/test_budget_passes.py, noise on across
rollbacks in tests/privacy/test_rollback_noise.py.)

The real Keras pipeline and training step with noise 0 (`matrix_runs`): the weights read back
after every step show which examples it used. Per cell: every step ever taken (a crashed
run's included) is a ledger sample; each unit's participations are at most what the policy
object says its rows charge (`participation_bound`) and at least `min_gap` steps apart; the
premise of the policy's event holds (fixed size and full batch: the declared size; truncated
Poisson: at most B; user level: at most k examples of a user per step; Poisson-type rows: one
q for the run). A cell may instead be refused before its first step (PrivacyConfigError),
which must leave the step count unchanged. The declared relation and unit are each policy's
own (add/remove or replace one example; add/remove one user for user-level sampling). The
client-unit policies (a record is a client's model update) are the federated server's, which
tests/federated checks; a Keras step refuses them (`test_a_keras_step_refuses_client_policies`).
"""

import os
import subprocess
import sys

import pytest

import tf_dpiter as dp
from tf_dpiter.ledger import policies

from tests.privacy import matrix_runs  # noqa: E402

# The policies a Keras fit can declare: every registered one whose record is an example or a
# user (a client's update is the federated server's record).
KERAS_POLICIES = tuple(p for p in policies.names() if policies.get(p).unit != "client")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The default suite runs one cell per scenario but one_fit (a fit of 3 epochs) and at least
# one per policy; `-m slow` runs the whole matrix (41 cells). Across fits of one dataset
# (fits_steps) shuffle's cell stays: balls in bins' is test_pass_participation.py's
# [False-balls_in_bins], cyclic Poisson's cycle across
# fits this matrix's new_dataset and save_load cells and test_cyclic_schedule.py's
# test_four_fits_of_five_steps_keep_the_ledgers_claim[same_dataset-blt]. Poisson's rollback,
# compiled draw and steps per execution cells and shuffle's crash and journal cells stay.
_DEFAULT_CELLS = {("shuffle", "fits_steps"),
                  ("cyclic_poisson", "new_dataset"), ("cyclic_poisson", "save_load"),
                  ("shuffle", "crash_resume"), ("poisson", "checkpoint_rollback"),
                  ("balls_in_bins", "retry"),
                  ("truncated_poisson", "iterations_rollback"),
                  ("poisson", "xla_compiled_draw"), ("shuffle", "journal_resume"),
                  ("poisson", "steps_per_execution")}
def _cells():
  for policy in KERAS_POLICIES:
    for scenario in matrix_runs.SCENARIOS:   # MIRRORED: test_mirrored_strategy_cells
      fast = (policy, scenario) in _DEFAULT_CELLS
      yield pytest.param(policy, scenario, id=f"{policy}-{scenario}",
                         marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("policy,scenario", list(_cells()))
def test_participations_never_exceed_the_ledgers_claim(policy, scenario, tmp_path):
  net, joined, refused = matrix_runs.run(policy, scenario, str(tmp_path))
  matrix_runs.check_cell(policy, scenario, net, joined, refused)


def check_mirrored_cells(lines, policies_):
  """matrix_mirrored_worker's stdout `lines` report every cell of `policies_` (comma-separated)
  checked (`matrix_runs.check_cell` raises in the worker otherwise)."""
  assert [l for l in lines if l.startswith("CELL OK")] == [
      f"CELL OK {p}" for p in policies_.split(",")], lines


@pytest.mark.slow
def test_mirrored_strategy_cells(tmp_path):
  """The MIRRORED cells of the policies other than Poisson and shuffled passes, in a process
  with 2 logical CPUs (matrix_mirrored_worker.py); Poisson's and shuffle's run in the default
  suite in the MirroredStrategy process of tests/keras/test_distribute.py."""
  policies_ = ",".join(p for p in KERAS_POLICIES if p not in ("poisson", "shuffle"))
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-m", "tests.privacy.matrix_mirrored_worker",
                         policies_, str(tmp_path)], capture_output=True, text=True,
                        timeout=900, env=env, cwd=_ROOT, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  check_mirrored_cells(proc.stdout.splitlines(), policies_)


def test_the_matrix_covers_every_registered_policy():
  assert set(policies.names()) - set(KERAS_POLICIES) == {"client_poisson", "client_fixed_size"}
  for policy in KERAS_POLICIES:
    matrix_runs.Case(policy).fit_args(None)   # raises for a policy without a matrix case


@pytest.mark.parametrize("policy", sorted(set(policies.names()) - set(KERAS_POLICIES)))
def test_a_keras_step_refuses_client_policies(policy):
  """A client-unit policy declared on a Keras optimizer would state the sensitivity per client
  update while the step clips examples: refused, nothing recorded."""
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1)
  with pytest.raises(dp.errors.PrivacyConfigError, match="makes a record of one client"):
    opt.set_sampling(100, 0.1, policy, 10)
  assert opt.private_step.sampling is None
