"""Review R14 (session 45): client-level DP federated averaging under adversarial clients.

Geyer et al., "Differentially private federated learning: a client level perspective"
(Algorithm 1). Relation: one client's data replaced (fixed-size sampling of m_t of K, the
ledger's policy fixed_size; the sum moves by at most 2 S) or one client added or removed
(Poisson, at most S); the unit is the client. Each case measures what one client can do,
noise off where a sensitivity is measured.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter import dp_query as dpq
from tf_dpiter import federated as F
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.federated import flower_rounds

S = 0.05


def _padded_round(first_example):
  """One fixed-size round of all 4 clients of a ragged partition (sizes 3, 2, 1, 1: the last
  three rows of `client_indices` are padded with example 0, client 0's), noise off.

  Every example is the same point with the same label, so the four clipped updates point the
  same way. Returns (the raw client updates [4, d], the mechanism's float64 output [d]).
  """
  model = F.MLP((4, 3))
  x = np.tile(np.random.default_rng(0).normal(size=(1, 4)), (7, 1)).astype(np.float32)
  if first_example is not None:
    x[0] = first_example
  fd = F.FederatedData.from_client_lists(x, np.zeros(7, np.int32),
                                         [[0, 1, 2], [3, 4], [5], [6]])
  alg = F.DPFedAvg(model, fd, dpq.GaussianSumQuery(S, 0.0), clients_per_round=4, batch_size=3,
                   client_learning_rate=1.0, initial_params=model.init_params(1), seed=0,
                   diagnostics=False)
  updates = alg.client_updates(tf.range(4))
  records, mask, _ = alg.server.screen(updates)
  alg.server.begin_round(4)
  return updates.numpy(), np.asarray(alg.server.aggregate(records, mask, 4), np.float64)


def test_a_clients_padding_reads_no_other_clients_example():
  honest_updates, honest = _padded_round(None)
  # Client 0's data replaced: one of its examples is inf (a client's data is arbitrary).
  bad_updates, bad = _padded_round(np.full(4, np.inf, np.float32))
  # The other clients' updates do not depend on client 0's data ...
  np.testing.assert_array_equal(bad_updates[1:], honest_updates[1:])
  # ... so the noise-free sum moves by at most 2 S (client 0's clipped update replaced).
  assert np.linalg.norm(bad - honest) <= 2 * S * (1 + 1e-6)


def _rounds(schedule_m, schedule_z, stddev=1.0):
  """A Flower deployment's rounds (K = 10, clip 1) without Flower."""
  model = F.MLP((4, 3))
  return model, flower_rounds.DPRounds(
      model, dpq.GaussianSumQuery(1.0, stddev, seed=0), model.init_params(0), 10, schedule_m,
      schedule_z, None, None, None, None, 1.0, 0.0, 0)


def test_a_stale_rounds_replies_are_never_charged_at_another_rounds_sampling():
  model, dp = _rounds([5, 1], [1.0, 3.0])
  first = dp.sample(1, list(range(10)))
  second = dp.sample(2, list(range(10)))
  update = [np.full(s, 0.01, np.float32) for s in model.shapes]
  info = dp.aggregate(1, [(c, update) for c in first], 0)
  samples, queries = dp.server.ledger.get_arrays()
  if info is not None:   # summed: the ledger must record round 1's own sampling and noise
    assert samples[-1][1] == pytest.approx(0.5) and queries[-1][3] == pytest.approx(1.0)
  else:                  # abandoned: nothing summed, nothing charged
    assert len(samples) == 0
  info = dp.aggregate(2, [(c, update) for c in second], 0)
  samples, queries = dp.server.ledger.get_arrays()
  assert info["returned"] == 1
  assert samples[-1][1] == pytest.approx(0.1) and queries[-1][3] == pytest.approx(3.0)


@pytest.mark.parametrize("reply", ["abc", "1e30", 0.01 + 5j])
def test_a_non_numeric_reply_is_rejected_as_a_zero_record(reply):
  model, dp = _rounds(2, None, stddev=0.0)
  picked = dp.sample(1, list(range(10)))
  honest = [np.full(s, 0.01, np.float32) for s in model.shapes]
  before = dp.server.weights.numpy()
  info = dp.aggregate(1, [(picked[0], [np.full(s, reply) for s in model.shapes]),
                          (picked[1], honest)], 0)
  assert info["rejected"] == 1 and info["returned"] == 1
  # noise off: w moved by the honest update alone over m = 2 (norm 0.01 sqrt(12) < clip 1)
  np.testing.assert_allclose(dp.server.weights.numpy() - before, 0.01 / 2, rtol=1e-5)


def test_a_client_listed_twice_among_the_connected_is_refused():
  _, dp = _rounds(2, None)
  with pytest.raises(ParameterValueError, match="num_clients"):
    dp.sample(1, [0, 0, 1, 2, 3, 4, 5, 6, 7, 8])
  assert int(dp.server.ledger.sample_count) == 0


def _shared_example_round(sign, stddev=0.0):
  """A round of 4 clients that all hold the one example (partition_iid repeats examples when
  K * examples_per_client > len(x), as Geyer et al.'s 100-10000 clients from MNIST), from
  w_0 = 0 (so flipping the example flips every gradient), noise `stddev`. Returns (the mechanism's
  float64 output, the DPFedAvg)."""
  model = F.MLP((4, 3))
  x = np.array([[1.0, -2.0, 0.5, 3.0]], np.float32) * sign
  fd = F.partition_iid(x, np.zeros(1, np.int32), 4, examples_per_client=1, seed=0)
  alg = F.DPFedAvg(model, fd, dpq.GaussianSumQuery(S, stddev), clients_per_round=4, batch_size=1,
                   initial_params=[np.zeros(s, np.float32) for s in model.shapes], seed=0,
                   diagnostics=False, fixed_delta=1e-5)
  records, mask, _ = alg.server.screen(alg.client_updates(tf.range(4)))
  alg.server.begin_round(4)
  return np.asarray(alg.server.aggregate(records, mask, 4), np.float64), alg


def test_the_run_states_the_client_as_its_unit():
  before, _ = _shared_example_round(1.0)
  after, _ = _shared_example_round(-1.0)
  moved = np.linalg.norm(after - before) / S
  assert moved == pytest.approx(8.0, rel=1e-5)   # 4 clients' clipped updates, each by 2 S
  _, alg = _shared_example_round(1.0, stddev=S)  # z = 1: a private round in the ledger
  statement = alg.report().privacy_statement
  assert "replace one client" in statement and "one example" not in statement
