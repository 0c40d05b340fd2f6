"""Review R (session 31): a second `fit` on the same model at a larger Poisson q, against the
public row bound of the clip shrink (chunking.public_row_bound).

Under add/remove the step takes its clip shrink from R = 2 default_max_batch_size(N, q) rows
(Casacuberta, Shoemate, Vadhan and Wagaman, "Widespread underestimation of sensitivity in
differentially private libraries and how to fix it", CCS 2022, Secs. 3-5: a shrink that does
not depend on the rows present), read when the step is traced, and a batch of more rows is
refused. `set_sampling` asks for a retrace only when the policy or the record unit changes, so
a second fit that declares a larger q (a larger batch_size over the same declared N) keeps the
first fit's R.

Measured at 86d7223 (Dense(4 -> 2), N = 1,000 declared, noise 1.1): fit(batch_size=8) for 5
steps (R = 48), then fit(batch_size=400) on the same model: in a graph (jit_compile=False) the
second fit's first step fails with InvalidArgumentError from assert_less_equal (`rows` must
be at most 48) and the ledger holds 6 samples for the 5 released updates; under
jit_compile=True the padded batch's new shape retraces the step and the second fit takes its
3 steps (8 samples, finite weights). Refusing is safe (nothing is released past the bound),
but the refusal is an opaque run-time assertion for a legitimate declared sampling. Fixed at
6e0c606 (set_sampling returns True when the declaration changes the bound: fit retraces):
both cases pass.
"""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp

N = 1000


def _fits(jit):
  """(ledger samples, all weights finite) after fit(batch 8, 5 steps) then fit(batch 400, 3)."""
  keras.utils.set_random_seed(0)
  x = np.random.default_rng(0).random((N, 4), np.float32)
  y = (x.sum(axis=1) > 2).astype("int32")
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=jit)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=5, population_size=N, verbose=0)
    assert int(model.ledger.sample_count) == 5
    model.fit(x, y, batch_size=400, epochs=1, steps_per_epoch=3, population_size=N, verbose=0)
  return (int(model.ledger.sample_count),
          all(np.isfinite(w).all() for w in model.get_weights()))


@pytest.mark.parametrize("jit", [
    False,   # 86d7223: InvalidArgumentError (`rows` at most 48), 6 samples; fixed at 6e0c606
    pytest.param(True, marks=pytest.mark.slow)])
def test_a_second_fit_at_a_larger_q_trains_and_charges_its_steps(jit):
  assert _fits(jit) == (8, True)
