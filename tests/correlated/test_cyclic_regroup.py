"""A later fit of a correlated-noise (BandMF) run on cyclic Poisson must keep every example's
group: groups are a hash of the example's identity (its rows' bytes, dtype and shape, or its
example_ids), so the same examples given under other identities (labels cast int64 -> int32)
would be regrouped and an example could be eligible at steps 1 apart while the ledger charges
ceil(T / b) Poisson rounds under b-min-separation (Choquette-Choo et al. 2023, Theorem 4).
fit refuses identities the run did not have; the same arrays (a new dataset object) or a
subset of the examples continue it."""

import math
import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.data import sampling
from tf_dpiter.data.cyclic_poisson import cyclic_poisson_batches
from tf_dpiter.errors import PrivacyConfigError

B = 2          # num_groups = num_bands
N = 64
STEPS = 4      # per fit


def _run():
  keras.utils.set_random_seed(0)
  rng = np.random.RandomState(0)
  x = rng.randn(N, 6).astype("float32")
  y64 = rng.randint(0, 3, N).astype("int64")
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1, noise="band_mf",
                                     num_bands=B, num_steps=3 * STEPS)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  ds1 = cyclic_poisson_batches(x, y64, expected_batch_size=8, num_groups=B,
                               steps_per_epoch=STEPS - 1, seed=1)   # odd: fit 2 starts mid-cycle
  model.fit(ds1, epochs=1, verbose=0)
  return model, x, y64, ds1


def _eligible_steps(groups_per_fit, steps_per_fit):
  """For each example, the global steps at which its group is the sampled one."""
  out = [[] for _ in range(N)]
  t = 0
  for groups, steps in zip(groups_per_fit, steps_per_fit):
    for _ in range(steps):
      for i in range(N):
        if groups[i] == t % B:
          out[i].append(t)
      t += 1
  return out


def test_a_regrouping_second_fit_is_refused():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model, x, y64, ds1 = _run()
    ds2 = cyclic_poisson_batches(x, y64.astype("int32"), expected_batch_size=8,
                                 num_groups=B, steps_per_epoch=STEPS + 1, seed=2)
    # the premise of the refusal: under the new identities some example is regrouped
    s1, s2 = sampling.get_sampling_spec(ds1).sampler, sampling.get_sampling_spec(ds2).sampler
    eligible = _eligible_steps([[s1.group_of(i) for i in range(N)],
                                [s2.group_of(i) for i in range(N)]], [STEPS - 1, STEPS + 1])
    assert min(min(np.diff(e)) for e in eligible if len(e) > 1) < B
    with pytest.raises(PrivacyConfigError, match="identities"):
      model.fit(ds2, epochs=1, verbose=0)
    ids = cyclic_poisson_batches(x, y64, expected_batch_size=8, num_groups=B,
                                 steps_per_epoch=STEPS, seed=3, example_ids=np.arange(N))
    with pytest.raises(PrivacyConfigError, match="identities"):
      model.fit(ids, epochs=1, verbose=0)          # ids given now and not before: refused
  assert int(model.ledger.sample_count.numpy()) == STEPS - 1   # no step taken


def test_the_same_examples_or_fewer_continue_the_run():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model, x, y64, ds1 = _run()
    again = cyclic_poisson_batches(x.copy(), y64.copy(), expected_batch_size=8, num_groups=B,
                                   steps_per_epoch=STEPS + 1, seed=2)   # same identities
    model.fit(again, epochs=1, verbose=0)
    fewer = cyclic_poisson_batches(x[: N // 2], y64[: N // 2], expected_batch_size=4,
                                   num_groups=B, steps_per_epoch=STEPS, seed=4)
    model.fit(fewer, epochs=1, verbose=0)
  total = int(model.ledger.sample_count.numpy())
  assert total == 3 * STEPS
  s1, s2 = sampling.get_sampling_spec(ds1).sampler, sampling.get_sampling_spec(again).sampler
  s3 = sampling.get_sampling_spec(fewer).sampler
  groups3 = [s3.group_of(i) if i < N // 2 else -1 for i in range(N)]
  eligible = _eligible_steps([[s1.group_of(i) for i in range(N)],
                              [s2.group_of(i) for i in range(N)], groups3],
                             [STEPS - 1, STEPS + 1, STEPS])
  assert min(min(np.diff(e)) for e in eligible if len(e) > 1) >= B
  assert max(len(e) for e in eligible) <= math.ceil(total / B)
