"""Flower's Message API (ServerApp/ClientApp): the same DP rounds and ledger as the legacy API.

`_InProcessGrid` delivers each Message to the ClientApp of its destination node in this
process (Flower's own simulation needs Ray); messages go through Flower's Message,
RecordDict and ArrayRecord types both ways, as they do over gRPC.
"""

import math
import uuid
import warnings

import dp_accounting as dpa
import numpy as np
import pytest
from flwr.app import ArrayRecord
from flwr.app import Context
from flwr.app import Error
from flwr.app import Message
from flwr.app import RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from tf_dpiter import accounting
from tf_dpiter import dp_query as dpq
from tf_dpiter import federated as F
from tf_dpiter.federated import flower as FL

from .fed_helpers import plain_fedavg

# Nightly tier (-m slow): the second setting of each Message API check (one
# failure-and-rounds setting and one (k, m, z, rounds) setting stay).
SLOW_CASES = {
    "test_message_api_noise_free_is_plain_fedavg_of_the_replies[fail1-1-kept1]",
    "test_message_api_epsilon_from_ledger_equals_dp_accounting[5-3-0.9-3]"}


@pytest.fixture(autouse=True)
def _serverapp_identity():
  # Flower's runtime sets the identity of the process running a ServerApp; so does this test.
  names = ("_task_id", "_run_id", "_node_id")
  saved = [getattr(TaskIdentity, n) for n in names]
  TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
  yield
  for n, v in zip(names, saved):
    setattr(TaskIdentity, n, v)


class _InProcessGrid(Grid):
  """A Grid whose nodes are ClientApps in this process; `fail` node ids reply with an error."""

  def __init__(self, client_app, num_nodes, fail=()):
    self.app = client_app
    self.contexts = {n: Context(run_id=1, node_id=n, node_config={"partition-id": i},
                                state=RecordDict(), run_config={})
                     for i, n in enumerate(range(101, 101 + num_nodes))}
    self.fail = set(fail)
    self.sent = []

  def set_run(self, run_id):
    self._run_id = run_id

  @property
  def run(self):
    return None

  def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
    return Message(content, dst_node_id, message_type)

  def get_node_ids(self):
    return list(self.contexts)

  def push_messages(self, messages):
    raise NotImplementedError("send_and_receive delivers directly")

  def pull_messages(self, message_ids):
    raise NotImplementedError("send_and_receive delivers directly")

  def send_and_receive(self, messages, *, timeout=None):
    replies = []
    for msg in messages:
      msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
      self.sent.append(msg.metadata.dst_node_id)
      if msg.metadata.dst_node_id in self.fail:
        replies.append(Message(Error(code=0, reason="client lost"), reply_to=msg))
      else:
        replies.append(self.app(msg, self.contexts[msg.metadata.dst_node_id]))
    return replies


def _apps(tiny, k, **client_kw):
  model, x, y = tiny
  fd = F.partition_iid(x, y, k, examples_per_client=20, seed=0)
  app = FL.make_client_app(
      model, lambda ctx: fd.client_examples(int(ctx.node_config["partition-id"])),
      seed_fn=lambda ctx: int(ctx.node_config["partition-id"]), **client_kw)
  return model, fd, app


@pytest.mark.parametrize("fail, rounds, kept", [
    ((), 2, (0, 1, 2)),          # full participation
    ((102,), 1, (0, 2)),         # node 102 (partition 1) replies with an error
])
def test_message_api_noise_free_is_plain_fedavg_of_the_replies(tiny, fail, rounds, kept):
  model, fd, app = _apps(tiny, 3)
  w0 = model.init_params(seed=1)
  strat = FL.DPFedAvgMessageStrategy(
      model, dpq.GaussianSumQuery(math.inf, 0.0, seed=0), w0, num_clients=3,
      clients_per_round=3, train_config=dict(epochs=1, batch_size=20, lr=0.2), seed=0)
  grid = _InProcessGrid(app, 3, fail=fail)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    result = strat.start(grid, ArrayRecord(w0), num_rounds=rounds)
  assert [(r["returned"], r["rejected"]) for r in strat.rounds] == [(len(kept), len(fail))] * rounds
  # A failed reply is rejected: only the kept partitions, and the denominator stays m = 3.
  w = plain_fedavg(model, fd, w0, rounds=rounds, clients=kept, denominator=3)
  for got in ([p.numpy() for p in model.unflatten(strat.server.weights)],
              result.arrays.to_numpy_ndarrays()):
    for a, b in zip(got, w):
      np.testing.assert_allclose(a, b.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("k,m,z,rounds", [(4, 2, 1.3, 2), (5, 3, 0.9, 3)])
def test_message_api_epsilon_from_ledger_equals_dp_accounting(tiny, k, m, z, rounds):
  model, _, app = _apps(tiny, k, batch_size=10)
  delta = 1e-5
  strat = FL.DPFedAvgMessageStrategy(
      model, dpq.GaussianSumQuery(0.5, z * 0.5, seed=0), model.init_params(seed=0),
      num_clients=k, clients_per_round=m, fixed_delta=delta, seed=0)
  grid = _InProcessGrid(app, k)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    result = strat.start(grid, ArrayRecord(model.init_params(seed=0)), num_rounds=rounds)
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  acc.compose(dpa.SelfComposedDpEvent(
      dpa.SampledWithoutReplacementDpEvent(k, m, dpa.GaussianDpEvent(z / 2)), rounds))  # replace one client: 2S
  expected = acc.get_epsilon(delta)
  assert len(grid.sent) == m * rounds and len(set(grid.sent)) <= k
  assert int(strat.ledger.sample_count) == rounds
  assert strat.rounds[-1]["epsilon"] == pytest.approx(expected, rel=1e-6)
  assert result.train_metrics_clientapp[rounds]["epsilon"] == pytest.approx(expected, rel=1e-6)
  assert accounting.epsilon(strat.ledger, delta) == pytest.approx(expected, rel=1e-6)
  samples, _ = strat.ledger.get_arrays()
  np.testing.assert_allclose(samples[:, 0], k)
  np.testing.assert_allclose(samples[:, 2], m)


def test_message_api_stops_at_budget_and_sends_nothing_more(tiny):
  model, _, app = _apps(tiny, 4, batch_size=10)
  k, m, z, delta_max = 4, 2, 3.0, 1e-5
  strat = FL.DPFedAvgMessageStrategy(
      model, dpq.GaussianSumQuery(0.5, z * 0.5, seed=0), model.init_params(seed=0),
      num_clients=k, clients_per_round=m, fixed_epsilon=3.0, max_delta=delta_max, seed=0)
  grid = _InProcessGrid(app, k)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    strat.start(grid, ArrayRecord(model.init_params(seed=0)), num_rounds=40)
  done = len(strat.rounds)
  assert 0 < done < 40 and strat.stopped_reason.startswith("privacy budget")
  assert len(grid.sent) == m * done                      # no messages after the stop
  assert int(strat.ledger.sample_count) == done
  assert strat.rounds[-1]["delta"] <= delta_max
  assert accounting.delta(strat.ledger, 3.0) <= delta_max


def test_message_api_population_must_match_num_clients(tiny):
  model, _, app = _apps(tiny, 3)
  strat = FL.DPFedAvgMessageStrategy(
      model, dpq.GaussianSumQuery(1.0, 1.0, seed=0), model.init_params(seed=0),
      num_clients=4, clients_per_round=2, seed=0, wait_timeout=0.2)
  with pytest.raises(ValueError, match="num_clients: expected 4 connected clients, got 3"):
    strat.configure_train(1, None, {}, _InProcessGrid(app, 3))


def test_client_app_without_data_is_an_error(tiny):
  model = tiny[0]
  app = FL.make_client_app(model, lambda ctx: (np.zeros((0, 12)), np.zeros((0,))))
  grid = _InProcessGrid(app, 1)
  msg = Message(RecordDict({"arrays": ArrayRecord(model.init_params(seed=0))}), 101, "train")
  msg.metadata.__dict__["_message_id"] = "m1"
  with pytest.raises(Exception, match="x: a Flower client needs at least one example"):
    app(msg, grid.contexts[101])
