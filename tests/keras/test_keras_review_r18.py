"""Review R18 (session 47) of session 46's `keras_internals.closure_layers` (review R16's
finding 1 fixed by following a dict's values, an object's `__dict__` and a callable object's
`__call__`): holders of a random layer that walk does not reach.

Relation and unit (R15's and R16's harness, tests/keras/test_session44_changes_review.py):
add/remove one example under Poisson sampling declared with `optimizer.set_sampling(N, q,
"poisson")`, C = 1, lr 1, noise off; record i the one-hot row 10 e_i, a seeded Dropout(0.5)
outside `model=` that the custom loop's loss runs, before a Dense(1, no bias, zeros), label
1e4. One record may move the private average by at most C / (q N) = 0.125. An unkeyed seeded
Dropout draws its masks by row position: two runs on D draw the same masks and removing
record 0 shifts every other record's mask (||g(D) - g(D')|| = 0.3535, seed 1).

Finding 1 (closure_layers). A layer held by an object without a `__dict__` (a class with
`__slots__`: `@dataclasses.dataclass(slots=True)`, attrs' default `@define`), or in a set or
a collections.deque, is not reached, and neither is a callable `__slots__` object's
`__call__`: the Dropout stays unkeyed, ||g(D) - g(D')|| = 0.3535 against C / (q N) = 0.125
(measured eager and traced, 2026-12-02). Fixed: closure_layers also reads an object's
`__slots__` (through their member descriptors: no user code runs) and follows a set's,
frozenset's and deque's items.
"""

import collections
import dataclasses
import functools
import warnings

import numpy as np
import pytest
import tensorflow as tf

from tests.keras.test_session44_changes_review import N, STEP, _loop   # R15's harness
from tf_dpiter.keras.internals import keras_internals

# Nightly tier (-m slow): the traced form of each holder and the eager form of the set and
# deque (the default tier keeps the slots object and the slots loss object eager).
SLOW_CASES = {"test_a_random_layer_held_without_a_dict_is_keyed[slots_method-traced]",
              "test_a_random_layer_held_without_a_dict_is_keyed[slots_loss_object-traced]",
              "test_a_random_layer_held_without_a_dict_is_keyed[set-eager]",
              "test_a_random_layer_held_without_a_dict_is_keyed[set-traced]",
              "test_a_random_layer_held_without_a_dict_is_keyed[deque-eager]",
              "test_a_random_layer_held_without_a_dict_is_keyed[deque-traced]"}


class _SlotsAugmenter:
  """A `__slots__` object holding the random layer (no `__dict__`)."""
  __slots__ = ("layer",)

  def __init__(self, layer):
    self.layer = layer

  def apply(self, t):
    return self.layer(t, training=True)


@dataclasses.dataclass(slots=True)
class _SlotsLosses:
  """A callable loss object without a `__dict__`: the per-example losses on the augmented
  batch."""
  model: object
  augment: object
  x: object
  y: object

  def __call__(self):
    h = self.augment(self.x, training=True)
    return tf.reduce_mean(tf.square(self.y - self.model(h, training=True)), axis=-1)


def _losses(holder, model, augment, x, y):
  """The loss function reaching `augment` through `holder`."""
  if holder == "slots_loss_object":
    return _SlotsLosses(model, augment, x, y)
  if holder == "slots_method":
    run = _SlotsAugmenter(augment).apply
  elif holder == "set":
    layers = {augment}
    run = lambda t: next(iter(layers))(t, training=True)   # noqa: E731
  else:
    layers = collections.deque([augment])
    run = lambda t: layers[0](t, training=True)   # noqa: E731

  def losses():
    return tf.reduce_mean(tf.square(y - model(run(x), training=True)), axis=-1)
  return losses


def _average(records, traced, holder):
  """(the private average (noise off) of one form (b) call on `records`, whether
  closure_layers reached the outside Dropout)."""
  model, augment, opt = _loop()
  x = tf.constant(10.0 * np.eye(N, dtype="float32")[list(records)])
  y = tf.constant(np.full((len(records), 1), 1e4, "float32"))
  losses = _losses(holder, model, augment, x, y)
  reached = any(layer is augment for layer in keras_internals.closure_layers(losses))
  step = functools.partial(opt.compute_private_gradients, losses, model.trainable_variables,
                           model=model)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # noise 0
    return -np.asarray((tf.function(step) if traced else step)()[0])[:, 0], reached


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("holder", ["slots_method", "slots_loss_object", "set", "deque"])
def test_a_random_layer_held_without_a_dict_is_keyed(holder, traced):
  """The outside layer is reached and keyed: two runs of one seed on D draw different masks
  (unkeyed, they follow the rows' positions; the neighbouring move is in the message)."""
  (on_d, reached), (again, _), (on_d_minus, _) = (
      _average(records, traced, holder) for records in (range(N), range(N), range(1, N)))
  moved = np.linalg.norm(on_d - on_d_minus)
  assert reached and not np.array_equal(on_d, again), (
      f"seeded masks by row position ({holder}, traced={traced}, reached={reached}): "
      f"||g(D) - g(D')|| = {moved:.4f} against C / (q N) = {STEP}")


# Cost (measured, not a privacy finding). An eager custom loop walks its loss at every
# compute_private_gradients call; since R16 the walk enters objects' attributes and dicts, so
# a loss bound to a trainer holding a tokenizer's 30,000-entry vocabulary and a list of 60,000
# example arrays visited all 90,000 values: 0.083 CPU s a walk (session 46), 0.18 with this
# review's `__slots__` reading before values that hold no layer (str, numbers, arrays,
# tensors) were passed over at once (0.011).

class _Tokenizer:
  def __init__(self):
    self.vocab = {f"tok{i}": i for i in range(30000)}


class _Trainer:
  def __init__(self):
    self.tokenizer, self.examples = _Tokenizer(), [np.zeros(8) for _ in range(60000)]

  def loss(self):
    return self


def test_values_that_hold_no_layer_are_not_inspected(monkeypatch):
  inspected = []
  attributes = keras_internals._attributes   # pylint: disable=protected-access
  monkeypatch.setattr(keras_internals, "_attributes",
                      lambda value: inspected.append(type(value).__name__) or attributes(value))
  assert keras_internals.closure_layers(_Trainer().loss) == []
  assert sorted(inspected) == ["_Tokenizer", "_Trainer"], len(inspected)
