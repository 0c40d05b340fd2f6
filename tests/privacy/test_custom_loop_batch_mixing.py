"""Why the whole-batch custom-loop forms need model=, and the TF Privacy spellings of them.

Relation: add/remove one example; the ledger records sensitivity C (the clip). The forms of
the private step that take a vector of per-example losses computed on the whole batch
(`compute_private_gradients(loss_fn, vars)` without data=, the tape form, `minimize`) bound
one example's influence by C only if example i's loss depends on example i alone. On a
BatchNormalization in training mode, a weightless batch-centering layer, or a layer that
centers only in training mode (which the inference-mode probe cannot see), it does not: with
the refusal switched off, real neighbouring batches (one example physically removed or added,
not masked: a masked row still enters the batch statistics) move the pre-noise sum (noise 0,
normalize=False) by more than C. The library refuses those calls (without model=, and with a
model that mixes); the data form, which runs each record alone, stays within C on the same
neighbours.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras import compat
from tf_dpiter.keras.optimizer import custom_loops

# Nightly tier (-m slow): the BatchNormalization and training-only mixing models
# (the centering one stays: the same refusal).
SLOW_CASES = {
    "test_whole_batch_form_on_a_mixing_model_exceeds_c_so_it_is_refused[bn]",
    "test_whole_batch_form_on_a_mixing_model_exceeds_c_so_it_is_refused[training_only]"}

CLIP, B = 0.05, 6


class _BatchCentering(keras.layers.Layer):
  def call(self, h):
    return h - keras.ops.mean(h, axis=0, keepdims=True)


class _CenteringInTraining(keras.layers.Layer):
  """Mixes only in training mode (the inference-mode probe cannot see it)."""

  def call(self, h, training=None):
    return h - keras.ops.mean(h, axis=0, keepdims=True) if training else h


def _model(kind):
  keras.utils.set_random_seed(0)
  mix = {"bn": keras.layers.BatchNormalization, "centering": _BatchCentering,
         "training_only": _CenteringInTraining, "dropout": lambda: keras.layers.Dropout(0.5)}
  mix = mix[kind]()
  return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), mix,
                           keras.layers.Dense(3)])


def _losses(model, x, y):
  return keras.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                      from_logits=True)


def _optimizer():
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, normalize=False)
  opt.set_sampling(1000, B / 1000, "poisson")
  return opt


def _flat(grads):
  return np.concatenate([np.asarray(g, np.float64).ravel() for g in grads])


def _neighbours(rng):
  """A batch of B examples, then its add/remove-one neighbours (rows physically dropped or
  appended)."""
  x = (rng.randn(B, 4) * 2).astype("float32")
  y = rng.randint(0, 3, B).astype("int32")
  out = [(np.delete(x, j, 0), np.delete(y, j)) for j in range(B)]
  for scale in (0.1, 10.0, 1e3):
    out.append((np.concatenate([x, rng.randn(1, 4).astype("float32") * scale]),
                np.r_[y, rng.randint(0, 3)].astype("int32")))
  return (x, y), out


def _largest_move(private_sum, rng):
  (x, y), others = _neighbours(rng)
  base = private_sum(x, y)
  return max(np.linalg.norm(private_sum(xn, yn) - base) for xn, yn in others)


@pytest.mark.parametrize("kind", ["bn", "centering", "training_only"])
def test_whole_batch_form_on_a_mixing_model_exceeds_c_so_it_is_refused(kind, monkeypatch):
  model, opt = _model(kind), _optimizer()
  variables = model.trainable_variables

  def whole_batch(x, y):
    return _flat(opt.compute_private_gradients(lambda: _losses(model, x, y), variables))

  def per_record(x, y):
    return _flat(opt.compute_private_gradients(lambda d: _losses(model, d[0], d[1]), variables,
                                               data=(x, y), model=model))

  x, y = _neighbours(np.random.RandomState(0))[0]
  with pytest.raises(ParameterValueError, match="model=None"):
    whole_batch(x, y)
  if kind == "bn":
    # batch normalization in training mode also writes its moving statistics from the data:
    # the state-write check refuses it first, in the whole-batch and the per-record form
    for form in (lambda: opt.compute_private_gradients(lambda: _losses(model, x, y), variables,
                                                       model=model),
                 lambda: per_record(x, y)):
      with pytest.raises(ParameterValueError, match="writes the variable .* from the data"):
        form()
  else:
    with pytest.raises(ParameterValueError, match="data="):
      opt.compute_private_gradients(lambda: _losses(model, x, y), variables, model=model)
    assert _largest_move(per_record, np.random.RandomState(1)) <= CLIP * (1 + 1e-5)
  # what the refusal prevents: the same call with the check switched off
  monkeypatch.setattr(custom_loops, "_check_batch_independent", lambda *a, **kw: None)
  moved = _largest_move(whole_batch, np.random.RandomState(1))
  assert moved > 1.2 * CLIP, (kind, moved / CLIP)


def test_dropout_is_not_taken_for_mixing():
  """The training-mode probe restores the seed generators: dropout's masks are the same in
  both probe runs, so a per-example layer with randomness is accepted."""
  model, opt = _model("dropout"), _optimizer()
  x, y = _neighbours(np.random.RandomState(0))[0]
  grads = opt.compute_private_gradients(lambda: _losses(model, x, y), model.trainable_variables,
                                        model=model)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


def _tfp_model():
  keras.utils.set_random_seed(0)
  model = compat.DPSequential(l2_norm_clip=CLIP, noise_multiplier=0.0,
                              layers=[keras.Input((4,)), keras.layers.Dense(3)])
  model.compile(optimizer=keras.optimizers.SGD(1.0), loss="sparse_categorical_crossentropy")
  model.optimizer.set_sampling(1000, B / 1000, "poisson")
  return model


@pytest.mark.parametrize("spelling", ["dp_sequential", "vectorized", "class_of_sgd"])
def test_tf_privacy_minimize_spellings_refuse_without_model_and_run_with_it(spelling):
  if spelling == "dp_sequential":
    model = _tfp_model()
    opt = model.optimizer
  else:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    cls = (compat.VectorizedDPKerasSGDOptimizer if spelling == "vectorized"
           else compat.make_keras_optimizer_class(keras.optimizers.SGD))
    opt = cls(CLIP, 0.0, learning_rate=1.0)
    opt.set_sampling(1000, B / 1000, "poisson")
  rng = np.random.RandomState(2)
  x, y = rng.randn(B, 4).astype("float32"), rng.randint(0, 3, B).astype("int32")
  variables = model.trainable_variables
  with tf.GradientTape(persistent=True) as tape:
    losses = _losses(model, x, y)
  with pytest.raises(ParameterValueError, match=r"minimize\(loss, var_list, tape=tape\)"):
    opt.minimize(losses, variables, tape=tape)
  with pytest.raises(ParameterValueError, match=r"Pass model=.*data="):
    opt.minimize(lambda: _losses(model, x, y), variables)
  assert int(opt.ledger.sample_count) == 0                    # nothing was charged
  expected = [np.asarray(g) for g in opt.compute_private_gradients(
      lambda d: _losses(model, d[0], d[1]), variables, data=(x, y))]
  before = [v.numpy().copy() for v in variables]
  opt.minimize(losses, variables, tape=tape, model=model)     # TF Privacy's call + model=
  for b0, v, g in zip(before, variables, expected):
    np.testing.assert_allclose(b0 - v.numpy(), g, rtol=1e-4, atol=1e-7)   # lr 1, noise 0
  assert int(opt.ledger.sample_count) == 2


class _Subclassed(keras.Model):
  def __init__(self):
    super().__init__()
    self.dense = keras.layers.Dense(3)

  def call(self, x, training=None):
    return self.dense(x)


def test_a_model_the_probe_cannot_see_is_refused_and_the_data_form_runs():
  model, opt = _Subclassed(), _optimizer()
  x, y = np.ones((B, 4), "float32"), np.zeros(B, "int32")
  model(x)
  # a subclassed model's call is not known to act per example: refused before any probe
  with pytest.raises(ParameterValueError, match="not known to act on each example.*data="):
    opt.compute_private_gradients(lambda: _losses(model, x, y), model.trainable_variables,
                                  model=model)
  # declared per example, it is still probed (second line of defence), and cannot be
  dp.keras.declare_per_example(model, "its call is one Dense layer applied to each row")
  with pytest.raises(ParameterValueError, match="could not be probed.*data="):
    opt.compute_private_gradients(lambda: _losses(model, x, y), model.trainable_variables,
                                  model=model)
  opt.compute_private_gradients(lambda d: _losses(model, d[0], d[1]),
                                model.trainable_variables, data=(x, y), model=model)
