"""Review R (session 31): the replicas' samples of `dp.data.distributed_poisson_batches` against
the public row bound the step enforces per replica (chunking.public_row_bound).

Under add/remove the clip shrink is taken from R = 2 default_max_batch_size(N, q) rows
(Casacuberta, Shoemate, Vadhan and Wagaman, "Widespread underestimation of sensitivity in
differentially private libraries and how to fix it", CCS 2022, Secs. 3-5), a replica's share
ceil(R / replicas); a replica's batch of more rows is refused (a trace-time PrivacyConfigError
under XLA, a run-time assertion in a graph). R is meant to cover a sample padded to twice its
padded size. distributed_poisson_batches gives each of the P replicas the Poisson sample of
its part of N / P records, padded to default_max_batch_size(N / P, q) and, past it, to twice
that: about 2 (E / P + 4 sqrt(E / P)) rows against the share R / P = 2 (E + 4 sqrt(E)) / P,
more for every P >= 2.

Figures by hand (MNIST, N = 60,000, B = 256, q = B / N, P = 2): the whole sample's padded
size ceil8(256 + 4 sqrt(256 (1 - q))) = ceil8(319.9) = 320, R = 640, a replica's share 320;
a part's E = 128, ceil8(128 + 4 sqrt(128 (1 - q))) = ceil8(173.2) = 176, twice: 352 > 320.
P(a part's sample > 176) = 2.3e-5 per step (binomial tail), so a 60-epoch run (14,040 steps,
2 parts) is refused mid-run with probability 0.48 (B = 1024: 0.10; N = 50,000, B = 512: 0.42).

Measured at 86d7223 and 6e0c606: poisson_batches_from_source(parts=(0,), num_parts=2,
seed=65595), the per-replica pipeline of distributed_poisson_batches, yields a first sample of
178 records padded to 352 rows; the share of the step's bound is 320. Fix: a per-replica bound
of 2 default_max_batch_size(ceil(N / P), q) for a sampler that pads per part (or pad the parts
past their size to the share R / P, or to the next multiple of 8).
Fixed since (session 31): a part's sample past its padded size is padded to the share R / P.
"""

import math
import warnings

import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.data import indexed_sampling
from tf_dpiter.ledger import policies

N, B, P, SEED = 60000, 256, 2, 65595


def _padded(n, q):
  """By hand: ceil(E + 4 sd) of Binomial(n, q), rounded up to a multiple of 8."""
  size = math.ceil(n * q + 4 * math.sqrt(n * q * (1 - q)))
  return 8 * math.ceil(size / 8)


def test_the_hand_figures():
  q = B / N
  assert _padded(N, q) == 320 and _padded(N // P, q) == 176
  assert policies.get("poisson").public_row_bound(N, q) == 2 * 320


def test_a_replicas_padded_sample_fits_the_per_replica_bound():
  q = B / N
  share = -(-policies.get("poisson").public_row_bound(N, q) // P)   # chunking's replica share
  x = np.zeros((N, 1), np.float32)
  y = np.zeros((N,), np.int32)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # a seed: not private (tests only)
    ds = indexed_sampling.poisson_batches_from_source(
        dp.data.ArraySource(x, y), B, steps_per_epoch=1, parts=(0,), num_parts=P, seed=SEED)
  _, _, weights = next(iter(ds))
  sampled, rows = int(np.sum(weights.numpy())), int(weights.shape[0])
  assert sampled > _padded(N // P, q)   # the seed's sample is past its part's padded size
  assert rows <= share, (sampled, rows, share)
