"""Flower deployment of client-level DP federated averaging (optional: pip install flwr>=1.38).

`DPFedAvgStrategy` is a Flower `Strategy` whose aggregation is a `DPServer`: the clients'
updates are the records of a DPQuery wrapped in `QueryWithLedger`, so the epsilon of a real
deployment comes from the same ledger and accountant (tf_dpiter.accounting) as the
simulation. Clients are sampled uniformly without replacement from the K connected clients
with the DP core's Philox generator (ledger policy fixed_size, n = K, m = m_t), and the
strategy stops sending work before a round would pass the budget.

`DPFlowerClient` runs ClientUpdate (E epochs of minibatch SGD, `LocalSGD` with one client)
on its own examples and returns Delta w_k = w_k - w_t, never its data.

A dropped client, an update of the wrong shape or with non-finite values is rejected:
counted, and aggregated as a zero record (the denominator stays m_t). Uses Flower's legacy
`start_server`/`start_client` (deprecated in flwr but present in 1.38) for loopback runs.
"""

import socket
import threading
import time

import numpy as np
import tensorflow as tf

try:
  import flwr
  from flwr.client import NumPyClient
  from flwr.common import FitIns
  from flwr.common import ndarrays_to_parameters
  from flwr.common import parameters_to_ndarrays
  from flwr.server.strategy import Strategy
except ImportError as e:  # pragma: no cover
  raise ImportError("tf_dpiter.federated.flower needs Flower: pip install 'flwr>=1.38' "
                    "(extra tf_dpiter[flower])") from e

from tf_dpiter import dp_query as dpq
from tf_dpiter.federated import client as client_lib
from tf_dpiter.federated import dpfedavg


class DPFedAvgStrategy(Strategy):
  """Flower strategy: DP federated averaging with DPQuery aggregation and a ledger.

  Args:
    model: an `MLP` shared with the clients.
    query: the inner DPQuery (records: flat updates [d]).
    initial_params: list of numpy arrays w_0.
    num_clients: K, the number of clients that must be connected (population size).
    clients_per_round: m_t (int, sequence or callable of the round).
    noise_multiplier: optional sigma_t schedule.
    fit_config: dict sent to every client (e.g. {"epochs": 1, "batch_size": 60, "lr": 0.1}).
    eval_fn: optional callable(list of arrays) -> (loss, {"accuracy": ...}) on the server.
    seed: fixes the client sampling (tests only: not private).
    Others: as in `DPServer`.
  """

  def __init__(self, model, query, initial_params, num_clients, clients_per_round,
               noise_multiplier=None, fit_config=None, eval_fn=None, fixed_epsilon=None,
               max_delta=None, fixed_delta=None, max_epsilon=None, server_learning_rate=1.0,
               server_momentum=0.0, seed=None, wait_timeout=60):
    super().__init__()
    self.model = model
    self.num_clients = int(num_clients)
    self._m_schedule = dpfedavg.as_schedule("clients_per_round", clients_per_round,
                                            integer=True)
    self._z_schedule = (None if noise_multiplier is None
                        else dpfedavg.as_schedule("noise_multiplier", noise_multiplier))
    w0 = model.flatten([tf.constant(p) for p in initial_params])
    self.server = dpfedavg.DPServer(query, w0, self.num_clients, self._m_schedule(1),
                                    sampling="fixed_size", fixed_epsilon=fixed_epsilon,
                                    max_delta=max_delta, fixed_delta=fixed_delta,
                                    max_epsilon=max_epsilon,
                                    server_learning_rate=server_learning_rate,
                                    server_momentum=server_momentum)
    self.ledger = self.server.ledger
    self.fit_config = dict(fit_config or {})
    self.eval_fn = eval_fn
    self.wait_timeout = int(wait_timeout)
    self._gen = dpq.make_generator(seed)
    self._round_m = {}
    self.rounds = []
    self.stopped_reason = None

  def _shapes(self):
    return [tuple(s) for s in self.model.shapes]

  def _params(self):
    return [p.numpy() for p in self.model.unflatten(self.server.w)]

  def initialize_parameters(self, client_manager):
    return ndarrays_to_parameters(self._params())

  def configure_fit(self, server_round, parameters, client_manager):
    if self.stopped_reason is not None:
      return []
    if not client_manager.wait_for(self.num_clients, timeout=self.wait_timeout):
      raise ValueError(f"num_clients: only {client_manager.num_available()} of "
                       f"{self.num_clients} clients connected")
    m = self._m_schedule(server_round)
    z = self._z_schedule(server_round) if self._z_schedule is not None else None
    self.server.begin_round(m, z, server_round)
    over = self.server.would_exceed_budget(m, server_round)
    if over:
      self.stopped_reason = "privacy budget: " + over
      return []
    available = client_manager.all()
    cids = sorted(available)
    if len(cids) != self.num_clients:
      raise ValueError(f"num_clients: expected {self.num_clients} connected clients, got "
                       f"{len(cids)} (the ledger's population size must be exact)")
    pick = tf.argsort(self._gen.uniform([len(cids)]))[:m].numpy()
    self._round_m[server_round] = m
    ins = FitIns(ndarrays_to_parameters(self._params()), dict(self.fit_config))
    return [(available[cids[i]], ins) for i in pick]

  def _record(self, arrays):
    shapes = self._shapes()
    if len(arrays) != len(shapes) or any(tuple(a.shape) != s for a, s in zip(arrays, shapes)):
      return None
    return np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays])

  def aggregate_fit(self, server_round, results, failures):
    m = self._round_m[server_round]
    rows, bad = [], len(failures)
    for _, fit_res in results:
      rec = self._record(parameters_to_ndarrays(fit_res.parameters))
      if rec is None:
        bad += 1
      else:
        rows.append(rec)
    dim = self.server.dim
    records = np.stack(rows) if rows else np.zeros([1, dim], np.float32)
    records, mask, rejected = self.server.screen(records)
    if not rows:
      mask = tf.zeros([1])
    self.server.apply(records, mask, m)
    eps, delta = self.server.guarantee()
    info = dict(round=server_round, clients=m, returned=len(rows),
                rejected=int(bad + rejected), clip=self.server.clip() or 0.0)
    if eps is not None:
      info.update(epsilon=float(eps), delta=float(delta))
    self.rounds.append(info)
    metrics = {k: v for k, v in info.items() if isinstance(v, (int, float))}
    return ndarrays_to_parameters(self._params()), metrics

  def configure_evaluate(self, server_round, parameters, client_manager):
    return []

  def aggregate_evaluate(self, server_round, results, failures):
    return None, {}

  def evaluate(self, server_round, parameters):
    if self.eval_fn is None:
      return None
    return self.eval_fn(parameters_to_ndarrays(parameters))

  def report(self):
    """(guarantee_holds, privacy statement, warnings) from the ledger's accountant."""
    return self.server.privacy_statement()


class DPFlowerClient(NumPyClient):
  """A Flower client holding its own examples; fit returns its update Delta w_k."""

  def __init__(self, model, x, y, epochs=1, batch_size=60, learning_rate=0.1, seed=None):
    if len(x) == 0:
      raise ValueError("x: a Flower client needs at least one example, got 0")
    self.model = model
    self.x = np.asarray(x, np.float32).reshape(len(x), -1)
    self.y = np.asarray(y, np.int32)
    self.defaults = dict(epochs=epochs, batch_size=batch_size, lr=learning_rate)
    self._gen = (tf.random.Generator.from_seed(seed) if seed is not None
                 else tf.random.Generator.from_non_deterministic_state())

  def get_parameters(self, config):
    return []

  def fit(self, parameters, config):
    cfg = dict(self.defaults, **{k: v for k, v in config.items() if k in self.defaults})
    sgd = client_lib.LocalSGD(self.model, int(cfg["epochs"]), int(cfg["batch_size"]),
                              float(cfg["lr"]))
    n = len(self.x)
    idx = np.arange(n, dtype=np.int32)[None]
    sizes = np.array([n], np.int32)
    order = client_lib.draw_example_order(self._gen, sizes, n, sgd.epochs)
    deltas = sgd(parameters, self.x, self.y, idx, sizes, order)
    return [d[0].numpy() for d in deltas], n, {}

  def evaluate(self, parameters, config):
    return 0.0, len(self.x), {}


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_client_when_up(host, port, client, timeout=120):
  """Waits until the server port accepts connections, then runs a Flower client."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    try:
      with socket.create_connection((host, port), timeout=1):
        break
    except OSError:
      time.sleep(0.2)
  flwr.client.start_client(server_address=f"{host}:{port}", client=client.to_client(),
                           insecure=True, max_retries=20, max_wait_time=60)


def run_loopback(strategy, clients, num_rounds, port=None):
  """Runs a Flower server (this thread) and `clients` (one thread each) on 127.0.0.1.

  Returns Flower's History. Clients are real gRPC clients of the legacy Flower transport.
  """
  import signal  # pylint: disable=g-import-not-at-top
  port = port or free_port()
  address = f"127.0.0.1:{port}"
  saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  threads = []
  for c in clients:
    th = threading.Thread(target=_start_client_when_up, args=("127.0.0.1", port, c),
                          daemon=True)
    threads.append(th)
  try:
    for th in threads:
      th.start()
    hist = flwr.server.start_server(server_address=address, strategy=strategy,
                                    config=flwr.server.ServerConfig(num_rounds=num_rounds))
  finally:
    for s, h in saved.items():
      signal.signal(s, h)
  for th in threads:
    th.join(timeout=10)
  return hist
