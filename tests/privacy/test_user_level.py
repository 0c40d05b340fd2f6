"""User-level DP in fit (issue 14; McMahan et al. 2018, Table 1: a record is all of one user's data).

Relation: add or remove one user with all of their examples; the ledger records n = number
of users and sensitivity C per user record. The real train step (fit, noise 0, learning rate
1, no normalization: the weights move by minus the clipped sum) is run on a batch of users and
on its neighbours with one whole user removed, and compared with a per-user loop."""

import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data import sampling as sampling_lib
from tf_dpiter.data import user_sampling
from tf_dpiter.errors import PrivacyConfigError

CLIP, K = 0.3, 3
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _users(seed=0, num_users=10):
  """Examples of users with 1 to 5 examples each (more than K for some: truncated to K)."""
  rng = np.random.RandomState(seed)
  counts = rng.randint(1, 6, num_users)
  uid = np.repeat(np.arange(100, 100 + num_users), counts)
  rng.shuffle(uid)
  x = rng.randn(len(uid), 4).astype("float32") * 2
  return x, (x[:, 0] > 0).astype("int32"), uid


def _model(clipping):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                                 keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(
      CLIP, 0.0, learning_rate=1.0, normalize=False, clipping=clipping), loss=LOSS)
  return model


def _one_batch(batch, num_users):
  ds = tf.data.Dataset.from_tensors(batch)
  return sampling_lib.attach_spec(ds, sampling_lib.SamplingSpec(
      "user_poisson", num_users, 0.3, 0.3 * num_users, user_sampling.UserGrouping(K, num_users)))


def _fit_sum(model, batch, num_users):
  w0 = [v.numpy() for v in model.trainable_variables]
  model.fit(_one_batch(batch, num_users), epochs=1, verbose=0)
  out = np.concatenate([(a - v.numpy()).ravel() for a, v in zip(w0, model.trainable_variables)])
  for v, a in zip(model.trainable_variables, w0):
    v.assign(a)
  return out.astype(np.float64)


def _per_user_reference(model, batch):
  xb, yb, wb = batch
  total = 0.0
  for j in range(len(wb) // K):
    rows = slice(j * K, (j + 1) * K)
    if wb[rows].sum() == 0:
      continue
    keep = wb[rows] > 0
    with tf.GradientTape() as tape:
      loss = model.compute_loss(y=yb[rows][keep], y_pred=model(xb[rows][keep], training=True))
    g = np.concatenate([np.asarray(t).ravel() for t in tape.gradient(
        loss, model.trainable_variables)]).astype(np.float64)
    total = total + g * min(1.0, CLIP / np.linalg.norm(g))
  return total


def test_poisson_user_batches_layout_and_ledger():
  x, y, uid = _users()
  ds = user_sampling.poisson_user_batches(x, y, uid, expected_users_per_batch=4,
                                          max_examples_per_user=K, steps_per_epoch=3, seed=1)
  spec = sampling_lib.get_sampling_spec(ds)
  assert (spec.policy, spec.population_size, spec.selection_probability) == (
      "user_poisson", 10, 0.4)
  for xb, yb, wb in ds.take(3):
    xb, wb = xb.numpy(), wb.numpy()
    assert len(wb) % K == 0
    for j in range(len(wb) // K):   # each user's rows are consecutive and belong to one user
      rows = xb[j * K:(j + 1) * K][wb[j * K:(j + 1) * K] > 0]
      owners = {int(uid[np.flatnonzero((x == r).all(1))[0]]) for r in rows}
      assert len(owners) <= 1
  model = _model("auto")
  model.fit(ds, epochs=1, verbose=0)
  ledger = model.ledger.to_dict()["runs"][-1]
  assert ledger["population_size"] == 10 and ledger["examples_per_record"] == 1
  assert ledger["policy"] == "user_poisson"
  assert int(model.ledger.sample_count) == 3


def test_user_level_statement_names_the_user_and_epsilon_matches_dp_accounting():
  """The ledger's claim is add/remove one user; epsilon = dp-accounting by hand (Poisson over
  users, q = 4/10, z = 1.3, 3 steps)."""
  x, y, uid = _users()
  ds = user_sampling.poisson_user_batches(x, y, uid, expected_users_per_batch=4,
                                          max_examples_per_user=K, steps_per_epoch=3, seed=1)
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(CLIP, 1.3, learning_rate=0.1), loss=LOSS)
  model.fit(ds, epochs=1, verbose=0)
  report = dp.accounting.privacy_report(model.ledger, delta=1e-5)
  assert report.assumptions[0].startswith("neighbouring relation: add or remove one user")
  accountant = dpa.rdp.RdpAccountant()
  accountant.compose(dpa.PoissonSampledDpEvent(0.4, dpa.GaussianDpEvent(1.3)), 3)
  assert report.epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-6)


@pytest.mark.parametrize("clipping", ["auto", pytest.param("vectorized", marks=pytest.mark.slow)])
def test_removing_one_user_moves_the_sum_by_at_most_c(clipping):
  x, y, uid = _users(seed=2, num_users=6)
  users, rows = np.unique(uid), []
  for u in users:
    r = np.flatnonzero(uid == u)[:K]
    rows.append(np.r_[r, -np.ones(K - len(r), int)])
  idx = np.concatenate(rows)
  w = (idx >= 0).astype("float32")
  idx = np.where(idx >= 0, idx, 0)
  # an adversarial user: K copies of a far-away example
  xa = np.concatenate([x[idx], np.full((K, 4), 50.0, "float32")])
  ya, wa = np.concatenate([y[idx], np.ones(K, "int32")]), np.concatenate([w, np.ones(K, "float32")])
  model = _model(clipping)
  base = _fit_sum(model, (xa, ya, wa), len(users) + 1)
  np.testing.assert_allclose(base, _per_user_reference(model, (xa, ya, wa)), rtol=2e-4, atol=2e-6)
  changes = []
  for j in range(len(users) + 1):
    w2 = wa.copy()
    w2[j * K:(j + 1) * K] = 0.0
    changes.append(np.linalg.norm(_fit_sum(model, (xa, ya, w2), len(users) + 1) - base))
  recorded = max(q["sensitivity"] for q in model.ledger.to_dict()["runs"][-1]["queries"])
  assert recorded == pytest.approx(CLIP)
  assert max(changes) <= recorded * (1 + 1e-4), changes
  assert max(changes) > 0.9 * recorded   # the adversarial user reaches the clip


def test_user_batches_refuse_microbatches():
  x, y, uid = _users()
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, 2), loss=LOSS)
  ds = user_sampling.poisson_user_batches(x, y, uid, 4, K, seed=1)
  with pytest.raises(ValueError, match="num_microbatches=2.*user"):
    model.fit(ds, epochs=1, verbose=0)


def test_user_level_policy_without_the_user_grouping_is_refused():
  """policy "user_poisson" states S per user; only dp.data.poisson_user_batches' grouping
  makes a record one user's rows. Declared by hand (set_sampling, then train_on_batch or a
  custom loop) or on data whose spec names the policy without a UserGrouping, the step would
  clip each example: one user of k rows would move the clipped sum by k S (review R: 4 S at
  k = 4). Both are refused before a step."""
  model = _model("auto")
  with pytest.raises(PrivacyConfigError, match="poisson_user_batches") as err:
    model.optimizer.set_sampling(100, 0.02, "user_poisson", 2)
  assert "Received: policy='user_poisson'" in str(err.value)
  x, y, _ = _users()
  ds = sampling_lib.attach_spec(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(4),
      sampling_lib.SamplingSpec("user_poisson", 10, 0.4, 4.0))
  with pytest.raises(PrivacyConfigError, match="no user grouping"):
    _model("auto").fit(ds, epochs=1, verbose=0)
