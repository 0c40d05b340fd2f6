"""Neighbouring-dataset checks of the real Keras train step (issue 11; McMahan et al. 2018, Appendix A).

For each sampling policy the ledger states a neighbouring relation and, per query, the
sensitivity of the clipped sum under it. Here the real train step (DPModel.train_on_batch:
per-example or per-microbatch clipping, vectorized or fast/ghost path) runs with noise 0,
SGD lr = 1 and normalize=False, so the weight change is exactly the pre-noise clipped sum.
Neighbouring batches are built under the stated relation:
  * add/remove (Poisson): one example present or absent, in the padded-mask representation
    the Poisson sampler yields (an absent example is a padding row of weight 0);
  * replace-one (fixed-size, shuffle): one example substituted at the same position of the
    batch (the permutation is public and n is fixed, so positions do not move);
with adversarial features and labels from a fixed-seed random search of 30 candidates.
The largest change of the clipped sum must be <= the ledger's sensitivity (1e-5 relative).
"""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tests.privacy import neighbours

# Nightly tier (-m slow, besides the marks below): Poisson add/remove runs by default
# once per clipping path and once per model kind (conv-fast, dense-vectorized).
SLOW_CASES = {
    "test_poisson_add_remove_one_example[conv-vectorized]",
    "test_poisson_add_remove_one_example[dense-fast]"}

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
B, PAD, N, CLIP, CANDIDATES = 8, 4, 1000, 1.0, 30


def _model(kind):
  keras.utils.set_random_seed(0)
  return dp.keras.DPSequential(neighbours.small_layers(kind))


def _compiled(kind, clipping, microbatches, policy):
  model = _model(kind)
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, microbatches, learning_rate=1.0,
                                     clipping=clipping, normalize=False)
  model.compile(optimizer=opt, loss=LOSS)
  if policy == "poisson":
    opt.set_sampling(N, B / N, "poisson", B)
  else:
    opt.set_sampling(N, B / N, policy, B)
  model(np.zeros([1, 6], "float32"))
  assert opt.resolve_clipping(model) == clipping
  return model


def _candidate(rng, x_ref):
  """An adversarial example: random features at scale 0.3 / 3 / 30, or a scaled negation
  of a reference example, with a random label."""
  if rng.rand() < 0.5:
    xc = rng.randn(6) * rng.choice([0.3, 3.0, 30.0])
  else:
    xc = -x_ref * rng.choice([1.0, 10.0])
  return xc.astype("float32"), rng.randint(0, 3)


def _ledger_sensitivity(model, relation):
  run = model.ledger.to_dict()["runs"][-1]
  assert run["relation"] == relation
  (query,) = run["queries"]
  assert query["l2_norm_clip"] == CLIP
  return query["sensitivity"]


def _base_batch(seed):
  rng = np.random.RandomState(seed)
  return (rng.randn(B, 6) * 3).astype("float32"), rng.randint(0, 3, B), rng


@pytest.mark.parametrize("clipping", ["vectorized", "fast"])
@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_poisson_add_remove_one_example(kind, clipping):
  model = _compiled(kind, clipping, None, "poisson")
  w0 = [w.copy() for w in model.get_weights()]
  x, y, rng = _base_batch(1)
  xp, yp, mask = neighbours.padded(x, y, PAD)
  base = neighbours.update_sum(model, w0, xp, yp, mask)
  bound = _ledger_sensitivity(model, "add_or_remove_one")
  assert bound == CLIP
  changes = []
  for j in range(B):   # remove an example of the batch: its row becomes padding
    m2 = mask.copy()
    m2[j] = 0.0
    changes.append(np.linalg.norm(neighbours.update_sum(model, w0, xp, yp, m2) - base))
  for _ in range(CANDIDATES):   # add an adversarial example in the first padding row
    xc, yc = _candidate(rng, x[rng.randint(B)])
    x2, y2, m2 = xp.copy(), yp.copy(), mask.copy()
    x2[B], y2[B], m2[B] = xc, yc, 1.0
    changes.append(np.linalg.norm(neighbours.update_sum(model, w0, x2, y2, m2) - base))
  assert max(changes) <= bound * (1 + 1e-5), max(changes)
  assert max(changes) > 0.99 * bound   # the clip binds: the bound is reached


_REPLACE_AXES = ([("fixed_size", "dense"), ("shuffle", "dense"), ("shuffle", "conv")],
                 [None, 3], ["vectorized", "fast"])


def _replace_cases():
  """Every (policy and model) x microbatches pair with the clipping path alternating: all
  pairs of the three axes in 6 runs (the other 6 of the product run with -m slow)."""
  policies_, micros, clippings = _REPLACE_AXES
  default = {(pk, m, clippings[(i + j) % 2]) for i, pk in enumerate(policies_)
             for j, m in enumerate(micros)}
  for pk in policies_:
    for m in micros:
      for c in clippings:
        yield pytest.param(*pk, m, c, marks=() if (pk, m, c) in default else pytest.mark.slow,
                           id=f"{pk[0]}-{pk[1]}-{m}-{c}")


def test_the_default_replace_one_runs_cover_every_pair():
  default = [tuple(p.values) for p in _replace_cases() if not p.marks]
  assert len(default) == 6
  product = [tuple(p.values) for p in _replace_cases()]
  for axes in (((0, 1), 2), ((0, 1), 3), (2, 3)):   # (policy, kind) counts as one axis
    def key(case, axes=axes):
      return tuple(case[a] if isinstance(a, int) else tuple(case[i] for i in a) for a in axes)
    assert {key(c) for c in default} == {key(c) for c in product}, axes


@pytest.mark.parametrize("policy,kind,microbatches,clipping", list(_replace_cases()))
def test_replace_one_example_at_its_position(policy, kind, microbatches, clipping):
  model = _compiled(kind, clipping, microbatches, policy)
  w0 = [w.copy() for w in model.get_weights()]
  x, y, rng = _base_batch(2)
  ones = np.ones(B, "float32")
  base = neighbours.update_sum(model, w0, x, y, ones)
  bound = _ledger_sensitivity(model, "replace_one")
  assert bound == 2 * CLIP
  run = model.ledger.to_dict()["runs"][-1]
  assert run["examples_per_record"] == (1 if microbatches is None else -(-B // microbatches))
  changes = []
  for _ in range(CANDIDATES):
    j = rng.randint(B)
    xc, yc = _candidate(rng, x[j])
    x2, y2 = x.copy(), y.copy()
    x2[j], y2[j] = xc, yc
    changes.append(np.linalg.norm(neighbours.update_sum(model, w0, x2, y2, ones) - base))
  assert max(changes) <= bound * (1 + 1e-5), max(changes)
  # replacing one example moves the sum by more than S: a sensitivity of S would be unsound
  assert max(changes) > 1.2 * CLIP, max(changes)


@pytest.mark.parametrize("policy", ["poisson", "full"])
def test_microbatches_refused_under_add_remove(policy):
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 1.0, 4)
  with pytest.raises(ValueError, match="num_microbatches=4 cannot be used.*shuffle"):
    opt.set_sampling(N, 1.0 if policy == "full" else B / N, policy, B)
  model = _model("dense")
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(CLIP, 1.0, 4), loss=LOSS)
  x, y, _ = _base_batch(3)
  # microbatches of 2 examples (4 of a batch of B = 8); 4 of 4 would be per-example clipping
  with pytest.raises(ValueError, match="sampling='poisson'.*num_microbatches=4.*'shuffle'"):
    model.fit(x, y, batch_size=B, sampling="poisson", verbose=0)
  with pytest.raises(ValueError, match="num_microbatches=4"):
    model.fit(dp.data.poisson_batches(x, y, expected_batch_size=B), verbose=0)
