"""Client-level DP federated averaging (Geyer et al. 2017, Algorithm 1; record/sample of McMahan et al. 2018, Table 1).

Each round t the server samples m_t of K clients (uniformly without replacement, or Poisson
with q_t = m_t / K); each runs ClientUpdate (E epochs of SGD, batch B, rate eta) from w_t and
returns Delta w_k = w_k - w_t. The updates are the records and the clients the sample of a
DPQuery in `QueryWithLedger` (clip, Gaussian noise, ledger); `DPServer` divides the noised sum
by the public m_t. Before each round the budget look-ahead stops training if the round would
push delta (at fixed epsilon, the paper's rule) or epsilon (at fixed delta) past its target.
"""

import time
from typing import List

import tensorflow as tf

from tf_dpiter import dp_query as dpq
from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.federated import client as client_lib
from tf_dpiter.federated import model as model_lib
from tf_dpiter.federated import server as server_lib
from tf_dpiter.federated.queries import make_query
from tf_dpiter.federated.reports import RoundReport
from tf_dpiter.federated.reports import RunReport
from tf_dpiter.federated.reports import update_statistics
from tf_dpiter.federated.schedules import RoundSchedule
from tf_dpiter.federated.server import DPServer

__all__ = ["DPFedAvg"]


class DPFedAvg:
  """Client-level DP federated averaging, simulated with vectorized clients.

  Args:
    model: an `MLP` (the paper's model: MLP((784, 600, 100, 10), use_bias=False)).
    data: a `FederatedData` partition (K = data.num_clients).
    query: the aggregation DPQuery (records: flat updates [d]); default
      make_query("quantile", noise_multiplier(1), clients_per_round(1)).
    clients_per_round: m_t: int, sequence or callable of the round (1-based).
    noise_multiplier: sigma_t schedule (`queries.set_noise_multiplier`); None: the query's z.
    local_epochs: E.
    batch_size: B (examples).
    client_learning_rate: eta of ClientUpdate.
    server_learning_rate: eta_s.
    server_momentum: beta of the server step (1, 0: the paper).
    sampling: "fixed_size" (m_t clients uniformly without replacement; ledger policy
      client_fixed_size) or "poisson" (each client with q_t = m_t/K; ledger policy
      client_poisson); the ledger's unit is the client.
    fixed_epsilon: with max_delta, stop before delta(fixed_epsilon) would exceed max_delta
      (Geyer et al. 2017: epsilon = 8, delta_0); alone, only report delta at it.
    max_delta: the largest delta allowed at fixed_epsilon.
    fixed_delta: with max_epsilon, stop before epsilon(fixed_delta) would exceed
      max_epsilon; alone, only report epsilon at it.
    max_epsilon: the largest epsilon allowed at fixed_delta.
    accountant: "rdp" (required for fixed_size sampling) or "pld".
    eval_data: (x, y) for per-round accuracy, or None; public or held-out examples (an
      accuracy on the clients' own examples is not covered by the guarantee).
    initial_params: list of numpy arrays, else model.init_params(seed).
    seed: fixes sampling, shuffling and initialization (tests only: not private).
    max_clients_per_chunk: clients trained together in one vectorized call (memory bound).
    diagnostics: compute V_c and U_s each round.
    average_decay: beta in [0, 1): also keep the moving average a_t = beta a_{t-1} +
      (1 - beta) w_t (a_1 = w_1) and report its accuracy (post-processing); None: not kept.
    eval_every: evaluate every `eval_every` rounds.
    ledger_journal: optional path of the ledger's journal, resumed (the round counter
      continues after its rounds) or refused as by `DPServer`.
    journal_key: optional str/bytes, the HMAC key of the journal's chunks.

  Attributes:
    schedule: the `RoundSchedule` of m_t and sigma_t.
    server: the `DPServer`; query / ledger: its QueryWithLedger and PrivacyLedger.
    rounds: the RoundReports so far (this object's; a resumed journal's rounds are in
      the ledger only).
    round_index: the rounds run, those of a resumed journal included.

  Raises:
    ParameterTypeError: an argument of the wrong type (a TypeError).
    PrivacyConfigError: see `DPServer` and `RoundSchedule`.
    BudgetConfigError: an inconsistent or out-of-range budget (`DPServer`).
    ParameterValueError: average_decay outside [0, 1), max_clients_per_chunk < 1; an altered
      journal (`DPServer`).
  """

  def __init__(self, model, data, query=None, clients_per_round=10, noise_multiplier=None,
               local_epochs=1, batch_size=60, client_learning_rate=0.1,
               server_learning_rate=1.0, server_momentum=0.0, sampling="fixed_size",
               fixed_epsilon=None, max_delta=None, fixed_delta=None, max_epsilon=None,
               accountant="rdp", eval_data=None, initial_params=None, seed=None,
               max_clients_per_chunk=128, diagnostics=True, eval_every=1, average_decay=None,
               ledger_journal=None, journal_key=None):
    validation.check_params({"average_decay": validation.Optional(validation.Interval(
        float, 0, 1, "left", error=ParameterValueError))}, {"average_decay": average_decay})
    self.average_decay = None if average_decay is None else float(average_decay)
    self._average = None
    validation.check_integer("max_clients_per_chunk", max_clients_per_chunk, 1)
    self.model = model
    self.data = data
    self.num_clients = data.num_clients
    self.schedule = RoundSchedule(clients_per_round, noise_multiplier)
    m1, z1 = self.schedule(1)
    if query is None:
      query = make_query("quantile", 1.0 if z1 is None else z1, m1, seed=seed)
    params = initial_params if initial_params is not None else model.init_params(seed)
    self.server = DPServer(query, model.flatten([tf.constant(p) for p in params]),
                           self.num_clients, m1, sampling=sampling,
                           fixed_epsilon=fixed_epsilon, max_delta=max_delta,
                           fixed_delta=fixed_delta, max_epsilon=max_epsilon,
                           accountant=accountant, server_learning_rate=server_learning_rate,
                           server_momentum=server_momentum, ledger_journal=ledger_journal,
                           journal_key=journal_key)
    self.inner_query = query
    self.query = self.server.query
    self.ledger = self.server.ledger
    self.sampling = sampling
    self.local_sgd = client_lib.LocalSGD(model, local_epochs, batch_size, client_learning_rate)
    self.eval_data = eval_data
    self.eval_every = int(eval_every)
    self.diagnostics = diagnostics
    self.max_clients_per_chunk = max_clients_per_chunk
    self.dim = self.server.dim
    self._sample_gen = dpq.make_generator(seed)
    self._order_gen = (tf.random.Generator.from_seed(int(seed) + 1) if seed is not None
                       else tf.random.Generator.from_non_deterministic_state())
    self._x = tf.constant(data.x.reshape(data.x.shape[0], -1))
    self._y = tf.constant(data.y)
    self._client_indices = tf.constant(data.client_indices)
    self._client_sizes = tf.constant(data.client_sizes)
    self.rounds: List[RoundReport] = []
    self.round_index = self.server.resumed_rounds

  @property
  def params(self):
    """The server model w_t as a list of numpy arrays."""
    return [p.numpy() for p in self.model.unflatten(self.server.weights)]

  @property
  def average_params(self):
    """The moving average of the server models (average_decay), or None."""
    if self._average is None:
      return None
    return [p.numpy() for p in self.model.unflatten(self._average)]

  def _sample_clients(self, m):
    return server_lib.sample_clients(self._sample_gen, self.num_clients, m, self.sampling)

  def client_updates(self, clients):
    """Flattened updates of the given clients (vectorized ClientUpdate from w_t).

    Args:
      clients: int client ids [M].

    Returns:
      float32 [M, d] updates Delta w_k = w_k - w_t.
    """
    params = self.model.unflatten(self.server.weights)
    out = []
    clients = tf.convert_to_tensor(clients, tf.int32)
    n = int(clients.shape[0])
    for s in range(0, n, self.max_clients_per_chunk):
      ids = clients[s:s + self.max_clients_per_chunk]
      idx = tf.gather(self._client_indices, ids)
      sizes = tf.gather(self._client_sizes, ids)
      order = client_lib.draw_example_order(self._order_gen, sizes, int(idx.shape[1]),
                                            self.local_sgd.epochs)
      deltas = self.local_sgd(params, self._x, self._y, idx, sizes, order)
      out.append(self.model.flatten(deltas, batch_dims=1))
    return tf.concat(out, 0) if out else tf.zeros([0, self.dim], tf.float32)

  def run_round(self):
    """One communication round (without the budget check). Returns its RoundReport."""
    t0 = time.time()
    t = self.round_index + 1
    m = self.server.begin_round(*self.schedule(t), t)
    z = self.server.noise_multiplier()
    clip = self.server.clip()
    clients = self._sample_clients(m)
    records = self.client_updates(clients)
    # Non-finite updates are rejected: zeroed, masked out of the sum and counted.
    records, mask, rejected = self.server.screen(records)
    if self.diagnostics:
      vc, us = update_statistics(records, mask)
      vc, us = float(vc), float(us)
    else:
      vc = us = float("nan")
    self.server.apply(records, mask, m)
    if self.server.is_median:
      clip = self.server.clip()   # the median this round actually used
    self.round_index = t
    if self.average_decay is not None:
      w = tf.identity(self.server.weights)
      self._average = w if self._average is None else (
          self.average_decay * self._average + (1.0 - self.average_decay) * w)
    acc = avg_acc = None
    if self.eval_data is not None and (t % self.eval_every == 0):
      acc = model_lib.accuracy(self.model, self.model.unflatten(self.server.weights),
                               *self.eval_data)
      if self._average is not None:
        avg_acc = model_lib.accuracy(self.model, self.model.unflatten(self._average),
                                     *self.eval_data)
    eps, delta = self.server.guarantee()
    costs = (self.rounds[-1].communication_costs if self.rounds else 0) + int(records.shape[0])
    report = RoundReport(round=t, clients=int(records.shape[0]), noise_multiplier=z,
                         accuracy=acc, communication_rounds=t, communication_costs=costs,
                         clip=clip, between_clients_variance=vc, update_scale=us,
                         rejected=rejected, epsilon=eps, delta=delta,
                         seconds=time.time() - t0, average_accuracy=avg_acc)
    self.rounds.append(report)
    return report

  def run(self, max_rounds, callback=None):
    """Rounds until max_rounds or until the next round would pass the privacy budget.

    Args:
      max_rounds: an int >= 0.
      callback: optional callable(RoundReport) after every round.

    Returns:
      the RunReport.

    Raises:
      ParameterTypeError: max_rounds is not an int (a TypeError).
      ParameterValueError: max_rounds < 0.
      PrivacyConfigError: a schedule gives a bad m_t or sigma_t.
    """
    validation.check_integer("max_rounds", max_rounds, 0)
    reason = f"max_rounds={max_rounds} reached"
    for _ in range(max_rounds):
      t = self.round_index + 1
      m = self.server.begin_round(*self.schedule(t), t)
      over = self.server.would_exceed_budget(m, t)
      if over:
        reason = "privacy budget: " + over
        break
      rep = self.run_round()
      if callback is not None:
        callback(rep)
    return self.report(reason)

  def report(self, stopped_reason=""):
    """RunReport with the accountant's statement on the current ledger.

    Args:
      stopped_reason: why the run ended.

    Returns:
      a RunReport.
    """
    holds, statement, warnings = self.server.privacy_statement(self.diagnostics)
    return RunReport(list(self.rounds), stopped_reason, holds, statement, warnings)
