"""Flower clients of client-level DP federated averaging (optional: pip install flwr>=1.38).

A client runs ClientUpdate (Geyer et al. 2017, Algorithm 1: E epochs of minibatch SGD, `LocalSGD`
with one client) on its own examples and returns Delta w_k = w_k - w_t, never its data:
`DPFlowerClient` for Flower's legacy API, `make_client_app` for the Message API. `run_loopback`
runs a legacy-API server and its clients on 127.0.0.1 (tests, demos). The server side is
`tf_dpiter.federated.flower`.
"""

import socket
import threading
import time

import numpy as np
import tensorflow as tf

try:
  import flwr
  from flwr.app import ArrayRecord
  from flwr.app import ConfigRecord
  from flwr.app import Message
  from flwr.app import MetricRecord
  from flwr.app import RecordDict
  from flwr.client import NumPyClient
  from flwr.clientapp import ClientApp
except ImportError as e:  # pragma: no cover
  raise ImportError("tf_dpiter.federated.flower needs Flower: pip install 'flwr>=1.38' "
                    "(extra tf_dpiter[flower])") from e

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.federated import client as client_lib

__all__ = ["ARRAYS_KEY", "CONFIG_KEY", "METRICS_KEY", "client_update", "DPFlowerClient",
           "make_client_app", "free_port", "run_loopback"]

ARRAYS_KEY = "arrays"      # RecordDict keys of the Message API
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
_LOCAL_KEYS = ("epochs", "batch_size", "lr")


def client_update(model, x, y, generator, epochs, batch_size, learning_rate, parameters):
  """ClientUpdate on one client's examples (Geyer et al. 2017, Algorithm 1): E epochs of SGD from w_t.

  Args:
    model: the `MLP`.
    x: the client's examples.
    y: the client's examples.
    generator: a tf.random.Generator for the local example order.
    epochs: E.
    batch_size: B (examples).
    learning_rate: eta.
    parameters: w_t, a list of arrays.

  Returns:
    Delta w_k = w_k - w_t, a list of numpy arrays in the model's layout.
  """
  sgd = client_lib.LocalSGD(model, int(epochs), int(batch_size), float(learning_rate))
  n = len(x)
  idx = np.arange(n, dtype=np.int32)[None]
  sizes = np.array([n], np.int32)
  order = client_lib.draw_example_order(generator, sizes, n, sgd.epochs)
  deltas = sgd(parameters, x, y, idx, sizes, order)
  return [d[0].numpy() for d in deltas]   # row 0: the batch holds this one client


def _client_examples(x, y):
  if len(x) == 0:
    raise ParameterValueError("x: a Flower client needs at least one example, got 0")
  return np.asarray(x, np.float32).reshape(len(x), -1), np.asarray(y, np.int32)


def _generator(seed):
  return (tf.random.Generator.from_seed(seed) if seed is not None
          else tf.random.Generator.from_non_deterministic_state())


class DPFlowerClient(NumPyClient):
  """A legacy-API Flower client holding its own examples; fit returns its update Delta w_k.

  `fit` runs ClientUpdate from w_t (the server's "epochs", "batch_size" and "lr" override
  the defaults); the server owns and evaluates w_t.

  Args:
    model: the `MLP` the server trains.
    x: this client's examples (at least one).
    y: this client's examples (at least one).
    epochs: local defaults, overridden by the server's fit config.
    batch_size: local defaults, overridden by the server's fit config.
    learning_rate: local defaults, overridden by the server's fit config.
    seed: seeds the local example order (tests only).

  Raises:
    ParameterValueError: no example.
  """

  def __init__(self, model, x, y, epochs=1, batch_size=60, learning_rate=0.1, seed=None):
    self.model = model
    self.x, self.y = _client_examples(x, y)
    self.defaults = dict(epochs=epochs, batch_size=batch_size, lr=learning_rate)
    self._gen = _generator(seed)

  def get_parameters(self, config):
    return []

  def fit(self, parameters, config):
    cfg = dict(self.defaults, **{k: v for k, v in config.items() if k in _LOCAL_KEYS})
    deltas = client_update(self.model, self.x, self.y, self._gen, cfg["epochs"],
                           cfg["batch_size"], cfg["lr"], parameters)
    return deltas, len(self.x), {}

  def evaluate(self, parameters, config):
    return 0.0, len(self.x), {}


def make_client_app(model, load_examples, epochs=1, batch_size=60, learning_rate=0.1,
                    seed_fn=None):
  """A Flower `ClientApp` running ClientUpdate; the Message-API twin of `DPFlowerClient`.

  A train message carries "arrays" (w_t) and "config"; the reply carries "arrays" (Delta w_k)
  and "metrics" {"num-examples": n}.

  Args:
    model: the `MLP` the server trains.
    load_examples: callable(context) -> (x, y), this node's own examples (e.g. read from
      `context.node_config["partition-id"]`).
    epochs: local defaults; the server's train config overrides them with its "epochs".
    batch_size: "batch_size".
    learning_rate: "lr" entries.
    seed_fn: optional callable(context) -> int seeding the local example order (tests only).

  Returns:
    a `flwr.clientapp.ClientApp`.
  """
  app = ClientApp()
  cache = {}

  def examples(context):
    key = context.node_id
    if key not in cache:
      x, y = _client_examples(*load_examples(context))
      gen = _generator(None if seed_fn is None else seed_fn(context))
      cache[key] = (x, y, gen)
    return cache[key]

  @app.train()
  def train(message, context):
    x, y, gen = examples(context)
    config = message.content.config_records.get(CONFIG_KEY, ConfigRecord())
    cfg = dict(epochs=epochs, batch_size=batch_size, lr=learning_rate)
    cfg.update({k: config[k] for k in _LOCAL_KEYS if k in config})
    params = message.content.array_records[ARRAYS_KEY].to_numpy_ndarrays()
    deltas = client_update(model, x, y, gen, cfg["epochs"], cfg["batch_size"], cfg["lr"],
                           params)
    content = RecordDict({ARRAYS_KEY: ArrayRecord(deltas),
                          METRICS_KEY: MetricRecord({"num-examples": len(x)})})
    return Message(content=content, reply_to=message)

  return app


def free_port():
  """A free TCP port on 127.0.0.1 (for `run_loopback`).

  Returns:
    the port number, an int.
  """
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_client_when_up(host, port, client, timeout=120):
  """Waits until the server port accepts connections, then runs a Flower client."""
  from flwr.compat.client.app import start_client  # pylint: disable=g-import-not-at-top
  deadline = time.time() + timeout
  while time.time() < deadline:
    try:
      with socket.create_connection((host, port), timeout=1):
        break
    except OSError:
      time.sleep(0.2)
  start_client(server_address=f"{host}:{port}", client=client.to_client(),
               insecure=True, max_retries=20, max_wait_time=60)


def run_loopback(strategy, clients, num_rounds, port=None):
  """Runs a Flower server (this thread) and `clients` (one thread each, real gRPC clients of
  Flower's legacy transport) on 127.0.0.1.

  Args:
    strategy: a `DPFedAvgStrategy`.
    clients: `DPFlowerClient`s (their number must be the strategy's K).
    num_rounds: rounds to run (the budget may stop earlier).
    port: the server port (None: `free_port()`).

  Returns:
    Flower's History.
  """
  import signal  # pylint: disable=g-import-not-at-top
  from flwr.compat.server.app import start_server  # pylint: disable=g-import-not-at-top
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
    hist = start_server(server_address=address, strategy=strategy,
                        config=flwr.server.ServerConfig(num_rounds=num_rounds))
  finally:
    for s, h in saved.items():
      signal.signal(s, h)
  for th in threads:
    th.join(timeout=10)
  return hist
