"""A sensitivity check anyone can run on their own DP model (McMahan et al. 2018, Appendix A).

`check_sensitivity(model, x, y)` measures the largest change one example makes to the
pre-noise clipped sum of the model's real train step (a copy with noise 0 and SGD at rate 1,
float32) over neighbouring batches of the policy's relation (add/remove: the row becomes
weight-0 padding; replace: candidates from a small random search), compares it with the
recorded sensitivity, and names every layer whose outputs for the *other* examples moved
(`keras.internals.batch_independence`). The measured change is a lower bound on the worst
case: a ratio above 1 is a proven violation.
"""

import dataclasses
from typing import Tuple
import warnings

import keras
import numpy as np
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.optimizer import optimizers
from tf_dpiter.keras.optimizer.dp_config import NO_NOISE_WARNING
from tf_dpiter.keras.internals.batch_independence import batch_mixing_layers  # pylint: disable=unused-import

ADD_OR_REMOVE = "add_or_remove_one"


@dataclasses.dataclass(frozen=True)
class SensitivityReport:
  """Result of `check_sensitivity`; `passed` is measured <= recorded (1 + rtol).

  Attributes:
    relation: the neighbouring relation checked.
    path: the clipping path ("fast" or "vectorized").
    recorded_sensitivity: the sensitivity the ledger records.
    measured_sensitivity: the largest change of the clipped sum measured over neighbouring batches.
    worst_change: the neighbouring change that gave it.
    batch_mixing_layers: the layers whose outputs for one example depend on the others.
    passed: measured <= recorded (1 + rtol).
  """
  relation: str
  path: str
  recorded_sensitivity: float
  measured_sensitivity: float
  worst_change: str
  batch_mixing_layers: Tuple[str, ...]
  passed: bool

  @property
  def ratio(self):
    """measured / recorded sensitivity (a float; at most 1 when the claim holds)."""
    return self.measured_sensitivity / self.recorded_sensitivity

  def __str__(self):
    verdict = "OK" if self.passed else "VIOLATION"
    lines = [f"{verdict}: measured sensitivity {self.measured_sensitivity:.6g} vs recorded "
             f"{self.recorded_sensitivity:.6g} ({self.ratio:.3f}x) under {self.relation}, "
             f"{self.path} clipping path; worst: {self.worst_change}"]
    if self.batch_mixing_layers:
      lines.append("  layers whose outputs for one example depend on the others: "
                   + ", ".join(self.batch_mixing_layers))
    return "\n".join(lines)


def _dp_copy(model, policy, n, batch):
  """A copy of `model` under a noise-free DP-SGD optimizer with the same clipping settings."""
  from tf_dpiter import keras as dpk  # pylint: disable=g-import-not-at-top
  opt = model.optimizer
  if not hasattr(opt, "l2_norm_clip") or opt.l2_norm_clip is None:
    raise PrivacyConfigError("check_sensitivity needs a model compiled with a tf_dpiter DP optimizer "
                             f"built from l2_norm_clip and noise_multiplier, got {opt!r}")
  # The copy shares the model's layers (and so its weights, which the caller restores): no
  # re-serialization of user layers, and the model's own optimizer and ledger stay untouched.
  try:
    copy = keras.models.clone_model(model, clone_function=lambda layer: layer)
  except (ValueError, TypeError) as e:
    raise PrivacyConfigError(f"check_sensitivity needs a functional or Sequential model; "
                             f"{type(model).__name__} could not be rebuilt: {e}") from None
  if not isinstance(copy, type(model)):   # clone_model rebuilds a plain Keras model
    copy = dpk.make_private(copy)
  # z = 0 on purpose (the probe measures the clipped sum): the no-noise warning is for users.
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=NO_NOISE_WARNING, category=UserWarning)
    test_opt = _recording_sgd_class(dpk)(
        opt.l2_norm_clip, 0.0, opt.num_microbatches, learning_rate=1.0, clipping=opt.clipping,
        normalize=False, max_physical_batch_size=opt.max_physical_batch_size)
  copy.compile(optimizer=test_opt, loss=model.loss,
               jit_compile=bool(getattr(model, "jit_compile", False)))
  test_opt.set_sampling(n, batch / n, policy, batch)
  test_opt.make_records(copy.trainable_variables)
  return copy, test_opt


def _recording_sgd_class(dpk):
  """DP SGD that keeps the last private gradients it applied, in float32: under a 16-bit
  variable policy the weights would blur the measured sum by about 2^-8."""

  class RecordingSGD(dpk.DPKerasSGDOptimizer):  # pylint: disable=missing-class-docstring
    # shares the model's variables on purpose and puts them back: no claim on them
    # (keras.optimizer.optimizers.claim_variables)
    _dp_unclaimed_variables = True
    # and checks no weight fingerprint (weight_fingerprints.DEFERRED)
    _dp_fingerprints_deferred = True

    def make_records(self, variables):
      with tf.init_scope():
        self._last_grads = [tf.Variable(tf.zeros(v.shape, optimizers.wide_template([v])[0].dtype),
                                        trainable=False) for v in variables]

    def apply_private_gradients(self, grads, trainable_variables):
      assigns = [r.assign(tf.cast(g, r.dtype)) for r, g in zip(self._last_grads, grads)]
      with tf.control_dependencies(assigns):
        return super().apply_private_gradients(grads, trainable_variables)

    def last_sum(self):
      return np.concatenate([np.asarray(r.numpy(), np.float64).ravel() for r in self._last_grads])

  return RecordingSGD


def _clipped_sum(model, w0, x, y, weights):
  model.set_weights(w0)
  model.train_on_batch(x, y, sample_weight=weights)
  return model.optimizer.last_sum()


def _candidates(rng, x, y, count, id_range=None):
  """(features, label, description) of adversarial examples from a small random search.

  Float features: another example, Gaussian noise at 0.1 to 100 times the features' standard
  deviation, a negated example. Integer or boolean features (token ids, category codes), which
  the model may index with (an Embedding's gather fails on an id outside its table): another
  example, uniform ids and one id repeated over the row, all drawn in `id_range`, the
  inclusive (lowest, highest) value observed (default: x's own).
  """
  out = []
  labels = np.unique(y)
  discrete = np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_
  if discrete:
    lo, hi = (int(np.min(x)), int(np.max(x))) if id_range is None else id_range
  for i in range(count):
    kind = i % 3
    if kind == 0:
      xc, what = x[rng.randint(len(x))], "another example"
    elif discrete and kind == 1:
      xc, what = rng.randint(lo, hi + 1, size=x.shape[1:]), f"uniform ids in [{lo}, {hi}]"
    elif discrete:
      v = rng.randint(lo, hi + 1)
      xc, what = np.full(x.shape[1:], v), f"id {v} repeated"
    elif kind == 1:
      scale = rng.choice([0.1, 10.0, 100.0])
      xc, what = rng.randn(*x.shape[1:]) * scale * (np.std(x) + 1e-12), f"noise x{scale:g}"
    else:
      scale = rng.choice([1.0, 10.0])
      xc, what = -x[rng.randint(len(x))] * scale, f"negated example x{scale:g}"
    out.append((np.asarray(xc).astype(x.dtype), labels[rng.randint(len(labels))], what))
  return out


def _neighbour_changes(copy, w0, x, y, relation, rng, num_candidates, id_range=None):
  """[(change norm, description)] over neighbouring batches of (x, y) under `relation`
  (`id_range`: integer features' observed range, for `_candidates`)."""
  b = len(x)
  changes = []
  if relation == ADD_OR_REMOVE:
    xp = np.concatenate([x, np.zeros_like(x[:1])])
    yp = np.concatenate([y, y[:1]])
    mask = np.concatenate([np.ones(b), [0.0]]).astype("float32")
    base = _clipped_sum(copy, w0, xp, yp, mask)
    for j in range(b):
      m2 = mask.copy()
      m2[j] = 0.0
      changes.append((np.linalg.norm(_clipped_sum(copy, w0, xp, yp, m2) - base),
                      f"example {j} removed"))
    for xc, yc, what in _candidates(rng, x, y, num_candidates, id_range):
      x2, y2, m2 = xp.copy(), yp.copy(), mask.copy()
      x2[b], y2[b], m2[b] = xc, yc, 1.0
      changes.append((np.linalg.norm(_clipped_sum(copy, w0, x2, y2, m2) - base),
                      f"added {what} with label {yc}"))
    return changes
  ones = np.ones(b, "float32")
  base = _clipped_sum(copy, w0, x, y, ones)
  for xc, yc, what in _candidates(rng, x, y, num_candidates, id_range):
    j = rng.randint(b)
    x2, y2 = x.copy(), y.copy()
    x2[j], y2[j] = xc, yc
    changes.append((np.linalg.norm(_clipped_sum(copy, w0, x2, y2, ones) - base),
                    f"example {j} replaced by {what} with label {yc}"))
  return changes


def check_sensitivity(model, x, y, policy=None, batch_size=8, num_candidates=30, seed=0,
                      rtol=1e-5):
  """Measures one example's largest effect on the real clipped sum against the ledger's.

  Args:
    model: a compiled tf_dpiter DP model (DPSequential, DPModel, make_private(...)).
    x: the features, an array; the first `batch_size` examples form the base batch. Integer
      features (token ids) get candidates inside the range of ids observed in x.
    y: their labels.
    policy: "poisson" (add/remove one) | "fixed_size" | "shuffle" (replace one); default: the
      optimizer's current sampling policy, else "poisson".
    batch_size: the size of the base batch.
    num_candidates: the adversarial candidates of the random search.
    seed: the random search's seed.
    rtol: relative tolerance of the comparison.

  Returns:
    SensitivityReport (`passed`, the worst change, the layers that mix examples).

  Raises:
    ParameterValueError: the model has no tf_dpiter DP optimizer, or bad arguments.
  """
  from tf_dpiter import ledger as ledger_lib  # pylint: disable=g-import-not-at-top
  x, y = np.asarray(x), np.asarray(y)
  validation.check_integer("batch_size", batch_size, 1, len(x))
  policy = policy or getattr(model.optimizer, "sampling_policy", None) or "poisson"
  relation = ledger_lib.relation_for_policy(policy)
  copy, opt = _dp_copy(model, policy, max(len(x), batch_size + 1), batch_size)
  path = opt.private_step.resolve_clipping(copy)
  w0 = [np.array(w) for w in copy.get_weights()]
  # integer features (token ids): candidates stay inside the ids observed in all of x
  ids = (int(np.min(x)), int(np.max(x))) if np.issubdtype(x.dtype, np.integer) else None
  try:
    changes = _neighbour_changes(copy, w0, x[:batch_size], y[:batch_size], relation,
                                 np.random.RandomState(seed), num_candidates, ids)
  finally:
    copy.set_weights(w0)      # the shared weights are the model's: put them back
  run = copy.ledger.to_dict()["runs"][-1]
  recorded = max(q["sensitivity"] for q in run["queries"])
  worst, what = max(changes, key=lambda c: c[0])
  return SensitivityReport(relation, path, float(recorded), float(worst), what,
                           batch_mixing_layers(model, x[:batch_size]),
                           bool(worst <= recorded * (1 + rtol)))
