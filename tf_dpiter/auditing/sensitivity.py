"""A sensitivity check anyone can run on their own DP model (issue 12; seed 002, Appendix A).

`check_sensitivity(model, x, y)` measures what one example can do to the pre-noise clipped
sum of the model's *real* train step and compares it with the sensitivity the ledger records:
  1. a copy of the model is compiled with the same DP settings (clip, microbatches, clipping
     path) but noise 0, SGD with learning rate 1 and no division, so one `train_on_batch`
     moves the weights by exactly the clipped sum;
  2. neighbouring batches are built under the relation of the sampling policy: add/remove one
     example (its row becomes padding of weight 0, as Poisson batches are padded) or replace
     one example at its position (fixed-size, shuffle), with candidates from a small random
     search: other examples of `x`, scaled noise, scaled negations, random labels;
  3. the largest change of the sum is compared with the recorded sensitivity;
  4. a batch-independence probe runs the model's layers on the batch with one example
     perturbed and names every layer whose outputs for the *other* examples moved.
What the probe cannot see: mixing that only happens in training mode through randomness
(it runs in inference mode), or that only shows on inputs far from `x`. The measured change
is a lower bound on the true worst case; a ratio above 1 is a proven violation.
"""

import dataclasses
from typing import Tuple

import keras
import numpy as np

ADD_OR_REMOVE = "add_or_remove_one"


@dataclasses.dataclass(frozen=True)
class SensitivityReport:
  """Result of `check_sensitivity`; `passed` is measured <= recorded (1 + rtol)."""
  relation: str
  path: str
  recorded_sensitivity: float
  measured_sensitivity: float
  worst_change: str
  batch_mixing_layers: Tuple[str, ...]
  passed: bool

  @property
  def ratio(self):
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
    raise ValueError("check_sensitivity needs a model compiled with a tf_dpiter DP optimizer "
                     f"built from l2_norm_clip and noise_multiplier, got {opt!r}")
  # The copy shares the model's layers (and so its weights, which the caller restores): no
  # re-serialization of user layers, and the model's own optimizer and ledger stay untouched.
  try:
    copy = keras.models.clone_model(model, clone_function=lambda layer: layer)
  except (ValueError, TypeError) as e:
    raise ValueError(f"check_sensitivity needs a functional or Sequential model; "
                     f"{type(model).__name__} could not be rebuilt: {e}") from None
  if not isinstance(copy, type(model)):   # clone_model rebuilds a plain Keras model
    copy = dpk.make_private(copy)
  test_opt = dpk.DPKerasSGDOptimizer(opt.l2_norm_clip, 0.0, opt.num_microbatches,
                                     learning_rate=1.0, clipping=opt.clipping, normalize=False,
                                     max_physical_batch_size=opt.max_physical_batch_size)
  copy.compile(optimizer=test_opt, loss=model.loss)
  test_opt.set_sampling(n, batch / n, policy, batch)
  return copy, test_opt


def _clipped_sum(model, w0, x, y, weights):
  model.set_weights(w0)
  model.train_on_batch(x, y, sample_weight=weights)
  return np.concatenate([(np.asarray(a, np.float64) - np.asarray(b, np.float64)).ravel()
                         for a, b in zip(w0, model.get_weights())])


def _candidates(rng, x, y, count):
  """(features, label, description) of adversarial examples from a small random search."""
  out = []
  labels = np.unique(y)
  for i in range(count):
    kind = i % 3
    if kind == 0:
      xc, what = x[rng.randint(len(x))], "another example"
    elif kind == 1:
      scale = rng.choice([0.1, 10.0, 100.0])
      xc, what = rng.randn(*x.shape[1:]) * scale * (np.std(x) + 1e-12), f"noise x{scale:g}"
    else:
      scale = rng.choice([1.0, 10.0])
      xc, what = -x[rng.randint(len(x))] * scale, f"negated example x{scale:g}"
    out.append((xc.astype(x.dtype), labels[rng.randint(len(labels))], what))
  return out


def _neighbour_changes(copy, w0, x, y, relation, rng, num_candidates):
  """[(change norm, description)] over neighbouring batches of (x, y) under `relation`."""
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
    for xc, yc, what in _candidates(rng, x, y, num_candidates):
      x2, y2, m2 = xp.copy(), yp.copy(), mask.copy()
      x2[b], y2[b], m2[b] = xc, yc, 1.0
      changes.append((np.linalg.norm(_clipped_sum(copy, w0, x2, y2, m2) - base),
                      f"added {what} with label {yc}"))
    return changes
  ones = np.ones(b, "float32")
  base = _clipped_sum(copy, w0, x, y, ones)
  for xc, yc, what in _candidates(rng, x, y, num_candidates):
    j = rng.randint(b)
    x2, y2 = x.copy(), y.copy()
    x2[j], y2[j] = xc, yc
    changes.append((np.linalg.norm(_clipped_sum(copy, w0, x2, y2, ones) - base),
                    f"example {j} replaced by {what} with label {yc}"))
  return changes


def _rows_moved(a, b, n, atol):
  a, b = np.asarray(a), np.asarray(b)
  return bool(a.ndim and a.shape[0] == n and not np.allclose(a[:-1], b[:-1], atol=atol, rtol=0))


def batch_mixing_layers(model, x, atol=1e-6):
  """Names of the layers that make one example's activations depend on another example.

  Runs every layer's inputs and output (functional and Sequential models) on `x` and on `x`
  with its last example replaced by noise, in inference mode, and names each layer whose
  output rows for the *other* examples moved while its inputs' rows did not (the source of
  the mixing, not the layers downstream of it). A model whose layers cannot be probed one by
  one (subclassed) is probed as a whole: its own name is returned if it mixes.
  """
  x = np.asarray(x)
  x2 = x.copy()
  x2[-1] = np.random.RandomState(0).randn(*x.shape[1:]) * (np.std(x) + 1.0)
  n = len(x)
  try:
    layers = list(model.layers)
    ins = [keras.tree.flatten(layer.input) for layer in layers]
    probe = keras.Model(model.inputs, [layer.output for layer in layers] + sum(ins, []))
  except (AttributeError, ValueError):
    return (model.name,) if _rows_moved(model(x, training=False), model(x2, training=False),
                                        n, atol) else ()
  out1, out2 = probe(x, training=False), probe(x2, training=False)
  mixing, pos = [], len(layers)
  for i, layer in enumerate(layers):
    k = len(ins[i])
    inputs_moved = any(_rows_moved(out1[j], out2[j], n, atol) for j in range(pos, pos + k))
    pos += k
    if _rows_moved(out1[i], out2[i], n, atol) and not inputs_moved:
      mixing.append(layer.name)
  return tuple(mixing)


def check_sensitivity(model, x, y, policy=None, batch_size=8, num_candidates=30, seed=0,
                      rtol=1e-5):
  """Measures one example's largest effect on the real clipped sum against the ledger's.

  Args:
    model: a compiled tf_dpiter DP model (DPSequential, DPModel, make_private(...)).
    x, y: arrays; the first `batch_size` examples form the base batch.
    policy: "poisson" (add/remove one) | "fixed_size" | "shuffle" (replace one); default: the
      optimizer's current sampling policy, else "poisson".
    batch_size, num_candidates, seed: the base batch and the random search.
    rtol: relative tolerance of the comparison.
  Returns:
    SensitivityReport (`passed`, the worst change, the layers that mix examples).
  Raises:
    ValueError: the model has no tf_dpiter DP optimizer, or bad arguments.
  """
  from tf_dpiter import ledger as ledger_lib  # pylint: disable=g-import-not-at-top
  x, y = np.asarray(x), np.asarray(y)
  if not 1 <= batch_size <= len(x):
    raise ValueError(f"batch_size must be in [1, len(x)={len(x)}], got {batch_size!r}")
  policy = policy or getattr(model.optimizer, "sampling_policy", None) or "poisson"
  relation = ledger_lib.relation_for_policy(policy)
  copy, opt = _dp_copy(model, policy, max(len(x), batch_size + 1), batch_size)
  path = opt.resolve_clipping(copy)
  w0 = [np.array(w) for w in copy.get_weights()]
  try:
    changes = _neighbour_changes(copy, w0, x[:batch_size], y[:batch_size], relation,
                                 np.random.RandomState(seed), num_candidates)
  finally:
    copy.set_weights(w0)      # the shared weights are the model's: put them back
  run = copy.ledger.to_dict()["runs"][-1]
  recorded = max(q["sensitivity"] for q in run["queries"])
  worst, what = max(changes, key=lambda c: c[0])
  return SensitivityReport(relation, path, float(recorded), float(worst), what,
                           batch_mixing_layers(model, x[:batch_size]),
                           bool(worst <= recorded * (1 + rtol)))
