"""Privacy arithmetic in float32 under every Keras dtype policy (issue 12, item 2).

Per-example norms, clip factors, the clipped sum and the noise are formed in float32 (float64
for float64 variables) whatever the policy: in bfloat16 the sums of 302 and 303 records of
norm C would be 302C and 304C (one record moving the sum by 2C); here they differ by C. The
real train step under each policy never moves the clipped sum by more than the sensitivity
the ledger records (tf_dpiter.auditing.check_sensitivity)."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.auditing import sensitivity

# Nightly tier (-m slow): the 302/303 check under the mixed policies and float32 ([bfloat16]
# stays, the same custom-loop entry point), the bfloat16 CNN (the bfloat16 MLP stays) and the
# float32 MLP (float32, no cast on any path, stays by default elsewhere: one record moving a
# custom loop's sum by at most C in test_row_count_shrink.py::
# test_custom_loop_of_unknown_rows_moves_the_sum_by_at_most_C, check_sensitivity of a float32
# step in test_check_sensitivity.py::test_tutorial_cnn_passes[poisson]).
SLOW_CASES = {
    "test_302_and_303_records_differ_by_one_clip_norm[float32]",
    "test_train_step_never_exceeds_recorded_sensitivity[float32-mlp]",
    "test_302_and_303_records_differ_by_one_clip_norm[mixed_float16]",
    "test_302_and_303_records_differ_by_one_clip_norm[mixed_bfloat16]",
    "test_train_step_never_exceeds_recorded_sensitivity[bfloat16-cnn]"}

POLICIES = ["float32", "mixed_float16", "mixed_bfloat16", "bfloat16"]
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(params=POLICIES)
def policy(request):
  keras.config.set_dtype_policy(request.param)
  yield request.param
  keras.config.set_dtype_policy("float32")


def _sum_of_clipped(layer, opt, count):
  """The noise-free clipped sum over `count` identical records whose gradient norm >> C."""
  x = np.full((count, 4), 10.0, "float32")

  def loss_fn(xr):
    return keras.ops.sum(keras.ops.cast(layer(xr), "float32"), axis=-1)

  grads = opt.compute_private_gradients(loss_fn, layer.trainable_variables, data=x)
  assert all(str(g.dtype) in ("<dtype: 'float32'>", "float32") for g in grads), grads
  return np.concatenate([np.asarray(g, np.float64).ravel() for g in grads])


def test_302_and_303_records_differ_by_one_clip_norm(policy):
  keras.utils.set_random_seed(0)
  layer = keras.layers.Dense(3, use_bias=False)
  layer.build((None, 4))
  assert layer.compute_dtype == ("float32" if policy == "float32" else policy.split("_")[-1])
  clip = 1.0
  opt = dp.keras.DPKerasSGDOptimizer(clip, 0.0, learning_rate=1.0, normalize=False)
  opt.set_sampling(1000, 0.3, "poisson")
  s302, s303 = _sum_of_clipped(layer, opt, 302), _sum_of_clipped(layer, opt, 303)
  # each clipped record is added times the shrink 1 / (1 + eta) of the float32 sum's rounding
  # margin (summation.shrink; eta ~ 3e-4 at 302 records): the sums sit just under 302 C and
  # 303 C, one record moves them by at most C (in bfloat16: 302 C and 304 C, 2 C apart)
  assert 302 * clip * (1 - 1e-3) <= np.linalg.norm(s302) <= 302 * clip
  assert clip * (1 - 1e-3) <= np.linalg.norm(s303 - s302) <= clip


def _mlp():
  return dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                keras.layers.Dense(3)])


def _cnn():
  return dp.keras.DPSequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                                keras.layers.Flatten(), keras.layers.Dense(3)])


def _sensitivity_cases():
  """Every policy on the MLP; the CNN (the conv rule) under a 16-bit compute dtype each of
  float16 and bfloat16. The CNN's float32 and mixed_bfloat16 cells run under -m slow (float32
  conv steps' neighbours: tests/privacy/test_neighbouring.py)."""
  for policy in POLICIES:
    for arch in ("mlp", "cnn"):
      slow = arch == "cnn" and policy in ("float32", "mixed_bfloat16")
      yield pytest.param(policy, arch, id=f"{policy}-{arch}",
                         marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("policy,arch", list(_sensitivity_cases()), indirect=["policy"])
def test_train_step_never_exceeds_recorded_sensitivity(policy, arch):
  """check_sensitivity (add/remove and adversarial additions) under each dtype policy; under
  16-bit compute "auto" keeps the fast path, which clips in float32 (fast_clipping)."""
  keras.utils.set_random_seed(0)
  model = _mlp() if arch == "mlp" else _cnn()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1), loss=LOSS)
  rng = np.random.RandomState(0)
  shape = (6,) if arch == "mlp" else (8, 8, 1)
  x, y = rng.randn(24, *shape).astype("float32"), rng.randint(0, 3, 24)
  report = sensitivity.check_sensitivity(model, x, y, num_candidates=9)
  assert report.passed, str(report)
  assert report.measured_sensitivity > 0.5, str(report)
  assert report.path == "fast"


def test_mixed_float16_fit_trains_without_loss_scale_optimizer():
  """mixed_float16: Keras' dynamic LossScaleOptimizer (a data-dependent scale) is not used;
  the DP step applies a static loss scale and unscales in float32."""
  keras.config.set_dtype_policy("mixed_float16")
  try:
    keras.utils.set_random_seed(0)
    model = _mlp()
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 0.5, learning_rate=0.5)
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(opt), loss=LOSS)
    assert model.optimizer is opt
    rng = np.random.RandomState(0)
    x = rng.randn(64, 6).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    hist = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert np.all(np.isfinite(hist.history["loss"]))
    assert int(model.ledger.sample_count) == 12
    assert all(w.dtype == "float32" for w in model.trainable_weights)
    model2 = _mlp()   # clipping="fast" is exact under 16-bit compute (float32 sums)
    model2.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 0.5, clipping="fast"), loss=LOSS)
    hist2 = model2.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.all(np.isfinite(hist2.history["loss"]))
  finally:
    keras.config.set_dtype_policy("float32")
