"""Review R (session 31): a Flower round's replies, as the Message API strategy receives them
from `Grid.send_and_receive`, are summed once per SAMPLED client.

Geyer et al., "Differentially private federated learning: a client level perspective"
(Algorithm 1): a round samples m_t of the K clients, clips each sampled client's update to S,
adds N(0, (sigma S)^2) to the sum and divides by m_t. The ledger records the round as
fixed-size sampling of m_t clients out of K (replace one client: the sum moves by at most 2 S;
amplification by sampling assumes that only the sampled clients contribute). A lost message is
absent from the replies (it is not an error reply), so the count check of DPRounds.aggregate
(replies + failures <= m_t) alone does not tell a duplicated or foreign reply from a lost one.

Independent value (noise off, server learning rate 1, w_0 = 0, float64 from the float32
weights): client j's update is 5 e_j (norm 5 > S = 1, clipped to S e_j times the server's
float64 clip shrink), so w_1 = sum over the distinct sampled clients that replied of S e_j /
m_t (up to the shrink: rtol 1e-6).

Measured at 86d7223 (K = 4, m_t = 2, sampled [10, 13] then [11, 12]):
- the sampled node 10 replies twice and node 13 not at all: w moves by 1.0 = 2 S / m_t (node
  10's update summed twice; once: 0.5);
- a reply from node 10, not sampled in round 2, with one from node 11: summed, w moves by
  2 S / m_t = 1.0 (only node 11's 0.5 should count);
- the legacy API (DPFedAvgStrategy.aggregate_fit) given one ClientProxy's result twice: 1.0.
Fix: keep the first reply per sampled node (Message API: metadata.src_node_id among the round's
dst_node_ids; legacy: ClientProxy.cid among the picked), count the others as rejected.
Fixed at a560514: DPRounds.aggregate takes (client id, update) pairs and sums the
first reply of each client sampled in the round; the others are counted as rejected.
"""

import numpy as np
import pytest
from flwr.app import ArrayRecord
from flwr.app import ConfigRecord
from flwr.app import Error
from flwr.app import Message
from flwr.app import RecordDict

from tf_dpiter import dp_query as dpq
from tf_dpiter import federated as F
from tf_dpiter.federated import flower as FL

# the ServerApp identity Flower's runtime sets (autouse): the Message API tests' fixture
from .test_flower_message_api import _serverapp_identity  # noqa: F401  pylint: disable=unused-import

S, K, M = 1.0, 4, 2
NODES = [10, 11, 12, 13]


class _Nodes:
  """The part of a Grid `configure_train` reads: the connected node ids."""

  def get_node_ids(self):
    return list(NODES)


def _strategy():
  model = F.MLP((4, 3), use_bias=False)
  params = [np.zeros(s, np.float32) for s in model.shapes]
  return FL.DPFedAvgMessageStrategy(model, dpq.GaussianSumQuery(S, 0.0), params, num_clients=K,
                                    clients_per_round=M, seed=1), model


def _update(model, node):
  """Node `node`'s update: 5 e_j, j its index in NODES (clipped to S e_j)."""
  flat = np.zeros(model.num_params, np.float32)
  flat[NODES.index(node)] = 5.0
  return [p.numpy() for p in model.unflatten(flat)]


def _reply(model, msg, node=None):
  """The reply to `msg` carrying node `node`'s update (default: the message's destination)."""
  node = msg.metadata.dst_node_id if node is None else node
  return Message(RecordDict({FL.ARRAYS_KEY: ArrayRecord(_update(model, node))}), reply_to=msg)


def _weights(strategy):
  return np.asarray(strategy.server.weights, np.float64)


def _expected(nodes, dim):
  """The independent float64 w_1 - w_0: S e_j / m_t for each DISTINCT sampled node j."""
  w = np.zeros(dim, np.float64)
  for node in set(nodes):
    w[NODES.index(node)] += S / M
  return w


def _round(strategy, server_round):
  msgs = strategy.configure_train(server_round, None, ConfigRecord({}), _Nodes())
  assert len(msgs) == M
  return msgs


def test_each_sampled_reply_is_summed_once():
  strategy, model = _strategy()
  msgs = _round(strategy, 1)
  picked = [m.metadata.dst_node_id for m in msgs]
  strategy.aggregate_train(1, [_reply(model, m) for m in msgs])
  np.testing.assert_allclose(_weights(strategy), _expected(picked, model.num_params),
                             rtol=1e-6, atol=0)
  assert int(strategy.ledger.sample_count) == 1


def test_an_error_reply_counts_as_a_failure_and_adds_nothing():
  strategy, model = _strategy()
  msgs = _round(strategy, 1)
  lost = Message(Error(code=0, reason="client lost"), reply_to=msgs[1])
  _, metrics = strategy.aggregate_train(1, [_reply(model, msgs[0]), lost])
  np.testing.assert_allclose(_weights(strategy),
                             _expected([msgs[0].metadata.dst_node_id], model.num_params),
                             rtol=1e-6, atol=0)
  assert metrics["returned"] == 1 and metrics["rejected"] == 1


def test_a_duplicated_reply_with_a_lost_one_is_summed_once():
  strategy, model = _strategy()
  msgs = _round(strategy, 1)
  first = msgs[0].metadata.dst_node_id
  strategy.aggregate_train(1, [_reply(model, msgs[0]), _reply(model, msgs[0])])
  moved = _weights(strategy)
  assert np.linalg.norm(moved) <= S / M, np.linalg.norm(moved)
  np.testing.assert_allclose(moved, _expected([first], model.num_params), rtol=1e-6, atol=0)


def test_a_reply_from_a_client_not_sampled_is_not_summed():
  strategy, model = _strategy()
  _round(strategy, 1)
  strategy.aggregate_train(1, [])   # round 1: every sampled reply lost
  msgs = _round(strategy, 2)
  picked = [m.metadata.dst_node_id for m in msgs]
  other = next(n for n in NODES if n not in picked)
  foreign = Message(RecordDict({}), dst_node_id=other, message_type="train")
  strategy.aggregate_train(2, [_reply(model, msgs[0]), _reply(model, foreign)])
  assert foreign.metadata.dst_node_id not in picked
  np.testing.assert_allclose(_weights(strategy),
                             _expected([picked[0]], model.num_params), rtol=1e-6, atol=0)


class _Proxy:
  def __init__(self, cid):
    self.cid = cid


class _Manager:
  """The part of a ClientManager `configure_fit` reads."""

  def __init__(self):
    self.proxies = {str(n): _Proxy(str(n)) for n in NODES}

  def wait_for(self, num_clients, timeout=None):
    return True

  def all(self):
    return dict(self.proxies)


def test_the_legacy_api_sums_one_clients_duplicated_result_once():
  from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
  model = F.MLP((4, 3), use_bias=False)
  params = [np.zeros(s, np.float32) for s in model.shapes]
  strategy = FL.DPFedAvgStrategy(model, dpq.GaussianSumQuery(S, 0.0), params, num_clients=K,
                                 clients_per_round=M, seed=1)
  picked = strategy.configure_fit(1, None, _Manager())
  assert len(picked) == M
  proxy = picked[0][0]
  res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(_update(model, int(proxy.cid))), 1, {})
  strategy.aggregate_fit(1, [(proxy, res), (proxy, res)], [])
  np.testing.assert_allclose(_weights(strategy), _expected([int(proxy.cid)], model.num_params),
                             rtol=1e-6, atol=0)
