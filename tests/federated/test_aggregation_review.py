"""Review R (session 29): client-level DP federated averaging under adversarial clients.

Geyer et al., "Differentially private federated learning: a client level perspective"
(Algorithm 1): the server adds N(0, (sigma S)^2) to the sum of the round's clipped updates
and divides by the public m_t. One client may move that sum (noise off, measured in float64
from the float32 outputs) by at most its sensitivity under the ledger's relation: 2 S when it
is replaced (fixed-size sampling, replace one), S when it is added or removed (Poisson).
The clients' sampling must be the law the ledger records.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter import dp_query as dpq
from tf_dpiter import federated as F
from tf_dpiter.federated import flower_rounds
from tf_dpiter.federated.server import DPServer

D, K, M, S = 48, 10, 4, 1.0


def _adversaries(base):
  """Updates a client may send: huge (finite, norm overflows), NaN, inf, cancelling the
  others' sum, of norm just above S, tiny, and an honest one."""
  d = base.shape[1]
  one_inf = np.ones(d, np.float32)
  one_inf[-1] = np.inf
  return {
      "huge": np.full(d, 3e38, np.float32),
      "big": np.full(d, 1e20, np.float32),
      "nan": np.full(d, np.nan, np.float32),
      "inf": one_inf,
      "cancel": -base.sum(0),
      "just_above": (np.ones(d) / np.sqrt(d) * np.nextafter(np.float32(S), np.float32(2))
                     ).astype(np.float32),
      "tiny": np.full(d, 1e-30, np.float32),
      "honest": base[0] * np.float32(0.3),
  }


_SERVERS = {}


def _server(sampling, kind):
  """One real server per (sampling, kind), reused (one trace of its aggregation)."""
  if (sampling, kind) not in _SERVERS:
    if kind == "fixed":
      query = dpq.GaussianSumQuery(S, 0.0)
    else:  # the private adaptive clip with both noises off: its S is the initial clip here
      query = F.make_query("quantile", 0.0, M, l2_norm_clip=S, clipped_count_stddev=0.0)
    _SERVERS[sampling, kind] = DPServer(query, np.zeros(D, np.float32), K, M,
                                        sampling=sampling)
  return _SERVERS[sampling, kind]


def _round(records, sampling, kind="fixed"):
  """One round of the real server from its initial state, noise off; returns (the noised
  sum, the mechanism's float64 output, and the ledger: its last row is this round's)."""
  server = _server(sampling, kind)
  server.global_state = server.query.initial_global_state()
  server.begin_round(M)
  recs, mask, _ = server.screen(np.asarray(records, np.float32).reshape(-1, D))
  return np.asarray(server.aggregate(recs, mask, M), np.float64), server.ledger


def _recorded_sensitivity(ledger, relation_factor):
  """The sensitivity the ledger records for the round's sum (query columns sample_index,
  kind, clip, noise, sensitivity), checked to be the recorded clip times the relation's
  factor (2 replace one, 1 add or remove)."""
  samples, queries = ledger.get_arrays()
  rows = [r for r in queries if r[0] == len(samples) - 1 and r[2] == S]
  assert len(rows) == 1, queries
  assert rows[0][4] == relation_factor * rows[0][2], rows[0]
  return float(rows[0][4])


BASE = (np.random.default_rng(7).normal(size=(M - 1, D)) * 5).astype(np.float32)
NAMES = sorted(_adversaries(BASE))


@pytest.mark.parametrize("kind", ["fixed", pytest.param("quantile", marks=pytest.mark.slow)])
def test_replacing_one_client_moves_the_sum_by_at_most_2S(kind):
  adv = _adversaries(BASE)
  sums = {n: _round(np.vstack([BASE, a]), "fixed_size", kind) for n, a in adv.items()}
  bound = _recorded_sensitivity(sums[NAMES[0]][1], 2.0)
  worst = max(np.linalg.norm(sums[a][0] - sums[b][0]) for a in NAMES for b in NAMES)
  assert np.isfinite(worst)
  assert worst <= bound, (kind, worst, bound)


# 07f4c0a: adding the 'honest' client (norm ~10, clipped to S) moved the float32 sum by
# 1.0000000779 S (its own clip's float32 rounding, fl(c x), c = fl(S / ||x||)). Now the server
# clips, sums and noises in float64 with the clip shrunk for K rows (server module docstring).
@pytest.mark.parametrize("kind", ["fixed", pytest.param("quantile", marks=pytest.mark.slow)])
def test_adding_one_client_moves_the_sum_by_at_most_S(kind):
  without, ledger = _round(BASE, "poisson", kind)
  bound = _recorded_sensitivity(ledger, 1.0)
  for name, a in _adversaries(BASE).items():
    with_it, _ = _round(np.vstack([BASE, a]), "poisson", kind)
    moved = np.linalg.norm(with_it - without)
    assert np.isfinite(moved) and moved <= bound, (kind, name, moved, bound)


def test_ledger_records_the_rounds_sampling():
  # sample columns: population_size, selection_probability, sample_size, policy, ...
  for sampling, size in (("fixed_size", M), ("poisson", 0)):
    _, ledger = _round(BASE, sampling)
    before = int(ledger.sample_count)
    _, ledger = _round(BASE, sampling)
    samples, _ = ledger.get_arrays()
    assert len(samples) == before + 1
    assert tuple(samples[-1][:3]) == (K, M / K, size)


def test_a_retried_round_draws_new_noise_and_is_charged_again():
  query = dpq.GaussianSumQuery(S, 1.0)
  server = DPServer(query, np.zeros(D, np.float32), K, M, sampling="fixed_size")
  server.begin_round(M)
  recs, mask, _ = server.screen(np.vstack([BASE, BASE[:1]]))
  first = np.asarray(server.apply(recs, mask, M))
  second = np.asarray(server.apply(recs, mask, M))
  assert np.all(first != second)           # every coordinate's noise differs
  assert int(server.ledger.sample_count) == 2


def test_flower_rounds_sum_one_reply_per_sampled_client():
  """A round samples m_t clients; the ledger charges m_t clipped clients. A duplicated reply
  or one from a client not sampled must not be summed (07f4c0a: three replies for one sampled
  client summed, w moved 3.0 S; 2a39004: refused; now the sampled client's first reply is
  summed once, the others counted as rejected)."""
  model = F.MLP((4, 3), use_bias=False)
  params = [np.zeros(s, np.float32) for s in model.shapes]
  rounds = flower_rounds.DPRounds(model, dpq.GaussianSumQuery(S, 0.0), params, num_clients=4,
                                  clients_per_round=1, noise_multiplier=None,
                                  fixed_epsilon=None, max_delta=None, fixed_delta=None,
                                  max_epsilon=None, server_learning_rate=1.0,
                                  server_momentum=0.0, seed=1)
  picked = rounds.sample(1, [10, 11, 12, 13])
  assert len(picked) == 1
  other = next(n for n in [10, 11, 12, 13] if n not in picked)
  reply = [np.full(s, 1.0, np.float32) for s in model.shapes]    # norm sqrt(12) > S
  info = rounds.aggregate(1, [(picked[0], reply), (picked[0], reply), (other, reply)], 0)
  assert info["returned"] == 1 and info["rejected"] == 2
  assert int(rounds.server.ledger.sample_count) == 1
  moved = np.linalg.norm(np.asarray(rounds.server.weights, np.float64))
  assert moved <= S, f"one sampled client moved w by {moved} > S = {S}"
  # independent value: the one clipped reply, S * ones / sqrt(12), divided by m_t = 1
  np.testing.assert_allclose(np.asarray(rounds.server.weights, np.float64),
                             np.full(model.num_params, S / np.sqrt(12.0)), rtol=1e-5)


class _GridGenerator:
  """Stands in for the sampling generator: records the dtype asked for."""

  def __init__(self):
    self.dtypes = []

  def uniform(self, shape, dtype=tf.float32, **_):
    self.dtypes.append(tf.as_dtype(dtype))
    return tf.random.Generator.from_seed(3).uniform(shape, dtype=dtype)


def _grid_law(dtype, q):
  """P(u < fl(q)) for TensorFlow's uniform of `dtype`: u = j 2^-p (p = 23 or 52 mantissa
  bits), j uniform: ceil(fl(q) 2^p) / 2^p, exactly (Python ints)."""
  from fractions import Fraction
  p = {tf.float32: 23, tf.float64: 52}[dtype]
  t = Fraction(float(np.asarray(q, dtype.as_numpy_dtype)))
  j = -((-t * 2 ** p) // 1)
  return Fraction(j, 2 ** p)


def test_poisson_client_sampling_rate_is_the_ledgers_q():
  """DPFedAvg's Poisson clients: each joins iff u < m/K. With float32 u (2^-23 grid) the
  inclusion probability is ceil(fl32(q) 2^23) / 2^23: for m = 3, K = 10, 0.30000007153 (7.2e-8
  above the q = 0.3 the ledger records; the graph Poisson sampler of tf_dpiter.data compares
  float64 uniforms, P = q up to 2^-52). 07f4c0a drew float32 keys; now float64
  (server.sample_clients)."""
  from fractions import Fraction
  gen = _GridGenerator()
  sim = object.__new__(F.DPFedAvg)
  sim.num_clients, sim.sampling, sim._sample_gen = 10, "poisson", gen
  F.DPFedAvg._sample_clients(sim, 3)
  (dtype,) = gen.dtypes
  excess = _grid_law(dtype, 3 / 10) - Fraction(3, 10)
  assert 0 <= excess <= Fraction(1, 2 ** 52), float(excess)


def test_fixed_size_client_sampling_has_no_tied_keys():
  """Fixed-size sampling takes the m smallest of K uniform keys (argsort): tied keys are
  ordered by client index, so a tie at the m-th place always favours the lower id and the
  m-subset is not uniform. On a float32 grid (2^23 values) K = 1000 keys tie with probability
  about K^2 / 2^24 = 0.06; on a float64 grid about 1e-10 (07f4c0a: float32; now float64 and
  a tie redrawn, server.sample_clients)."""
  gen = _GridGenerator()
  sim = object.__new__(F.DPFedAvg)
  sim.num_clients, sim.sampling, sim._sample_gen = 1000, "fixed_size", gen
  F.DPFedAvg._sample_clients(sim, 10)
  (dtype,) = gen.dtypes
  bits = {tf.float32: 23, tf.float64: 52}[dtype]
  k = sim.num_clients
  p_tie = 1.0 - np.prod(1.0 - np.arange(k) / 2.0 ** bits)
  assert p_tie <= 1e-9, p_tie


class _TiedFirst:
  """A generator whose first draw has two tied keys, the next ones distinct."""

  def __init__(self):
    self.calls = 0

  def uniform(self, shape, dtype=tf.float32, **_):
    self.calls += 1
    keys = np.linspace(0.1, 0.9, shape[0])
    if self.calls == 1:
      keys[1] = keys[0]
    return tf.constant(keys[::-1].copy(), dtype)


def test_fixed_size_sampling_redraws_tied_keys():
  """A tie is never resolved by id: the keys are drawn again (server.sample_clients)."""
  from tf_dpiter.federated import server as server_lib
  gen = _TiedFirst()
  ids = server_lib.sample_clients(gen, 5, 2, "fixed_size").numpy()
  assert gen.calls == 2
  assert list(ids) == [4, 3]          # the two smallest of the second, untied draw
