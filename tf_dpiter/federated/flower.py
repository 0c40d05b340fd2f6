"""Flower deployment of client-level DP federated averaging (optional: pip install flwr>=1.38).

The server side is a `DPServer` (the same ledger and accountant as the simulation); clients
are sampled uniformly without replacement from the K connected ones with the DP core's
Philox generator (policy client_fixed_size, n = K, m = m_t); no work is sent once a round would
pass the budget. The Message API (`DPFedAvgMessageStrategy`, `make_server_app`, `make_client_app`)
and the legacy API (`DPFedAvgStrategy`, `DPFlowerClient`, `run_loopback`) share that server.
A client returns Delta w_k, never its data; a dropped, failed, misshapen or non-finite reply
is counted and aggregated as a zero record (the denominator stays m_t).
"""

import time

# flower_client imports Flower first and says how to install it when it is missing.
from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.federated.flower_client import ARRAYS_KEY
from tf_dpiter.federated.flower_client import CONFIG_KEY
from tf_dpiter.federated.flower_client import DPFlowerClient
from tf_dpiter.federated.flower_client import METRICS_KEY
from tf_dpiter.federated.flower_client import client_update
from tf_dpiter.federated.flower_client import free_port
from tf_dpiter.federated.flower_client import make_client_app
from tf_dpiter.federated.flower_client import run_loopback

from flwr.app import ArrayRecord  # pylint: disable=g-bad-import-order
from flwr.app import ConfigRecord
from flwr.app import Message
from flwr.app import MessageType
from flwr.app import MetricRecord
from flwr.app import RecordDict
from flwr.common import FitIns
from flwr.common import ndarrays_to_parameters
from flwr.common import parameters_to_ndarrays
from flwr.server.strategy import Strategy
from flwr.serverapp import ServerApp
from flwr.serverapp import strategy as message_strategy

from tf_dpiter.federated import flower_rounds

__all__ = ["ARRAYS_KEY", "CONFIG_KEY", "METRICS_KEY", "DPFedAvgStrategy",
           "DPFedAvgMessageStrategy", "DPFlowerClient", "client_update", "free_port",
           "make_client_app", "make_server_app", "run_loopback"]


class DPFedAvgStrategy(flower_rounds.DeploymentMixin, Strategy):
  """Flower legacy-API strategy: DP federated averaging with DPQuery aggregation and a ledger.

  `configure_fit` waits up to `wait_timeout` s for K clients (fewer: ParameterValueError) and
  sends w_t with `fit_config` to m_t of them (none once the budget stopped the run);
  `aggregate_fit` returns w_{t+1} and the round's numeric info; `evaluate` is `eval_fn` on
  w_t. There is no federated evaluation.

  Args:
    model: an `MLP` shared with the clients.
    query: the inner DPQuery (records: flat updates [d]).
    initial_params: list of numpy arrays w_0.
    num_clients: K, the number of clients that must be connected (population size).
    clients_per_round: m_t (int, sequence or callable of the round).
    noise_multiplier: optional sigma_t schedule.
    fit_config: the dict sent to every client with the model (e.g. {"epochs": 1,
      "batch_size": 60, "lr": 0.1}).
    eval_fn: optional callable(list of arrays) -> (loss, {"accuracy": ...}) on the server.
    fixed_epsilon: with `max_delta`, no round starts whose delta at it would pass max_delta.
    max_delta: the largest delta allowed at `fixed_epsilon`.
    fixed_delta: with `max_epsilon`, no round starts whose epsilon at it would pass max_epsilon.
    max_epsilon: the largest epsilon allowed at `fixed_delta`.
    server_learning_rate: the server step (as in `DPServer`).
    server_momentum: the server's momentum (as in `DPServer`).
    seed: fixes the client sampling (tests only: not private).
    wait_timeout: seconds to wait for K clients to connect.
    ledger_journal: optional path of the ledger's journal, resumed or refused as by `DPServer`.
    journal_key: optional str/bytes, the HMAC key of the journal's chunks.
  """

  def __init__(self, model, query, initial_params, num_clients, clients_per_round,
               noise_multiplier=None, fit_config=None, eval_fn=None, fixed_epsilon=None,
               max_delta=None, fixed_delta=None, max_epsilon=None, server_learning_rate=1.0,
               server_momentum=0.0, seed=None, wait_timeout=60, ledger_journal=None,
               journal_key=None):
    super().__init__()
    self._dp = flower_rounds.DPRounds(model, query, initial_params, num_clients, clients_per_round,
                         noise_multiplier, fixed_epsilon, max_delta, fixed_delta, max_epsilon,
                         server_learning_rate, server_momentum, seed,
                         ledger_journal=ledger_journal, journal_key=journal_key)
    self.fit_config = dict(fit_config or {})
    self.eval_fn = eval_fn
    self.wait_timeout = int(wait_timeout)

  def initialize_parameters(self, client_manager):
    return ndarrays_to_parameters(self._dp.params())

  def configure_fit(self, server_round, parameters, client_manager):
    if self.stopped_reason is not None:
      return []
    if not client_manager.wait_for(self.num_clients, timeout=self.wait_timeout):
      raise ParameterValueError(f"num_clients: only {client_manager.num_available()} of "
                                f"{self.num_clients} clients connected")
    available = client_manager.all()
    picked = self._dp.sample(server_round, available)
    ins = FitIns(ndarrays_to_parameters(self._dp.params()), dict(self.fit_config))
    return [(available[cid], ins) for cid in picked]

  def aggregate_fit(self, server_round, results, failures):
    replies = [(getattr(proxy, "cid", None), parameters_to_ndarrays(res.parameters))
               for proxy, res in results]
    info = self._dp.aggregate(server_round, replies, len(failures))
    if info is None:
      return None, {}
    metrics = {k: v for k, v in info.items() if isinstance(v, (int, float))}
    return ndarrays_to_parameters(self._dp.params()), metrics

  def configure_evaluate(self, server_round, parameters, client_manager):
    return []

  def aggregate_evaluate(self, server_round, results, failures):
    return None, {}

  def evaluate(self, server_round, parameters):
    return None if self.eval_fn is None else self.eval_fn(parameters_to_ndarrays(parameters))


class DPFedAvgMessageStrategy(flower_rounds.DeploymentMixin, message_strategy.Strategy):
  """Flower Message-API strategy (`ServerApp`): DP federated averaging with a ledger.

  Use `strategy.start(grid, ArrayRecord(initial_params), num_rounds, ...)` inside a
  ServerApp's main (or `make_server_app`); w_t lives in the DPServer, and the ArrayRecord
  Flower passes in is ignored. `configure_train` sends w_t with `train_config` to m_t of the
  K connected nodes (not K: ParameterValueError); `aggregate_train` returns w_{t+1} and a
  MetricRecord of the round's info. There is no federated evaluation.

  Args:
    model: an `MLP` shared with the clients.
    query: the inner DPQuery (records: flat updates [d]).
    initial_params: list of numpy arrays w_0.
    num_clients: K, the number of clients that must be connected (population size).
    clients_per_round: m_t (int, sequence or callable of the round).
    noise_multiplier: optional sigma_t schedule.
    train_config: dict sent to every client with the model (e.g. {"epochs": 1, "lr": 0.1}).
    fixed_epsilon: with `max_delta`, no round starts whose delta at it would pass max_delta.
    max_delta: the largest delta allowed at `fixed_epsilon`.
    fixed_delta: with `max_epsilon`, no round starts whose epsilon at it would pass max_epsilon.
    max_epsilon: the largest epsilon allowed at `fixed_delta`.
    server_learning_rate: the server step (as in `DPServer`).
    server_momentum: the server's momentum (as in `DPServer`).
    seed: fixes the client sampling (tests only: not private).
    wait_timeout: seconds to wait for K clients to connect.
    ledger_journal: optional path of the ledger's journal, resumed or refused as by `DPServer`.
    journal_key: optional str/bytes, the HMAC key of the journal's chunks.
  """

  def __init__(self, model, query, initial_params, num_clients, clients_per_round,
               noise_multiplier=None, train_config=None, fixed_epsilon=None, max_delta=None,
               fixed_delta=None, max_epsilon=None, server_learning_rate=1.0,
               server_momentum=0.0, seed=None, wait_timeout=60, ledger_journal=None,
               journal_key=None):
    self._dp = flower_rounds.DPRounds(model, query, initial_params, num_clients, clients_per_round,
                         noise_multiplier, fixed_epsilon, max_delta, fixed_delta, max_epsilon,
                         server_learning_rate, server_momentum, seed,
                         ledger_journal=ledger_journal, journal_key=journal_key)
    self.train_config = dict(train_config or {})
    self.wait_timeout = float(wait_timeout)

  def _wait_for_nodes(self, grid):
    """The connected node ids, after waiting up to wait_timeout s for K of them."""
    deadline = time.monotonic() + self.wait_timeout
    ids = list(grid.get_node_ids())
    while len(ids) < self.num_clients and time.monotonic() < deadline:
      time.sleep(0.5)
      ids = list(grid.get_node_ids())
    return ids

  def summary(self):
    """Prints K and the inner query's class (Flower's `Strategy.summary`)."""
    print(f"DPFedAvgMessageStrategy: K={self.num_clients}, query "
          f"{type(self.server.inner_query).__name__}")

  def configure_train(self, server_round, arrays, config, grid):
    if self.stopped_reason is not None:
      return []
    picked = self._dp.sample(server_round, self._wait_for_nodes(grid))
    cfg = ConfigRecord(dict(config, **self.train_config))
    cfg["server-round"] = int(server_round)
    content = RecordDict({ARRAYS_KEY: ArrayRecord(self._dp.params()), CONFIG_KEY: cfg})
    return [Message(content=content, message_type=MessageType.TRAIN, dst_node_id=int(n))
            for n in picked]

  def aggregate_train(self, server_round, replies):
    updates, failures = [], 0
    for reply in replies:
      if reply.has_error() or ARRAYS_KEY not in reply.content.array_records:
        failures += 1
      else:
        updates.append((int(reply.metadata.src_node_id),
                        reply.content.array_records[ARRAYS_KEY].to_numpy_ndarrays()))
    info = self._dp.aggregate(server_round, updates, failures)
    if info is None:
      return None, None
    return (ArrayRecord(self._dp.params()),
            MetricRecord({k: v for k, v in info.items() if isinstance(v, (int, float))}))

  def configure_evaluate(self, server_round, arrays, config, grid):
    return []

  def aggregate_evaluate(self, server_round, replies):
    return None


def make_server_app(strategy_fn, num_rounds, evaluate_fn=None, timeout=3600, on_finish=None):
  """A Flower `ServerApp` that runs `strategy_fn(context)` (a `DPFedAvgMessageStrategy`).

  Args:
    strategy_fn: callable(context) -> DPFedAvgMessageStrategy (read the run config there).
    num_rounds: an int, or the name of a run-config entry (e.g. "num-server-rounds": Flower
      loads the ServerApp before any run config exists). The budget may stop earlier.
    evaluate_fn: Flower's centralized evaluation hook, callable(round, ArrayRecord) ->
      MetricRecord or None.
    timeout: seconds to wait for a round's replies.
    on_finish: optional callable(strategy, result, context) after the last round, e.g. to
      write `strategy.report()` or the ledger (`strategy.ledger`) somewhere durable.

  Returns:
    a `flwr.serverapp.ServerApp`.
  Raises (when the app runs):
    ParameterValueError: num_rounds < 1.
    ParameterTypeError: strategy_fn returned something else than a DPFedAvgMessageStrategy.
  """
  app = ServerApp()

  @app.main()
  def main(grid, context):
    rounds = (int(context.run_config[num_rounds]) if isinstance(num_rounds, str)
              else int(num_rounds))
    if rounds < 1:
      raise ParameterValueError(f"num_rounds must be >= 1, got {rounds}")
    strategy = strategy_fn(context)
    validation.check_instance("strategy_fn(context)", strategy, DPFedAvgMessageStrategy,
                              "a DPFedAvgMessageStrategy")
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(strategy._dp.params()),  # pylint: disable=protected-access
                            num_rounds=rounds, timeout=timeout, evaluate_fn=evaluate_fn)
    if on_finish is not None:
      on_finish(strategy, result, context)

  return app
