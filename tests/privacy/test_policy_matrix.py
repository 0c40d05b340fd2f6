"""Every sampling policy x {one fit, several fits with steps_per_epoch, a new dataset, a crash
and BackupAndRestore, save/load, an in-process rollback (tf.train.Checkpoint restore of an
earlier step; weights and iterations assigned back), an in-process retry with
BackupAndRestore on the same model, jit_compile with the noise drawn inside the XLA
program, a journal resumed by a model loaded from a save taken before a crash}:
participations never exceed the ledger's claim. (Not here, since this probe reads each step's
examples back through batch callbacks and noise 0: steps_per_execution > 1 is checked in
tests/keras/test_noise_and_ledger.py, MirroredStrategy in tests/keras/test_mirrored_poisson.py,
StopAtPrivacyBudget in tests/keras/test_budget_fit_steps.py, noise on across rollbacks in
tests/privacy/test_rollback_noise.py.)

The real Keras pipeline and training step with noise 0 (`matrix_runs`): the weights read back
after every step show which examples it used. Per cell: every step ever taken (a crashed
run's included) is a ledger sample; each unit's participations are at most what the policy
object says its rows charge (`participation_bound`) and at least `min_gap` steps apart; the
premise of the policy's event holds (fixed size and full batch: the declared size; truncated
Poisson: at most B; user level: at most k examples of a user per step; Poisson-type rows: one
q for the run). A cell may instead be refused before its first step (PrivacyConfigError),
which must leave the step count unchanged. The declared relation and unit are each policy's
own (add/remove or replace one example; add/remove one user for user-level sampling).
"""

import re

import pytest

from tf_dpiter.ledger import policies

from tests.privacy import matrix_runs  # noqa: E402

# The default suite runs the cells of the policies whose schedule is ledger state (passes,
# epochs, the cycle) across fits, cyclic Poisson's new-dataset and reload cells, shuffle's
# restart cell and Poisson across fits; `-m slow` runs the whole matrix (41 cells).
_DEFAULT_CELLS = {("shuffle", "fits_steps"), ("cyclic_poisson", "fits_steps"),
                  ("balls_in_bins", "fits_steps"), ("poisson", "fits_steps"),
                  ("cyclic_poisson", "new_dataset"), ("cyclic_poisson", "save_load"),
                  ("shuffle", "crash_resume"), ("poisson", "checkpoint_rollback"),
                  ("shuffle", "checkpoint_rollback"), ("balls_in_bins", "retry"),
                  ("truncated_poisson", "iterations_rollback"),
                  ("poisson", "xla_compiled_draw"), ("shuffle", "journal_resume")}
# cells refused on purpose: a BackupAndRestore of a BandMF run rolls the optimizer back below
# the ledger's rows (the rerun rows would break the b-separation), refused before any step
_ROLLBACK = r"rerun rows of the same matrix mechanism"
_REFUSED = {("cyclic_poisson", s): _ROLLBACK for s in ("crash_resume", "checkpoint_rollback",
                                                       "retry", "iterations_rollback",
                                                       "journal_resume")}


def _cells():
  for policy in policies.names():
    for scenario in matrix_runs.SCENARIOS:
      fast = (policy, scenario) in _DEFAULT_CELLS
      yield pytest.param(policy, scenario, id=f"{policy}-{scenario}",
                         marks=() if fast else pytest.mark.slow)


def _check_premise(policy, joined, samples):
  sizes = [len(s) for s in joined]
  if policy == "fixed_size":
    assert set(sizes) == {matrix_runs.BATCH}
  elif policy == "full":
    assert set(sizes) == {matrix_runs.N}
  elif policy == "truncated_poisson":
    assert max(sizes) <= matrix_runs.CAP == samples[0, 2]
  elif policy == "cyclic_poisson":
    # step t of the ledger's cyclic stream samples group t mod b, in every fit
    group = matrix_runs.cyclic_groups()
    assert all(group[i] == t % matrix_runs.GROUPS for t, s in enumerate(joined) for i in s)
  if policies.get(policy).expected_size_denominator:
    assert len({(row[0], row[1]) for row in samples}) == 1   # one stated (N, q) per run


@pytest.mark.parametrize("policy,scenario", list(_cells()))
def test_participations_never_exceed_the_ledgers_claim(policy, scenario, tmp_path):
  net, joined, refused = matrix_runs.run(policy, scenario, str(tmp_path))
  if (policy, scenario) in _REFUSED:
    assert refused is not None, "expected a refusal before the first step"
    assert refused.steps == 0
    assert re.search(_REFUSED[(policy, scenario)], str(refused))
    return
  assert refused is None, str(refused)
  samples, _ = net.ledger.get_arrays()
  iterations = int(net.optimizer.iterations.numpy())
  assert samples.shape[0] == len(joined) >= iterations > 0   # every step ever taken charged
  most, gap = matrix_runs.claim(net.ledger)
  got_most, got_gap, _, per_unit = matrix_runs.measured(matrix_runs.Case(policy), joined)
  assert 0 < got_most <= most, (got_most, most)
  assert got_gap >= gap, (got_gap, gap)
  assert per_unit <= (matrix_runs.USERS_K if policy == "user_poisson" else 1)
  _check_premise(policy, joined, samples)


def test_the_matrix_covers_every_registered_policy():
  for policy in policies.names():
    matrix_runs.Case(policy).fit_args(None)   # raises for a policy without a matrix case
