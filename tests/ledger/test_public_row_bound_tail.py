"""The add/remove public row bound R leaves a refused batch negligibly likely (review R29).

Relation add/remove, unit example (a user under user_poisson, a record of a cyclic Poisson
group or a balls-in-bins step: each step's batch is at most a Poisson sample of the declared
n records at q). A step's batch of more than R rows (`SamplingPolicy.public_row_bound`) is
refused: a PrivacyConfigError when traced, a failed step under XLA. The batch size is
private, so the refusal is a data-dependent event; its probability p is charged nowhere: over
T steps it adds about T p (1 + e^eps) to delta. The larger of two neighbouring datasets has
n + 1 records, so p is P[Binomial(n + 1, q) > R], computed here EXACTLY and independently of
the library (scipy.stats.binom.sf, and a log-space sum of the pmf with math.lgamma), and must
be at most P_REFUSE = 1e-18.

Measured before (R = 2 default_max_batch_size(n, q), E + 4 sd rounded up to 8, twice):
n = 17002, q = 1.26e-4 (E = 2.14), R = 16: p = 1.57e-10 per step. Fixed: R is at least the
smallest multiple of 8 whose Chernoff bound exp(-(n + 1) KL((R + 1) / (n + 1) || q)) of that
tail is at most 1e-18 (policy_base.tail_row_bound): there R = 32, p below 1e-18; the old R is
kept where larger (every E above about 11, MNIST's 640 included).
"""

import math

import numpy as np
import pytest
from scipy import stats

from tf_dpiter.ledger import policies
from tf_dpiter.ledger import policy_base

P_REFUSE = 1e-18
ADD_REMOVE = ("poisson", "full", "cyclic_poisson", "truncated_poisson", "user_poisson",
              "balls_in_bins")

# (n, q): the review's worst point, tiny expected batches E = n q, MNIST, full batches.
GRID = ([(17002, 1.26e-4), (60000, 256 / 60000), (64, 8 / 64), (1, 1.0), (7, 1.0),
         (60000, 1.0), (1000, 0.5), (10**9, 0.5)]
        + [(n, e / n) for n in (10, 100, 1000, 17002, 10**5, 10**7)
           for e in (1e-3, 0.1, 0.5, 1.0, 2.1, 3.0, 5.0, 8.0, 10.0, 11.0, 16.0, 32.0)
           if e <= n])


def _old_bound(n, q):
  """R before review R29, by hand: twice ceil8(E + 4 sd) of Binomial(n, q), capped at ceil8(n)."""
  size = math.ceil(n * q + 4.0 * math.sqrt(n * q * (1.0 - q)))
  size = max(1, 8 * math.ceil(size / 8))
  return 2 * min(size, 8 * math.ceil(n / 8))


def _tail_lgamma(trials, q, rows):
  """P[Binomial(trials, q) > rows] by a sum of the pmf in log space (math.lgamma), rows above
  the mode: the terms fall, summed until one is below 1e-30 of the sum's first term."""
  if rows >= trials:
    return 0.0
  if q >= 1.0:
    return 1.0
  assert rows + 1 > trials * q
  lq, lp = math.log(q), math.log1p(-q)
  terms = []
  for k in range(rows + 1, trials + 1):
    log_pmf = (math.lgamma(trials + 1) - math.lgamma(k + 1) - math.lgamma(trials - k + 1)
               + k * lq + (trials - k) * lp)
    terms.append(math.exp(log_pmf))
    if terms[-1] <= 1e-30 * terms[0]:   # falling terms (0 from the first: all 0)
      break
  return math.fsum(terms)


def _exact_tail(n, q, rows):
  """P[Binomial(n + 1, q) > rows] (add/remove's larger neighbour), by scipy and by lgamma."""
  by_scipy = float(stats.binom.sf(rows, n + 1, q))
  by_sum = _tail_lgamma(n + 1, q, rows)
  assert by_sum == pytest.approx(by_scipy, rel=1e-6, abs=1e-300), (n, q, rows, by_scipy, by_sum)
  return by_scipy


def test_the_measured_figure_before():
  """The finding's figure: at n = 17002, q = 1.26e-4, the old R = 16 is passed with
  probability 1.5e-10 per step."""
  p = _exact_tail(17002, 1.26e-4, _old_bound(17002, 1.26e-4))
  assert _old_bound(17002, 1.26e-4) == 16
  assert 1.4e-10 < p < 1.6e-10, p


def test_a_batch_past_r_has_probability_at_most_p_refuse():
  """Fixed: R = max(the old R, the smallest multiple of 8 whose Chernoff bound of the tail is
  at most 1e-18); at n = 17002, q = 1.26e-4: R = 32, p = 1.5e-10 -> below 1e-18."""
  worst = max(((_exact_tail(n, q, policies.get("poisson").public_row_bound(n, q)), n, q)
               for n, q in GRID))
  assert worst[0] <= P_REFUSE, (
      f"P[Bin(n + 1, q) > R] = {worst[0]:.3g} at n = {worst[1]}, q = {worst[2]:.4g}")


def test_the_fixed_figure():
  rows = policies.get("poisson").public_row_bound(17002, 1.26e-4)
  assert rows == 32 and _exact_tail(17002, 1.26e-4, rows) <= P_REFUSE
  assert policy_base.P_REFUSE == P_REFUSE


def test_the_chernoff_bound_is_above_the_exact_tail_and_r_is_the_smallest():
  """binomial_tail_bound(N, q, r) >= P[Bin(N, q) > r] (exact); tail_row_bound's r meets
  P_REFUSE by that bound and r - 8 does not (the smallest multiple of 8)."""
  for n, q in GRID:
    r = policy_base.tail_row_bound(n, q)
    assert r % 8 == 0 and r >= 8, (n, q, r)
    for rows in (r - 8, r, r + 8):
      if rows >= 0:
        exact = _exact_tail(n, q, rows)
        bound = policy_base.binomial_tail_bound(n + 1, q, rows)
        assert bound >= exact, (n, q, rows, bound, exact)
    assert policy_base.binomial_tail_bound(n + 1, q, r) <= P_REFUSE, (n, q, r)
    if r > 8:
      assert policy_base.binomial_tail_bound(n + 1, q, r - 8) > P_REFUSE, (n, q, r)


def test_every_add_remove_policy_has_the_poisson_bound_and_never_a_smaller_one():
  for n, q in GRID:
    rows = policies.get("poisson").public_row_bound(n, q)
    assert rows >= _old_bound(n, q), (n, q, rows)
    assert rows % 8 == 0, (n, q, rows)
    for name in ADD_REMOVE:
      assert policies.get(name).public_row_bound(n, q) == rows, (name, n, q)
  for name in ("fixed_size", "shuffle"):   # replace-one: every batch has the same rows
    assert policies.get(name).public_row_bound(60000, 256 / 60000) is None


def test_the_mnist_plan_keeps_its_bound():
  """The main command's plan (n = 60000, B = 256, q = B / n): R = 640, as before, so its
  figures do not move; the R = 48 of set_sampling(64, 8 / 64) (tests pin it) stays too."""
  assert _old_bound(60000, 256 / 60000) == 640
  assert policies.get("poisson").public_row_bound(60000, 256 / 60000) == 640
  assert policies.get("poisson").public_row_bound(64, 8 / 64) == 48


# The per-replica share (found session 51, helper RB; fixed session 51). Relation add/remove,
# unit example. Under P replicas the step enforces a replica's bound (chunking.public_row_bound),
# while data.distributed_poisson_batches gives each replica the Poisson sample of its own part
# of at most ceil(n / P) records (indexed_sampling.part_range): a part of more rows fails the
# step, a data-dependent refusal of probability P[Binomial(ceil(n / P) + 1, q) > bound] per
# replica and step. Before, the bound was ceil(R / P): n = 1e7, E = 16, P = 8: R = 64, share 8,
# a part's mean 2: 2.4e-4 per replica and step (about 1.9e-3 per step); P = 2, E = 9.35:
# 4e-11. Fixed: R_P = max(ceil(R / P), tail_row_bound(ceil(n / P), q))
# (SamplingPolicy.replica_row_bound): 8 -> 32 there, p below 1e-18.
REPLICAS = (2, 3, 4, 8)


def _biggest_part(n, parts):
  """The records of the largest part (indexed_sampling.part_range: sizes differ by one)."""
  from tf_dpiter.data import indexed_sampling   # pylint: disable=g-import-not-at-top
  return max(hi - lo for lo, hi in (indexed_sampling.part_range(n, parts, p)
                                    for p in range(parts)))


def test_the_replica_share_figure_before():
  """The finding's figure: the old share ceil(R / P) = 8 at n = 1e7, E = 16, P = 8 is passed
  by a part's sample with probability 2.4e-4 per replica and step."""
  n, q, parts = 10**7, 16 / 10**7, 8
  rows = policies.get("poisson").public_row_bound(n, q)
  old_share = -(-rows // parts)
  p = _exact_tail(_biggest_part(n, parts), q, old_share)   # the part's larger neighbour: + 1
  assert (rows, old_share) == (64, 8)
  assert 2.3e-4 < p < 2.5e-4, p


def test_a_replicas_part_past_its_share_has_probability_at_most_p_refuse():
  """Fixed: each replica's exact tail P[Bin(ceil(n / P) + 1, q) > R_P] <= 1e-18 over the grid
  and P in 2, 3, 4, 8; at n = 1e7, E = 16, P = 8: R_P = 32 (was 8)."""
  n, q, parts = 10**7, 16 / 10**7, 8
  share = policies.get("poisson").replica_row_bound(n, q, parts)
  assert share == 32 and _exact_tail(_biggest_part(n, parts), q, share) <= P_REFUSE
  worst = (0.0,)
  for n, q in GRID:
    for parts in REPLICAS:
      if parts <= n:
        share = policies.get("poisson").replica_row_bound(n, q, parts)
        worst = max(worst, (_exact_tail(_biggest_part(n, parts), q, share), n, q, parts))
  assert worst[0] <= P_REFUSE, (
      f"P[Bin(n / P + 1, q) > R_P] = {worst[0]:.3g} at n, q, P = {worst[1:]}")


def test_the_replica_plans_cover_every_batch_not_refused():
  """The plan is a replica's, of R_P rows (chunking.public_rows plans public_row_bound's rows
  on each replica): R_P >= ceil(R / P), so the P plans hold P R_P >= R rows (every global
  batch Keras splits evenly, and every batch within the replicas' bounds); R_P = R at P = 1,
  and R_P is the same for every add/remove policy and for a declared LedgerSampling."""
  from tf_dpiter import ledger   # pylint: disable=g-import-not-at-top
  for n, q in GRID:
    rows = policies.get("poisson").public_row_bound(n, q)
    assert policies.get("poisson").replica_row_bound(n, q, 1) == rows
    for parts in REPLICAS:
      share = policies.get("poisson").replica_row_bound(n, q, parts)
      assert share >= -(-rows // parts) and parts * share >= rows, (n, q, parts, share, rows)
      for name in ADD_REMOVE:
        assert policies.get(name).replica_row_bound(n, q, parts) == share, (name, n, q)
  assert policies.get("shuffle").replica_row_bound(60000, 256 / 60000, 4) is None
  sampling = ledger.LedgerSampling(10**7, 16 / 10**7)
  key = sampling.row_bound_key
  assert sampling.replica_row_bound(8) == 32 and sampling.replica_row_bound(1) == 64
  assert sampling.row_bound_key == (64, (1, 64), (8, 32)) != key


def test_a_redeclaration_that_changes_only_a_replica_bound_asks_for_a_retrace():
  """n = 1e7: E = 16 and E = 15 both give R = 64, but R_8 goes 32 -> 24; a step traced under
  8 replicas read R_8, so row_bound_key (which step_sampling.declare compares to decide a
  retrace) changes; a step that read only R (one replica) keeps its key."""
  from tf_dpiter import ledger   # pylint: disable=g-import-not-at-top
  single = ledger.LedgerSampling(10**7, 16 / 10**7)
  replicated = ledger.LedgerSampling(10**7, 16 / 10**7)
  single.replica_row_bound(1)
  replicated.replica_row_bound(8)
  before = (single.row_bound_key, replicated.row_bound_key)
  for sampling in (single, replicated):
    sampling.set_sampling(10**7, 15 / 10**7, 0)
  assert single.public_row_bound == replicated.public_row_bound == 64
  assert single.row_bound_key == before[0]
  assert replicated.row_bound_key == (64, (8, 24)) != before[1]


def test_the_step_checks_and_plans_a_replica_with_r_p(monkeypatch):
  """chunking.public_row_bound (the step's per-replica check, train_step._within_row_bound,
  and the rows of its plan, chunking.public_rows) is R_P under P replicas and R under one."""
  import types   # pylint: disable=g-import-not-at-top
  import tensorflow as tf   # pylint: disable=g-import-not-at-top
  from tf_dpiter import ledger   # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.optimizer import chunking   # pylint: disable=g-import-not-at-top
  step = types.SimpleNamespace(sampling=ledger.LedgerSampling(10**7, 16 / 10**7))
  assert chunking.public_row_bound(step) == 64
  monkeypatch.setattr(tf.distribute, "get_strategy",
                      lambda: types.SimpleNamespace(num_replicas_in_sync=8))
  assert chunking.public_row_bound(step) == 32   # was ceil(64 / 8) = 8
  assert step.sampling.row_bound_key == (64, (8, 32))
