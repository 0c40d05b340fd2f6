"""Cyclic Poisson and truncated Poisson samplers: the law they claim, and their ledger spec."""

import numpy as np
import pytest

from tf_dpiter.data import cyclic_poisson
from tf_dpiter.data import sampling
from tf_dpiter.data import truncated_poisson
from tf_dpiter.ledger import records


@pytest.mark.parametrize("n,groups,batch", [(300, 3, 20), (101, 4, 5), (50, 1, 10)])
def test_cyclic_poisson_keeps_participations_b_apart_with_probability_q(n, groups, batch):
  sampler = cyclic_poisson.CyclicPoissonSampler(n, groups, batch, seed=0)
  q = sampler.selection_probability
  assert q == pytest.approx(batch * groups / n)
  cycles = 400
  counts = np.zeros(n)
  last = np.full(n, -10 ** 9)
  for t in range(cycles * groups):
    idx = sampler.next_indices()
    assert np.all(t - last[idx] >= groups)                        # b-min-separation
    assert all(sampler.group_of(i) == t % groups for i in idx)    # only the active group
    last[idx] = t
    counts[idx] += 1
  # Each record had `cycles` turns, joining each with probability q: Binomial(cycles, q).
  sd = np.sqrt(cycles * q * (1 - q))
  assert np.all(np.abs(counts - cycles * q) <= 5 * sd + 1e-9)
  assert sampler.spec() == sampling.SamplingSpec(records.CYCLIC_POISSON, n, q, float(groups),
                                                 sampler)


def test_cyclic_dataset_continues_the_cycle_across_epochs_and_carries_its_spec():
  x = np.arange(40, dtype=np.float32)[:, None]
  ds = cyclic_poisson.cyclic_poisson_batches(x, expected_batch_size=5, num_groups=4,
                                             steps_per_epoch=6, seed=1)
  spec = sampling.get_sampling_spec(ds)
  assert spec.policy == records.CYCLIC_POISSON and spec.sample_size == 4.0
  seen = []
  for _ in range(2):
    for bx, mask in ds:
      seen.append(set(bx.numpy()[mask.numpy() > 0, 0].astype(int)))
  # 12 steps in two epochs: step t and t + 4 draw from the same group, never t and t + 1.
  groups = [set() for _ in range(4)]
  for t, s in enumerate(seen):
    groups[t % 4] |= s
  for a in range(4):
    for b in range(a + 1, 4):
      assert not groups[a] & groups[b]


def test_cyclic_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="num_groups"):
    cyclic_poisson.CyclicPoissonSampler(10, 11, 1)
  with pytest.raises(ValueError, match="expected_batch_size"):
    cyclic_poisson.CyclicPoissonSampler(10, 5, 3)        # q = 1.5


@pytest.mark.parametrize("cap", [3, 8, 40])
def test_truncated_poisson_caps_the_batch_and_is_poisson_below_the_cap(cap):
  n, batch, steps = 40, 6, 3000
  sampler = truncated_poisson.TruncatedPoissonSampler(n, batch, cap, seed=2)
  sizes = np.array([len(sampler.next_indices()) for _ in range(steps)])
  assert sizes.max() <= cap
  # The size is min(M, cap), M ~ Binomial(n, q): compare the mean with its exact value.
  from scipy import stats
  m = np.arange(n + 1)
  pmf = stats.binom.pmf(m, n, batch / n)
  mean = np.sum(np.minimum(m, cap) * pmf)
  var = np.sum(np.minimum(m, cap) ** 2 * pmf) - mean ** 2
  assert abs(sizes.mean() - mean) <= 5 * np.sqrt(var / steps)
  assert sampler.spec() == sampling.SamplingSpec(records.TRUNCATED_POISSON, n, batch / n,
                                                 float(cap))


def test_truncated_dataset_has_one_static_size():
  x = np.arange(30, dtype=np.float32)[:, None]
  ds = truncated_poisson.truncated_poisson_batches(x, x, expected_batch_size=10,
                                                   max_batch_size=8, steps_per_epoch=20, seed=3)
  for bx, by, mask in ds:
    assert bx.shape[0] == 8 and mask.numpy().sum() <= 8
    np.testing.assert_array_equal(bx.numpy(), by.numpy())
