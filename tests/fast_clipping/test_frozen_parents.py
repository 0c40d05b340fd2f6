"""Fast clipping of models whose frozen layers hold trainable sublayers (issue 18, LoRA).

keras_hub's `backbone.enable_lora(r)` sets `trainable = False` on every sublayer of the
backbone, then `trainable = True` and `enable_lora(r)` on the target leaves (query/value
EinsumDense). In Keras 3 a layer whose own flag is False lists no trainable variables, yet
the model's `trainable_variables` (what the optimizer trains) holds the leaves' LoRA
variables. The plan must follow the model's list, variable by variable:

- the clipped variables are exactly `model.trainable_variables`, all on ghost units;
- the clipped sum and the norms equal the per-example loop of conftest.py (each example's
  gradient over `model.trainable_variables` from its own tape, clipped, summed in float64),
  to float32 round-off;
- through the real DP train step with noise off, removing one example (Poisson sampling,
  add/remove-one relation, unit = example) changes the summed update by at most the
  sensitivity the ledger records (tf_dpiter.auditing.check_sensitivity: the removals and an
  adversarial random search).

The surrogate is plain Keras 3 (runs in CI); the keras_hub case (a small BertBackbone)
runs where keras_hub can be imported.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.auditing import sensitivity
from tf_dpiter.keras import fast_clipping as fc
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping import plan as plan_lib

L = keras.layers
SEQ, DIM, N = 5, 8, 6


def mse(y_true, y_pred):
  return tf.reduce_sum(tf.square(y_true - y_pred), axis=-1)


class Block(L.Layer):
  """A block with sublayers (attention-like): q/v EinsumDense (LoRA targets), k Dense,
  LayerNorm, and a nested functional model holding a Dense."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.query = L.EinsumDense("btd,de->bte", (None, DIM), bias_axes="e", name="query")
    self.value = L.EinsumDense("btd,de->bte", (None, DIM), bias_axes="e", name="value")
    self.key = L.Dense(DIM, name="key")
    self.norm = L.LayerNormalization(name="norm")
    inner_in = keras.Input((SEQ, DIM))
    self.inner_dense = L.Dense(DIM, activation="tanh", name="inner_dense")
    self.inner = keras.Model(inner_in, self.inner_dense(inner_in), name="inner")

  def build(self, shape):
    for layer in (self.query, self.value, self.key, self.norm):
      layer.build(shape)

  def call(self, x):
    h = self.norm(x + self.query(x) * tf.tanh(self.key(x)) + self.value(x))
    return self.inner(h)


# The stand-in of a keras_hub transformer block; a custom layer sends `clipping="auto"` to the
# vectorized path unless declared, and this one acts on each example alone (per-token products
# and a LayerNormalization over features, nothing taken across the batch).
dp.keras.declare_per_example(Block, "per-token projections and a per-token LayerNormalization "
                             "of each example; no batch statistic, no state across calls")


def _random_b(layer, rng):
  for v in layer.variables:
    if v.path.endswith("lora_kernel_b"):   # Keras starts B at 0: grad A would vanish
      v.assign(rng.normal(size=v.shape).astype("float32"))


def frozen_parent_lora_model(cls=keras.Model, rank=2):
  """Input -> Dense -> Block -> Flatten -> Dense(3) head, with backbone.enable_lora's
  recipe on the body: every sublayer frozen, then the targets (block.query, block.value,
  the nested model's Dense) trainable again with enable_lora(rank)."""
  keras.utils.set_random_seed(3)
  inp = keras.Input((SEQ, 4))
  embed, block = L.Dense(DIM, name="embed"), Block(name="block")
  body = keras.Model(inp, block(embed(inp)), name="body")
  out = L.Dense(3, name="head")(L.Flatten()(body(inp)))
  model = cls(inp, out)
  body.trainable = False   # freezes every sublayer (recursively), as enable_lora does
  rng = np.random.default_rng(0)
  for target in (block.query, block.value, block.inner_dense):
    target.trainable = True
    target.enable_lora(rank)
    _random_b(target, rng)
  return model


def _data(seed=0, n=N):
  rng = np.random.RandomState(seed)
  return (rng.randn(n, SEQ, 4).astype("float32") * 2,
          rng.randn(n, 3).astype("float32"))


def check_exact(reference, model, x, y):
  """Ghost plan covering exactly model.trainable_variables; fast sum and norms == loop."""
  assert fc.unregistered_layers(model) == []
  units = plan_lib.plan(model)
  covered = [id(v) for u in units for v in u.variables]
  assert sorted(covered) == sorted(id(v) for v in model.trainable_variables)
  memo = {}   # each record's loop gradient once for both calls
  _, ref_norms = reference(model, x, y, mse, 1.0, memo=memo)
  clip = float(np.median(ref_norms))   # some examples clipped, some not
  ref_grads, ref_norms = reference(model, x, y, mse, clip, memo=memo)
  grads, norms = clipping.clipped_grad_sum(model, x, y, mse, clip)
  np.testing.assert_allclose(norms.numpy(), ref_norms, rtol=1e-4, atol=1e-6)
  for g, r, v in zip(grads, ref_grads, model.trainable_variables):
    scale = max(1.0, float(np.max(np.abs(r))))
    np.testing.assert_allclose(g.numpy(), r, atol=1e-4 * scale, rtol=1e-4, err_msg=v.path)


def test_frozen_parents_with_lora_leaves_are_ghost_units(clip_reference):
  model = frozen_parent_lora_model()
  names = {u.layer.name: u.kind for u in plan_lib.plan(model)}
  assert names == {"query": "ghost", "value": "ghost", "inner_dense": "ghost",
                   "head": "ghost"}
  trained = {v.path.split("/")[-1] for v in model.trainable_variables}
  assert "lora_kernel_a" in trained and "kernel" in trained   # LoRA A, B + the head
  x, y = _data()
  check_exact(clip_reference, model, x, y)


def test_trainable_variable_in_frozen_leaf_is_still_clipped(clip_reference):
  """A variable made trainable by hand in a layer whose flag is False: the model trains
  it, the layer lists none; it is clipped (vectorized, over that variable) not dropped."""
  model = frozen_parent_lora_model()
  key = model.get_layer("body").get_layer("block").key
  key.kernel.trainable = True
  assert not key.trainable and key.trainable_variables == []
  assert any(v is key.kernel for v in model.trainable_variables)
  units = {u.layer.name: u for u in plan_lib.plan(model)}
  assert units["key"].kind == plan_lib.VECTORIZED
  assert [v.path for v in units["key"].variables] == [key.kernel.path]
  x, y = _data(1)
  memo = {}   # each record's loop gradient once for both calls
  _, ref_norms = clip_reference(model, x, y, mse, 1.0, memo=memo)
  ref_grads, _ = clip_reference(model, x, y, mse, float(np.median(ref_norms)), memo=memo)
  grads, _ = clipping.clipped_grad_sum(model, x, y, mse, float(np.median(ref_norms)))
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g.numpy(), r, atol=1e-4 * max(1.0, np.abs(r).max()),
                               rtol=1e-4)


def test_frozen_parent_without_trainable_sublayers_is_skipped():
  model = frozen_parent_lora_model()
  body = model.get_layer("body")
  body.trainable = True    # (setting False on a layer already False does not recurse)
  body.trainable = False   # freezes the LoRA leaves again: only the head is trained
  assert [u.layer.name for u in plan_lib.plan(model)] == ["head"]


def test_sensitivity_through_dp_train_step():
  """Poisson sampling, add/remove one example: the real DP step, noise off."""
  model = frozen_parent_lora_model(dp.keras.DPModel)
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=keras.losses.MeanSquaredError())
  x, y = _data(2, n=20)
  report = sensitivity.check_sensitivity(model, x, y, policy="poisson", num_candidates=10)
  assert report.path == "fast"
  assert report.passed, str(report)
  assert report.recorded_sensitivity == 1.0
  assert 0.5 < report.measured_sensitivity <= 1.0 + 1e-5


def _bert_lora_model(keras_hub):
  """A small BertBackbone (dropout 0) with backbone.enable_lora(2) and a Dense head, fed
  token ids alone (segment ids 0, no padding)."""
  keras.utils.set_random_seed(4)
  backbone = keras_hub.models.BertBackbone(
      vocabulary_size=100, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64,
      max_sequence_length=16, dropout=0.0)
  backbone.enable_lora(2)
  _random_b(backbone, np.random.default_rng(1))   # every LoRA B of the backbone
  ids = keras.Input((SEQ,), dtype="int32")
  pooled = backbone({"token_ids": ids, "segment_ids": keras.ops.zeros_like(ids),
                     "padding_mask": keras.ops.ones_like(ids)})["pooled_output"]
  return keras.Model(ids, L.Dense(3)(pooled))


def test_keras_hub_backbone_enable_lora(clip_reference):
  # keras_hub is not a dependency of tf_dpiter (the test extra installs it): this runs where it
  # is importable; the plain-Keras surrogate above covers the same frozen-parent plan without.
  keras_hub = pytest.importorskip("keras_hub")
  model = _bert_lora_model(keras_hub)
  kinds = [u.kind for u in plan_lib.plan(model)]
  assert kinds == [plan_lib.GHOST] * 5   # query, value of 2 layers + the head
  rng = np.random.RandomState(5)
  x = rng.randint(1, 100, (N, SEQ)).astype("int32")
  y = rng.randn(N, 3).astype("float32")
  check_exact(clip_reference, model, x, y)
