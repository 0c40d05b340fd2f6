"""make_private on a model already compiled with a plain Keras optimizer (a keras_hub task
compiles itself with Adam in its constructor).

Given l2_norm_clip and noise_multiplier, make_private replaces the compiled optimizer by its
DP copy: the same class and hyperparameters (learning-rate schedule, betas, weight decay), the
compiled loss and metrics kept, and the step is DP (its update is the clipped per-example sum
of an independent loop; the ledger records its steps with the given z). Without them it is
refused before anything changes. An uncompiled model keeps `make_private(model)`; given the
settings, its first compile with a plain optimizer is made private. A model compiled with a DP
optimizer is kept as it is.
"""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.model import models
from tf_dpiter.keras.optimizer import optimizers as opt_lib

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _functional(seed=0):
  keras.utils.set_random_seed(seed)
  inp = keras.Input((6,))
  h = keras.layers.Dense(4, activation="tanh")(inp)
  return keras.Model(inp, keras.layers.Dense(3)(h))


def _adamw():
  schedule = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=7, decay_rate=0.9)
  return keras.optimizers.AdamW(learning_rate=schedule, beta_1=0.8, beta_2=0.95,
                                weight_decay=0.03, epsilon=1e-6)


def test_compiled_plain_model_gets_the_dp_copy_with_its_hyperparameters_loss_and_metrics():
  model = _functional()
  plain = _adamw()
  model.compile(optimizer=plain, loss=LOSS, weighted_metrics=["accuracy"])
  before = plain.get_config()
  same = dp.keras.make_private(model, l2_norm_clip=0.7, noise_multiplier=1.3)
  assert same is model and isinstance(model, models.DPModelMixin)
  opt = model.optimizer
  assert isinstance(opt, opt_lib.DPOptimizerBase) and isinstance(opt, keras.optimizers.AdamW)
  assert type(opt) is dp.keras.DPKerasAdamWOptimizer   # the ready-made class (test_api.py)
  after = opt.get_config()
  for name in ("learning_rate", "beta_1", "beta_2", "weight_decay", "epsilon"):
    assert after[name] == before[name], name
  assert (opt.private_step.l2_norm_clip, opt.private_step.noise_multiplier) == (0.7, 1.3)
  assert model.loss is LOSS
  assert model.get_compile_config()["optimizer"]["class_name"] == type(opt).__name__
  x, y = helpers.small_data(48, seed=1)
  history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert "accuracy" in history.history           # the compiled weighted metric is kept
  statement = model.privacy_statement(1e-5)      # the ledger's record of the run
  assert statement.steps == int(model.ledger.sample_count.numpy()) == int(opt.iterations) > 0
  assert statement.policy == "poisson" and statement.noise_multiplier == pytest.approx(1.3)
  assert 0 < dp.accounting.epsilon(model.ledger, 1e-5) < np.inf


def test_the_step_after_make_private_clips_each_example():
  model = _functional(seed=2)
  model.compile(optimizer=keras.optimizers.SGD(learning_rate=1.0), loss=LOSS)
  with pytest.warns(UserWarning, match="adds no noise"):
    dp.keras.make_private(model, l2_norm_clip=0.05, noise_multiplier=0.0,
                          clipping="vectorized")
  x, y = helpers.small_data(8, seed=3)
  model(x)
  helpers.assert_step_matches_reference(model, LOSS, x, y, 0.05, 8)
  assert int(model.ledger.sample_count.numpy()) == 1


def test_compiled_plain_model_without_settings_is_refused_and_left_unchanged():
  model = _functional()
  plain = keras.optimizers.Adam(1e-3)
  model.compile(optimizer=plain, loss=LOSS)
  cls = type(model)
  with pytest.raises(PrivacyConfigError,
                     match=r"`l2_norm_clip` and `noise_multiplier` must be given .*\(Adam\).*"
                           r"Received: l2_norm_clip=None, noise_multiplier=None"):
    dp.keras.make_private(model)
  with pytest.raises(ValueError, match="noise_multiplier=None"):
    dp.keras.make_private(model, l2_norm_clip=1.0)          # one without the other
  with pytest.raises(ValueError, match="l2_norm_clip"):
    dp.keras.make_private(model, l2_norm_clip=-1.0, noise_multiplier=1.0)
  with pytest.raises(ParameterTypeError, match=r"`max_grad_norm` must be one of .*"
                                               r"Received: max_grad_norm=1.0"):
    dp.keras.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0)
  assert type(model) is cls and model.optimizer is plain   # nothing changed


def test_uncompiled_model_unchanged_and_settings_apply_to_its_first_compile():
  model = dp.keras.make_private(_functional())       # the old call, unchanged
  assert isinstance(model, models.DPModelMixin) and not model.compiled
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0), loss=LOSS)
  assert isinstance(model.optimizer, opt_lib.DPOptimizerBase)

  model = dp.keras.make_private(_functional(), l2_norm_clip=0.5, noise_multiplier=0.9,
                                num_microbatches=None)
  model.compile(optimizer="adam", loss=LOSS)          # a name: Keras' Adam, made private
  assert isinstance(model.optimizer, dp.keras.DPKerasAdamOptimizer)
  assert model.optimizer.private_step.noise_multiplier == 0.9
  with pytest.raises(ValueError, match="needs a DP optimizer"):
    model.compile(optimizer="adam", loss=LOSS)        # the settings were used once

  model = dp.keras.make_private(_functional(), l2_norm_clip=0.5, noise_multiplier=0.9)
  with pytest.raises(PrivacyConfigError, match="give the DP settings in one place"):
    model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0), loss=LOSS)


def test_model_compiled_with_a_dp_optimizer_stays_as_it_is():
  model = _functional()
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1)
  model.compile(optimizer=opt, loss=LOSS)
  assert dp.keras.make_private(model).optimizer is opt
  assert dp.keras.make_private(model).optimizer is opt   # again: a no-op
  with pytest.raises(PrivacyConfigError, match=r"must not be given .*DPKerasSGDOptimizer.*"
                                               r"Received: l2_norm_clip=1.0, noise_multiplier=2.0"):
    dp.keras.make_private(model, l2_norm_clip=1.0, noise_multiplier=2.0)
  assert model.optimizer is opt


def test_a_model_made_private_then_compiled_plain_can_be_given_the_settings():
  model = dp.keras.make_private(_functional())
  with pytest.raises(ValueError, match="needs a DP optimizer"):
    model.compile(optimizer=keras.optimizers.RMSprop(0.01, rho=0.8), loss=LOSS)
  dp.keras.make_private(model, l2_norm_clip=1.0, noise_multiplier=1.0)
  assert isinstance(model.optimizer, dp.keras.DPKerasRMSpropOptimizer)
  assert model.optimizer.get_config()["rho"] == pytest.approx(0.8)


def test_tf_privacy_model_arguments_and_make_private_settings_do_not_mix():
  model = dp.keras.DPSequential(l2_norm_clip=1.0, noise_multiplier=1.0,
                                layers=[keras.Input((6,)), keras.layers.Dense(3)])
  with pytest.raises(PrivacyConfigError, match="TF Privacy's DP model arguments"):
    dp.keras.make_private(model, l2_norm_clip=1.0, noise_multiplier=1.0)


def test_not_a_model_is_refused():
  with pytest.raises(ParameterTypeError, match=r"`model` must be a keras.Model instance\. "
                                               r"Received: model='model'"):
    dp.keras.make_private("model")


def test_mixed_float16_model_compiled_plain_loses_the_dynamic_loss_scale():
  previous = keras.config.dtype_policy()
  keras.config.set_dtype_policy("mixed_float16")
  try:
    model = _functional()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    dp.keras.make_private(model, l2_norm_clip=1.0, noise_multiplier=1.0)
  finally:
    keras.config.set_dtype_policy(previous)
  assert isinstance(model.optimizer, dp.keras.DPKerasSGDOptimizer)   # unwrapped: a static scale


def test_keras_hub_task_compiled_by_its_constructor():
  hub = pytest.importorskip("keras_hub", reason="keras_hub is not installed (pip install -e "
                            "'.[test]' installs it)")
  keras.utils.set_random_seed(1)
  backbone = hub.models.BertBackbone(vocabulary_size=11, num_layers=1, num_heads=2,
                                     hidden_dim=4, intermediate_dim=8, max_sequence_length=5,
                                     dropout=0.0)
  task = hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None)
  adam, loss = task.optimizer, task.loss          # keras_hub's defaults
  assert task.compiled and type(adam) is keras.optimizers.Adam
  with pytest.raises(PrivacyConfigError, match=r"make_private\(model, l2_norm_clip=1.0"):
    dp.keras.make_private(task)
  assert type(task) is hub.models.BertTextClassifier   # refused before any change
  dp.keras.make_private(task, l2_norm_clip=1.0, noise_multiplier=1.1)
  assert type(task).__name__ == "DPBertTextClassifier"
  assert isinstance(task.optimizer, dp.keras.DPKerasAdamOptimizer)
  assert task.optimizer.get_config()["learning_rate"] == adam.get_config()["learning_rate"]
  assert task.loss is loss
  assert [type(m) for m in task._compile_config.config["metrics"]] == [   # pylint: disable=protected-access
      keras.metrics.SparseCategoricalAccuracy]
  assert int(task.ledger.sample_count.numpy()) == 0


def test_make_private_with_epsilon_on_a_compiled_model_compiles_the_calibrated_optimizer():
  model = _functional()
  model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=LOSS, weighted_metrics=["accuracy"])
  model, opt = dp.keras.make_private_with_epsilon(
      model, keras.optimizers.SGD(0.1, momentum=0.5), epsilon=2.0, delta=1e-5, epochs=1,
      batch_size=16, population_size=48, l2_norm_clip=1.0)
  assert model.optimizer is opt and isinstance(opt, dp.keras.DPKerasSGDOptimizer)
  assert opt.get_config()["momentum"] == 0.5 and model.loss is LOSS
  x, y = helpers.small_data(48, seed=4)
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)      # no compile needed
  assert 0 < dp.accounting.epsilon(model.ledger, 1e-5) <= 2.0


def test_saved_and_loaded_after_make_private_on_a_compiled_model(tmp_path):
  model = _functional()
  model.compile(optimizer=keras.optimizers.Adam(3e-3, beta_1=0.7), loss=LOSS)
  dp.keras.make_private(model, l2_norm_clip=0.8, noise_multiplier=1.2)
  x, y = helpers.small_data(48, seed=5)
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)
  path = str(tmp_path / "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  opt = loaded.optimizer
  assert isinstance(opt, dp.keras.DPKerasAdamOptimizer)
  assert opt.get_config()["beta_1"] == pytest.approx(0.7)
  assert (opt.private_step.l2_norm_clip, opt.private_step.noise_multiplier) == (0.8, 1.2)
  assert int(loaded.ledger.sample_count.numpy()) == int(model.ledger.sample_count.numpy()) > 0


def test_keras_hub_task_made_private_before_its_default_compile():
  hub = pytest.importorskip("keras_hub", reason="keras_hub is not installed (pip install -e "
                            "'.[test]' installs it)")
  backbone = hub.models.BertBackbone(vocabulary_size=11, num_layers=1, num_heads=2,
                                     hidden_dim=4, intermediate_dim=8, max_sequence_length=5)
  task = hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None,
                                       compile=False)
  dp.keras.make_private(task, l2_norm_clip=1.0, noise_multiplier=1.1)
  task.compile()          # keras_hub's defaults: Adam(5e-5), sparse cross-entropy, accuracy
  assert isinstance(task.optimizer, dp.keras.DPKerasAdamOptimizer)
  assert task.optimizer.get_config()["learning_rate"] == pytest.approx(5e-5)
  assert isinstance(task.loss, keras.losses.SparseCategoricalCrossentropy)


class _Counted(keras.Model):
  """A subclassed model counting its steps in its own train_step override."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = keras.layers.Dense(1)

  def call(self, inputs):
    return self.dense(inputs)

  def train_step(self, data):
    return super().train_step(data)


class _CountedChild(_Counted):
  pass


@pytest.mark.parametrize("cls", [_Counted, _CountedChild])
def test_a_train_step_override_is_refused_by_make_private_not_dropped(cls):
  """Review R9 (session 40), finding 6: the DP class put the private step before the user's
  `train_step`, which never ran (a step counter held 0 after 4 steps), silently. Refused
  now, naming the class and the way (subclass dp.keras.DPModel), the model unchanged."""
  model = cls()
  model.build((None, 3))
  model.compile(optimizer="sgd", loss="mse")
  with pytest.raises(PrivacyConfigError, match="_Counted.train_step would not run"):
    dp.keras.make_private(model, l2_norm_clip=1.0, noise_multiplier=1.0)
  assert type(model) is cls
