"""The policy x scenario matrix (issue 26): real Keras runs with noise 0, joins vs the claim.

Shared by tests/privacy/test_policy_matrix.py and benchmarks/policy_matrix.py.

Neighbouring relation and unit: each policy's own (`tf_dpiter.ledger.policies`): add or remove
one example (Poisson, full, cyclic Poisson, truncated Poisson, balls in bins), replace one
example (fixed size, shuffle), add or remove one user (user-level Poisson).

Model: x = the one-hot code of the example (n = N), a Dense(1) without bias from zeros and
the loss w . x, so example i's gradient is e_i (norm 1 = the clip) and, with noise 0, a step
moves w[i] exactly when example i is in it (`privacy_joins.JoinRecorder`). A run records the
set of examples of every step ever taken (crashed runs' steps included) and the final ledger.

The ledger's claim, per unit, is read from the policy object of its rows: at most
`policy.participation_bound(group, passes)` participations (summed over the ledger's groups)
and consecutive participations at least `policy.min_gap(group)` steps apart; a run whose
units exceed it is a defect (or must be refused before its first step).
"""

import contextlib
import math
import os
import re
import warnings

import keras
import numpy as np
import tensorflow as tf

from tf_dpiter.data import python_source
import tf_dpiter as dp
import tf_dpiter.keras  # noqa: F401  (registers the DP classes for load_model)
from tf_dpiter.accounting import accountant
from tf_dpiter.accounting import ledger_events
from tf_dpiter.data import balls_in_bins
from tf_dpiter.data import cyclic_poisson
from tf_dpiter.data import truncated_poisson
from tf_dpiter.data import user_sampling
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import policies

from tests.privacy import privacy_joins

N = 24                 # examples
BATCH = 5              # (expected) batch size: passes of 5 steps, the last of 4
GROUPS = 3             # cyclic Poisson: b
STEPS = 3              # steps per fit in the scenarios with steps_per_epoch
USERS_K = 2            # user level: examples per user (N / 2 users)
CAP = 4                # truncated Poisson: B
SCENARIOS = ("one_fit", "fits_steps", "new_dataset", "crash_resume", "save_load",
             "checkpoint_rollback", "retry", "iterations_rollback", "xla_compiled_draw",
             "journal_resume", "steps_per_execution")
# run in a process of its own with 2 logical CPUs (tests/privacy/matrix_mirrored_worker.py)
MIRRORED = "mirrored"


class _Crash(keras.callbacks.Callback):
  """Raises after the optimizer's `at`-th step (a crash mid-epoch)."""

  def __init__(self, at):
    super().__init__()
    self.at = at

  def on_train_batch_end(self, batch, logs=None):
    if int(self.model.optimizer.iterations.numpy()) >= self.at:
      raise RuntimeError("crash")


def _arrays(rng=None):
  """(x, y) of the N examples, in a random row order when rng is given (a new dataset of
  the same examples: example i is still the one-hot code e_i)."""
  x = np.eye(N, dtype=np.float32)
  if rng is not None:
    x = x[rng.permutation(N)]
  return x, np.zeros((N, 1), np.float32)


def _user_of(x):
  """User ids of rows x: example i belongs to user i // USERS_K (by content, not by row)."""
  return np.argmax(x, axis=1) // USERS_K


def _declared(n, m, fixed):
  """A dataset the test samples itself (fixed-size samples of m, or the full batch) as a
  generator: the optimizer's `set_sampling` declares it (done by `Case.prepare`)."""

  def build(x, y, steps):
    rng = np.random.default_rng()

    def gen():
      for _ in range(steps):
        idx = np.sort(rng.choice(n, m, replace=False)) if fixed else np.arange(n)
        yield x[idx], y[idx]

    sig = (tf.TensorSpec((m, N), tf.float32), tf.TensorSpec((m, 1), tf.float32))
    ds = python_source.python_dataset(gen, sig)
    return ds.apply(tf.data.experimental.assert_cardinality(steps))

  return build


class Case:
  """How one policy feeds fit: `fit_args(rng, steps)` gives fit's data arguments (arrays or
  a sampled dataset of `steps` steps per iteration, or of its own pass length when None)."""

  def __init__(self, policy):
    self.policy = policy

  def prepare(self, model):
    """Declares a sampling the data does not carry (fixed size, full batch)."""
    if self.policy == "fixed_size":
      model.optimizer.set_sampling(N, BATCH / N, "fixed_size", BATCH)
    elif self.policy == "full":
      model.optimizer.set_sampling(N, 1.0, "full", N)

  def fit_args(self, rng, steps=None):
    x, y = _arrays(rng)
    p, per = self.policy, steps or N // BATCH
    if p in ("poisson", "shuffle"):
      return dict(x=x, y=y, batch_size=BATCH, sampling=p)
    if p == "fixed_size":
      return dict(x=_declared(N, BATCH, True)(x, y, per))
    if p == "full":
      return dict(x=_declared(N, N, False)(x, y, per))
    if p == "cyclic_poisson":
      return dict(x=cyclic_poisson.cyclic_poisson_batches(
          x, y, expected_batch_size=BATCH, num_groups=GROUPS, steps_per_epoch=per))
    if p == "truncated_poisson":
      return dict(x=truncated_poisson.truncated_poisson_batches(
          x, y, expected_batch_size=BATCH, max_batch_size=CAP, steps_per_epoch=per))
    if p == "balls_in_bins":
      return dict(x=balls_in_bins.balls_in_bins_batches(x, y, steps_per_epoch=N // BATCH))
    if p == "user_poisson":
      return dict(x=user_sampling.poisson_user_batches(
          x, y, _user_of(x), BATCH / USERS_K, USERS_K, steps_per_epoch=per))
    raise ValueError(f"no matrix case for policy {p!r}: add one to matrix_runs.Case")

  def unit(self, example):
    """The unit of privacy of an example (its user under user-level sampling)."""
    return example // USERS_K if self.policy == "user_poisson" else example


@keras.saving.register_keras_serializable(package="tf_dpiter_tests", name="first_output")
def first_output(y_true, y_pred):  # pylint: disable=unused-argument
  """The loss w . x: example i's gradient is e_i."""
  return y_pred[:, 0]


def model(policy=None, strategy=None, normalize=True, **compile_kwargs):
  """The one-hot probe model with a noise-0 DP-SGD optimizer (clip 1, learning rate 1); under
  cyclic Poisson the noise is BandMF with b bands (the mechanism cyclic sampling is for).
  Built in `strategy`'s scope when given. `normalize=False`: a participation moves w[i] by
  exactly 1 (for counting under steps_per_execution). `compile_kwargs` go to compile
  (jit_compile, steps_per_execution); with jit_compile the noise is drawn inside the XLA
  program, as on an accelerator."""
  keras.utils.set_random_seed(0)
  scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
  with scope, warnings.catch_warnings():
    warnings.simplefilter("ignore")   # noise 0: not private, on purpose
    net = dp.keras.DPSequential([keras.Input((N,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros")])
    extra = (dict(noise="band_mf", num_bands=GROUPS, num_steps=64)
             if policy == "cyclic_poisson" else {})
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 0.0, learning_rate=1.0, normalize=normalize,
                                       **extra)
    if compile_kwargs.get("jit_compile"):
      opt.private_step.set_flags(compiled_noise=True)
    net.compile(optimizer=opt, loss=first_output, **compile_kwargs)
  return net


class Refused(Exception):
  """A fit of the scenario was refused (`PrivacyConfigError`); `steps` it took (must be 0)."""

  def __init__(self, error, steps):
    super().__init__(str(error))
    self.error, self.steps = error, steps


def _fit(net, case, args, joined, **kwargs):
  case.prepare(net)
  # under steps_per_execution, participations are counted: one moves w[i] by 1 (a user's
  # record by 1 / k per example: the mean loss over its k rows)
  unit = 1.0 / USERS_K if case.policy == "user_poisson" else 1.0
  counts = unit if getattr(net, "steps_per_execution", 1) > 1 else None
  cbs = [privacy_joins.JoinRecorder(joined, counts=counts)] + kwargs.pop("callbacks", [])
  before = len(joined)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      net.fit(**args, verbose=0, callbacks=cbs, **kwargs)
    except PrivacyConfigError as e:
      raise Refused(e, len(joined) - before) from e


def run(policy, scenario, workdir, strategy=None):
  """Runs one cell of the matrix (scenario MIRRORED: with `strategy`).

  Returns:
    (final model, joins of every step ever taken, None), or (model, joins, Refused) when a
    fit of the scenario was refused (the scenario stops there).
  """
  case, rng, joined = Case(policy), np.random.default_rng(0), []
  net = model(policy, strategy=strategy, **_COMPILE.get(scenario, {}))
  try:
    net = _scenario(net, case, scenario, workdir, rng, joined)
  except Refused as refused:
    return net, joined, refused
  return net, joined, None


def _scenario(net, case, scenario, workdir, rng, joined):
  policy = case.policy
  per_epoch = None if policy == "balls_in_bins" else STEPS
  if scenario == "one_fit":
    _fit(net, case, case.fit_args(None), joined, epochs=3)
  elif scenario == "fits_steps":
    args = case.fit_args(None, 16)
    for _ in range(4):
      _fit(net, case, args, joined, epochs=1, steps_per_epoch=STEPS)
  elif scenario == "new_dataset":
    for _ in range(4):
      _fit(net, case, case.fit_args(rng, 16), joined, epochs=1, steps_per_epoch=STEPS)
  elif scenario in ("crash_resume", "retry"):   # a new model after the crash, or the same one
    backup = os.path.join(workdir, "backup")
    try:
      _fit(net, case, case.fit_args(None, per_epoch), joined, epochs=3, callbacks=[
          keras.callbacks.BackupAndRestore(backup, save_freq=2), _Crash(_epoch_steps(policy) + 2)])
    except RuntimeError:
      pass
    if scenario == "crash_resume":
      net = model(policy)
    _fit(net, case, case.fit_args(rng, per_epoch), joined, epochs=3,
         callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=2)])
  elif scenario == "save_load":
    _fit(net, case, case.fit_args(None, per_epoch), joined, epochs=1)
    path = os.path.join(workdir, "m.keras")
    net.save(path)
    # a correlated (BandMF) run's noise state is in no model file (it is the noise): it
    # resumes through its private noise-state file (test_keras_noise_resume: refused without)
    correlated = net.optimizer.private_step.mechanism.correlated
    if correlated:
      net.optimizer.private_step.save_noise_state(os.path.join(workdir, "noise.npz"))
    net = keras.models.load_model(path)
    if correlated:
      net.optimizer.private_step.restore_noise_state(os.path.join(workdir, "noise.npz"))
    _fit(net, case, case.fit_args(rng, per_epoch), joined, epochs=2)
  elif scenario in ("checkpoint_rollback", "iterations_rollback"):
    _rollback(net, case, scenario, workdir, joined)
  elif scenario == "journal_resume":   # a crash after a save; load_model resumes the journal
    journal, path = os.path.join(workdir, "run.journal"), os.path.join(workdir, "m.keras")
    _fit(net, case, case.fit_args(None, per_epoch), joined, epochs=1, ledger_journal=journal)
    net.save(path)
    try:
      _fit(net, case, case.fit_args(None, per_epoch), joined, epochs=2, ledger_journal=journal,
           callbacks=[_Crash(_epoch_steps(policy) + 2)])
    except RuntimeError:
      pass
    net = keras.models.load_model(path)
    _fit(net, case, case.fit_args(rng, per_epoch), joined, epochs=2, ledger_journal=journal)
  elif scenario in _COMPILE:   # fits of STEPS + 1 steps (MIRRORED: in its strategy)
    args = case.fit_args(None, 16)
    for _ in range(3):
      _fit(net, case, args, joined, epochs=1, steps_per_epoch=STEPS + 1)
  else:
    raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")
  return net


# steps_per_execution 2: one batch callback per 2 steps, so joins are counted, not placed
# (normalize=False: a participation moves w[i] by 1; JoinRecorder(counts=True)).
_COMPILE = {"xla_compiled_draw": {"jit_compile": True}, MIRRORED: {},
            "steps_per_execution": {"steps_per_execution": 2, "normalize": False}}


def _rollback(net, case, scenario, workdir, joined):
  """Trains, goes back in one process (a tf.train.Checkpoint restore of an earlier step, or
  the weights and iterations assigned back), and trains on from there."""
  args = case.fit_args(None, 16)
  _fit(net, case, args, joined, epochs=1, steps_per_epoch=STEPS)
  ckpt = tf.train.Checkpoint(model=net, optimizer=net.optimizer)
  saved = ckpt.save(os.path.join(workdir, "ck"))
  weights, iterations = net.get_weights(), int(net.optimizer.iterations.numpy())
  _fit(net, case, args, joined, epochs=1, steps_per_epoch=STEPS)
  if scenario == "checkpoint_rollback":
    ckpt.restore(saved)
  else:
    net.set_weights(weights)
    net.optimizer.iterations.assign(iterations)
  _fit(net, case, args, joined, epochs=2, steps_per_epoch=STEPS)


def _epoch_steps(policy):
  return N // BATCH if policy in ("balls_in_bins", "poisson", "shuffle") else STEPS


def claim(ledger):
  """(most participations, least gap) of one unit that the ledger's rows claim."""
  runs, passes = accountant.ledger_runs(ledger)
  groups = [g for g in ledger_events.groups_from_runs(runs) if g.count]
  most = sum(policies.get(g.policy).participation_bound(g, passes) for g in groups)
  gap = min(policies.get(g.policy).min_gap(g) for g in groups)
  return most, gap


def measured(case, joined):
  """(most participations of a unit, least gap between two of its steps, largest batch of
  examples, most examples of one unit in one step) over the recorded steps."""
  steps_of = {}
  per_step = 0
  for t, step in enumerate(joined):
    counts = {}
    for i in step:
      counts[case.unit(i)] = counts.get(case.unit(i), 0) + 1
    for u in counts:
      steps_of.setdefault(u, []).append(t)
    per_step = max([per_step] + list(counts.values()))
  most = max((len(s) for s in steps_of.values()), default=0)
  gap = min((int(np.diff(s).min()) for s in steps_of.values() if len(s) > 1), default=math.inf)
  return most, gap, max((len(s) for s in joined), default=0), per_step


def cyclic_groups():
  """{example: its cyclic Poisson group}, from the hash of its record (as the sampler does)."""
  x, y = _arrays()
  ids = cyclic_poisson.record_identities(x, y)
  return {i: cyclic_poisson.identity_digest(ids[i]) % GROUPS for i in range(N)}


# cells refused on purpose: a BackupAndRestore of a BandMF run rolls the optimizer back below
# the ledger's rows (the rerun rows would break the b-separation), refused before any step
ROLLBACK = r"rerun rows of the same matrix mechanism"
REFUSED = {("cyclic_poisson", s): ROLLBACK for s in ("crash_resume", "checkpoint_rollback",
                                                       "retry", "iterations_rollback",
                                                       "journal_resume")}


def _check_premise(policy, joined, samples):
  sizes = [len(s) for s in joined]
  if policy == "fixed_size":
    assert set(sizes) == {BATCH}
  elif policy == "full":
    assert set(sizes) == {N}
  elif policy == "truncated_poisson":
    assert max(sizes) <= CAP == samples[0, 2]
  elif policy == "cyclic_poisson":
    # step t of the ledger's cyclic stream samples group t mod b, in every fit
    group = cyclic_groups()
    assert all(group[i] == t % GROUPS for t, s in enumerate(joined) for i in s)
  if policies.get(policy).expected_size_denominator:
    assert len({(row[0], row[1]) for row in samples}) == 1   # one stated (N, q) per run


def check_cell(policy, scenario, net, joined, refused):
  """The cell's assertions: refused before its first step where REFUSED says so; else every
  step ever taken charged, each unit's participations within the ledger's claim and (when
  steps are read one by one: not under steps_per_execution) at least min_gap apart, and
  the policy's premise (batch sizes, the cycle, one stated q).

  Raises:
    AssertionError: the cell breaks the claim.
  """
  if (policy, scenario) in REFUSED:
    assert refused is not None, "expected a refusal before the first step"
    assert refused.steps == 0
    assert re.search(REFUSED[(policy, scenario)], str(refused))
    return
  assert refused is None, str(refused)
  samples, _ = net.ledger.get_arrays()
  iterations = int(net.optimizer.iterations.numpy())
  most, gap = claim(net.ledger)
  got_most, got_gap, _, per_unit = measured(Case(policy), joined)
  assert 0 < got_most <= most, (got_most, most)
  if scenario == "steps_per_execution":   # joins counted per execution, not placed
    assert samples.shape[0] == iterations > 0
    return
  assert samples.shape[0] == len(joined) >= iterations > 0   # every step ever taken charged
  assert got_gap >= gap, (got_gap, gap)
  assert per_unit <= (USERS_K if policy == "user_poisson" else 1)
  _check_premise(policy, joined, samples)
