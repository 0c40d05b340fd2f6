"""Optimizer classes, wrapping, serialization, make_private, callbacks, fast-clipping hook."""

import functools
import json
import os

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import accounting
from tf_dpiter import dp_query
from tf_dpiter import ledger as ledger_lib
from tf_dpiter.keras.model import models
from tf_dpiter.ledger import ledger_file
from tests.keras import dp_keras_helpers as helpers

# Nightly tier (-m slow): a second budget stop and the microbatch/physical grid
# beyond one case; covered by default by test_stop_at_privacy_budget[1] and [True-3-4].
SLOW_CASES = {
    "test_stop_at_privacy_budget[2]",
    "test_fast_clipping_matches_reference_with_microbatches_and_physical_batches[True-4-None]",
    "test_fast_clipping_matches_reference_with_microbatches_and_physical_batches[True-3-None]",
    "test_fast_clipping_matches_reference_with_microbatches_and_physical_batches[True-2-5]"}

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


_data = helpers.small_data
_seq = helpers.small_seq


_CLASSES = [("SGD", keras.optimizers.SGD), ("Adam", keras.optimizers.Adam),
            ("Adagrad", keras.optimizers.Adagrad), ("RMSprop", keras.optimizers.RMSprop),
            ("AdamW", keras.optimizers.AdamW)]


def _ready_made(name):
  return getattr(dp.keras, f"DPKeras{name}Optimizer")(
      l2_norm_clip=1.5, noise_multiplier=0.7, num_microbatches=None, learning_rate=0.01)


@pytest.mark.parametrize("name,base", _CLASSES)
def test_ready_made_classes_round_trip_config(name, base):
  cls = getattr(dp.keras, f"DPKeras{name}Optimizer")
  assert issubclass(cls, base)
  cfg = _ready_made(name).get_config()
  again = cls.from_config(cfg)
  assert (again.l2_norm_clip, again.noise_multiplier, again.num_microbatches) == (1.5, 0.7, None)
  assert float(again.learning_rate.numpy()) == pytest.approx(0.01)


# The DP SGD's and DP Adam's fits are every other test's here (Adam: a fit of 4 steps, saved
# and loaded, in test_model_save_load_keeps_dp_settings), and the DP AdamW's (the same class,
# DPKerasAdamWOptimizer, that make_private makes of a compiled AdamW) is
# test_make_private_compiled.py's test_compiled_plain_model_gets_the_dp_copy_...: a fit whose
# ledger counts its steps (session 45): with -m slow. So are the DP RMSprop's and DP Adagrad's
# (session 47): test_privacy_meter_and_ledger_export fits the DP RMSprop (its ledger: 20
# samples) and test_stop_at_privacy_budget[1] the DP Adagrad (12 steps counted).
@pytest.mark.parametrize("name", [pytest.param("SGD", marks=pytest.mark.slow),
                                  pytest.param("Adam", marks=pytest.mark.slow),
                                  pytest.param("Adagrad", marks=pytest.mark.slow),
                                  pytest.param("RMSprop", marks=pytest.mark.slow),
                                  pytest.param("AdamW", marks=pytest.mark.slow)])
def test_ready_made_classes_train(name):
  x, y = _data()
  model = _seq()
  model.compile(optimizer=_ready_made(name), loss=LOSS)
  model.fit(x, y, batch_size=32, epochs=1, verbose=0)
  assert int(model.ledger.sample_count.numpy()) == 2


def test_make_dp_optimizer_class_on_user_class():
  class MySGD(keras.optimizers.SGD):
    pass
  cls = dp.keras.make_dp_optimizer_class(MySGD)
  assert issubclass(cls, MySGD) and cls.__name__ == "DPMySGD"
  assert dp.keras.make_dp_optimizer_class(MySGD) is cls
  with pytest.raises(ValueError, match="cls"):
    dp.keras.make_dp_optimizer_class(int)


def test_model_save_load_keeps_dp_settings(tmp_path):
  x, y = _data()
  model = _seq()
  model.compile(optimizer=dp.keras.DPKerasAdamOptimizer(1.2, 0.9, 4, learning_rate=1e-3,
                                                        max_physical_batch_size=16),
                loss=LOSS, metrics=["accuracy"])
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  path = os.path.join(tmp_path, "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert isinstance(loaded, dp.keras.DPSequential)
  opt = loaded.optimizer
  assert isinstance(opt, dp.keras.DPKerasAdamOptimizer)
  assert (opt.l2_norm_clip, opt.noise_multiplier, opt.num_microbatches,
          opt.max_physical_batch_size) == (1.2, 0.9, 4, 16)
  # the models' own eager calls (no predict function traced per model)
  np.testing.assert_allclose(loaded(x, training=False), model(x, training=False), rtol=1e-5)
  loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
  # the ledger travels with the model (optimizer config): 4 steps before the save + 4 after
  assert int(loaded.ledger.sample_count.numpy()) == 8


@keras.saving.register_keras_serializable(package="tf_dpiter_tests")
class SubclassedMLP(keras.Model):
  """A registered subclassed model (as Keras needs for load_model), 6 -> units -> 3."""

  def __init__(self, units=4, **kw):
    super().__init__(**kw)
    self.units = units
    self.d1 = keras.layers.Dense(units, activation="relu")
    self.d2 = keras.layers.Dense(3)

  def call(self, x):
    return self.d2(self.d1(x))

  def get_config(self):
    return dict(super().get_config(), units=self.units)


def test_make_private_subclassed_unbuilt_fits_saves_and_loads_as_in_a_new_process(
    tmp_path, monkeypatch):
  """A new process knows neither the DP class of SubclassedMLP nor its Keras registration
  until `private_class(SubclassedMLP)` runs: both are removed here (for this test only), so
  the load first fails, then works after `private_class` made a fresh class, exactly the
  state of a new process (in-process: no second TensorFlow import)."""
  x, y = _data(32, seed=5)
  keras.utils.set_random_seed(0)
  model = dp.keras.make_private(SubclassedMLP(units=5))   # never called: fit builds it
  saved_cls = dp.keras.private_class(SubclassedMLP)
  assert type(model) is saved_cls
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(0.7, 1.1, learning_rate=0.1), loss=LOSS)
  model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  assert int(model.ledger.sample_count.numpy()) == 4
  path = os.path.join(tmp_path, "sub.keras")
  model.save(path)
  want = model(x, training=False).numpy()   # eager: no predict function traced
  # the process-wide state a new process lacks: the class cache and the Keras registration
  monkeypatch.delitem(keras.saving.get_custom_objects(),
                      keras.saving.get_registered_name(saved_cls))
  monkeypatch.delitem(models._PRIVATE_CLASSES, SubclassedMLP)  # pylint: disable=protected-access
  with pytest.raises(TypeError, match="DPSubclassedMLP|SubclassedMLP"):
    keras.models.load_model(path)
  new_cls = dp.keras.private_class(SubclassedMLP)   # registers DPSubclassedMLP before loading
  assert new_cls is not saved_cls
  m = keras.models.load_model(path)
  assert type(m) is new_cls and type(m).__name__ == "DPSubclassedMLP"
  assert isinstance(m, dp.keras.DPModelMixin) and isinstance(m, SubclassedMLP) and m.units == 5
  o = m.optimizer
  assert (type(o).__name__, o.l2_norm_clip, o.noise_multiplier) == ("DPKerasSGDOptimizer", 0.7,
                                                                     1.1)
  np.testing.assert_allclose(m(x, training=False), want, rtol=1e-5)
  m.fit(x, np.zeros(len(x), "int32"), batch_size=8, epochs=1, verbose=0)
  assert int(m.ledger.sample_count.numpy()) == 2 * (len(x) // 8)   # the saved steps + the new
  with pytest.raises(ValueError, match="cls must be a keras.Model subclass"):
    dp.keras.private_class(int)


def test_dp_optimizer_wrapper_with_nested_query():
  """The wrapper's class, learning rate and config; its fit (2 steps, 4 query events in the
  ledger, which travels through save and load) is test_query_serialization.py's
  nested_wrapper case."""
  x, _ = _data()
  model = _seq()
  model(x)
  queries = [dp_query.GaussianSumQuery(0.5, 0.0, seed=1) for _ in model.trainable_variables]
  opt = dp.keras.DPOptimizer(keras.optimizers.RMSprop(1e-3), dp_query=dp_query.NestedQuery(queries))
  assert isinstance(opt, keras.optimizers.RMSprop)
  assert float(opt.learning_rate.numpy()) == pytest.approx(1e-3)
  model.compile(optimizer=opt, loss=LOSS)
  opt.set_sampling(64, 32 / 64, "poisson", 32)   # as fit(x, y, batch_size=32) declares it
  cfg = opt.get_config()  # a custom dp_query serializes (tests/keras/test_query_serialization.py)
  assert cfg["dp_query"] == dp_query.serialize(opt.dp_query.query)
  again = type(opt).from_config(cfg)
  assert again.get_config() == cfg
  with pytest.raises(ValueError, match="not both"):
    dp.keras.DPOptimizer(keras.optimizers.SGD(), l2_norm_clip=1.0, noise_multiplier=1.0,
                         dp_query=dp_query.NestedQuery(queries))


class _Sub(keras.Model):
  def __init__(self, **kw):
    super().__init__(**kw)
    self.d1 = keras.layers.Dense(4, activation="relu")
    self.d2 = keras.layers.Dense(3)

  def call(self, x):
    return self.d2(self.d1(x))


def test_make_private_subclassed_exact():
  """A subclassed model made private steps exactly; a functional one is the step oracle's
  multi_input model (test_step_oracle.py, e.g. its vectorized train_on_batch row)."""
  x, y = _data(8, seed=3)
  keras.utils.set_random_seed(0)
  model = dp.keras.make_private(_Sub())
  assert isinstance(model, dp.keras.DPModelMixin)
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(0.05, 0.0, learning_rate=1.0,
                                                       clipping="vectorized"), loss=LOSS)
  model(x)
  helpers.assert_step_matches_reference(model, LOSS, x, y, 0.05, 8)


def test_auto_clipping_uses_fast_clipping_when_supported():
  """"auto" resolves to "fast" where supported; the fast step's exactness is the step
  oracle's (test_step_oracle.py, clipping=fast rows)."""
  from tf_dpiter.keras import fast_clipping as fc
  x, _ = _data(8, seed=4)
  model = _seq()
  opt = dp.keras.DPKerasSGDOptimizer(0.05, 0.0, learning_rate=1.0)   # clipping="auto"
  model.compile(optimizer=opt, loss=LOSS)
  model(x)
  assert fc.supports(model)
  assert opt.resolve_clipping(model) == "fast"
  assert dp.keras.DPKerasSGDOptimizer(0.05, 0.0, 2).resolve_clipping(model) == "fast"
  assert dp.keras.DPKerasSGDOptimizer(
      0.05, 0.0, 2, clipping="vectorized").resolve_clipping(model) == "vectorized"


def _cnn_seq():
  keras.utils.set_random_seed(0)
  return dp.keras.DPSequential([
      keras.Input((6,)), keras.layers.Reshape((6, 1)),
      keras.layers.Conv1D(3, 3, activation="relu"), keras.layers.Flatten(),
      keras.layers.Dense(3)])


_WEIGHTS = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], np.float32)


@functools.lru_cache(maxsize=None)
def _vectorized_weighted_update(microbatches):
  """The vectorized path's one-step update of `_cnn_seq` on `_data(10, seed=5)` with the
  weights `_WEIGHTS` in `microbatches` records: the reference of the fast path's cases, the
  same for every physical chunk size (computed once per number of records)."""
  x, y = _data(10, seed=5)
  vect = _cnn_seq()
  vect.compile(optimizer=dp.keras.DPKerasSGDOptimizer(
      0.05, 0.0, microbatches, learning_rate=1.0, clipping="vectorized"), loss=LOSS)
  vect(x)
  helpers.set_sampling(vect, 10)
  return tuple(np.array(u) for u in helpers.one_step_update(vect, x, y, sample_weight=_WEIGHTS))


# One example per record with weight-0 rows (with and without physical chunks) on the fast
# path is the step oracle's (test_step_oracle.py: fast x padding x microbatches=B, physical 4).
@pytest.mark.parametrize("microbatches,physical", [(4, None), (3, None), (3, 4), (2, 5)])
@pytest.mark.parametrize("weighted", [True])
def test_fast_clipping_matches_reference_with_microbatches_and_physical_batches(
    microbatches, physical, weighted):
  """clipping='fast' under fit's train step: records of several examples (B = 10 and
  M = 3 or 4 leave uneven records) and physical chunks, with rows of weight 0, give the
  vectorized path's update. Without weight-0 rows these axes (and XLA) are checked against
  the per-record loop by test_step_oracle.py."""
  x, y = _data(10, seed=5)
  sw = _WEIGHTS if weighted else None
  model = _cnn_seq()
  opt = dp.keras.DPKerasSGDOptimizer(0.05, 0.0, microbatches, learning_rate=1.0, clipping="fast",
                                     max_physical_batch_size=physical)
  model.compile(optimizer=opt, loss=LOSS)
  model(x)
  assert opt.resolve_clipping(model) == "fast"
  if sw is None:
    ref = helpers.reference_gradient(model, LOSS, x, y, clip=0.05, num_microbatches=microbatches)
  else:  # rows with weight 0 are padding: they join no record
    ref = _vectorized_weighted_update(microbatches)
  helpers.set_sampling(model, 10)
  got = helpers.one_step_update(model, x, y, sample_weight=sw)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)


def test_privacy_meter_and_ledger_export(tmp_path):
  """(Also the DP RMSprop's fit: test_ready_made_classes_train[RMSprop] runs with -m slow.)"""
  x, y = _data(200)
  model = _seq()
  model.compile(optimizer=dp.keras.DPKerasRMSpropOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=LOSS)
  path = os.path.join(tmp_path, "ledger.json")
  hist = model.fit(dp.data.poisson_batches(x, y, expected_batch_size=20, seed=0), epochs=2,
                   verbose=0, callbacks=[dp.keras.callbacks.PrivacyMeter(delta=1e-5),
                                         dp.keras.callbacks.LedgerExport(path)])
  eps = hist.history["epsilon"]
  assert len(eps) == 2 and 0 < eps[0] < eps[1]
  assert hist.history["delta"] == [1e-5, 1e-5]
  assert eps[1] == pytest.approx(accounting.epsilon(model.ledger, 1e-5))
  with open(path) as f:
    assert json.load(f)["num_samples"] == 20
  assert ledger_lib.PrivacyLedger.load_json(path).sample_count.numpy() == 20


@pytest.mark.parametrize("spe", [1, 2])
def test_stop_at_privacy_budget(spe):
  """(spe=1 is also the DP Adagrad's fit: test_ready_made_classes_train[Adagrad] runs with
  -m slow.)"""
  x, y = _data(200)
  model = _seq()
  cls = dp.keras.DPKerasAdagradOptimizer if spe == 1 else dp.keras.DPKerasSGDOptimizer
  model.compile(optimizer=cls(1.0, 1.0, learning_rate=0.1), loss=LOSS,
                steps_per_execution=spe)
  # budget: epsilon of 12 such steps, so training must stop at step 12
  budget = accounting.compute_dp_sgd_privacy(200, 20, 1.0, 12 * 20 / 200, 1e-5).epsilon * 1.0001
  cb = dp.keras.callbacks.StopAtPrivacyBudget(epsilon=budget, delta=1e-5)
  model.fit(dp.data.poisson_batches(x, y, expected_batch_size=20, seed=0), epochs=20, verbose=0,
            callbacks=[cb])
  steps = int(model.ledger.sample_count.numpy())
  assert steps == 12 or (spe == 2 and steps in (11, 12))
  assert accounting.epsilon(model.ledger, 1e-5) <= budget
  # one more step (or execution) would have exceeded the budget
  d = model.ledger.to_dict()
  d["runs"][-1]["count"] += spe
  d["num_samples"] += spe
  assert accounting.epsilon(ledger_file.sign(d), 1e-5) > budget


def test_stop_at_privacy_budget_too_small_for_one_step_takes_none():
  x, y = _data(200)
  model = _seq()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), loss=LOSS)
  model.fit(dp.data.poisson_batches(x, y, expected_batch_size=20, seed=0), epochs=2, verbose=0,
            callbacks=[dp.keras.callbacks.StopAtPrivacyBudget(epsilon=0.01, delta=1e-5)])
  assert int(model.ledger.sample_count.numpy()) == 0


@pytest.mark.parametrize("make_query,path", [
    (lambda: dp_query.GaussianSumQuery(0.05, 0.0), "fast"),
    (lambda: dp_query.NestedQuery([dp_query.GaussianSumQuery(0.05, 0.0)] * 4), "vectorized"),
], ids=["gaussian_gives_factors", "nested_gives_none"])
def test_fast_path_follows_the_querys_clip_factors(make_query, path):
  """The fast path clips by the query's record_clip_factors: a query without them goes to the
  vectorized path under "auto" and is refused under "fast"."""
  x, _ = _data(8, seed=4)
  model = _seq()
  model(x)
  opt = dp.keras.DPKerasSGDOptimizer(dp_query=make_query(), learning_rate=1.0)
  assert opt.resolve_clipping(model) == path
  strict = dp.keras.DPKerasSGDOptimizer(dp_query=make_query(), learning_rate=1.0,
                                        clipping="fast")
  if path == "fast":
    assert strict.resolve_clipping(model) == "fast"
  else:
    with pytest.raises(ValueError, match="record_clip_factors"):
      strict.resolve_clipping(model)
