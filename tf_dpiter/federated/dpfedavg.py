"""Client-level DP federated averaging (seed 003, Algorithm 1; record/sample of seed 002, Table 1).

Each round t: the server samples m_t of the K clients (uniformly without replacement, as in
the paper, or Poisson with q_t = m_t / K); every sampled client runs ClientUpdate (E local
epochs of minibatch SGD, batch B, rate eta) from w_t and returns Delta w_k = w_k - w_t; the
flattened updates are the *records* and the round's clients the *sample* of a DPQuery wrapped
in `QueryWithLedger`, which clips them, adds Gaussian noise and records the sample in the
privacy ledger. The server takes the noised sum divided by the (public) expected sample
size m_t and applies it with plain addition or SGD with momentum:

    v_{t+1} = beta v_t + (sum_k pi_S(Delta w_k) + N(0, sigma^2 S^2)) / m_t
    w_{t+1} = w_t + eta_s v_{t+1}                         (beta = 0, eta_s = 1: the paper)

Before each round the accountant (tf_dpiter.accounting, on a copy of the ledger with the
round's planned sample added) says whether the round would push delta (at the fixed epsilon,
the paper's rule, epsilon = 8) above delta_0, or epsilon (at a fixed delta) above a target;
if so, training stops and w_t is returned.
"""

import dataclasses
import math
import time
from typing import List, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_dpiter import accounting
from tf_dpiter import dp_query as dpq
from tf_dpiter import ledger as ledger_lib
from tf_dpiter.federated import client as client_lib
from tf_dpiter.federated import model as model_lib
from tf_dpiter.federated import queries as queries_lib

SAMPLINGS = ("fixed_size", "poisson")


# ---------------------------------------------------------------------------------------------
# Schedules for m_t and sigma_t (seed 003, Section 6: raising m_t over training helps).

def as_schedule(name, value, integer=False):
  """A callable round -> value (rounds count from 1).

  `value`: a number (constant), a sequence (value[t-1], the last entry held after its end)
  or a callable of the round.
  """
  if callable(value):
    fn = value
  elif isinstance(value, (list, tuple, np.ndarray)):
    seq = list(value)
    if not seq:
      raise ValueError(f"{name} must not be an empty sequence")
    fn = lambda t: seq[min(t, len(seq)) - 1]
  elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
    fn = lambda t: value
  else:
    raise ValueError(f"{name} must be a number, a sequence or a callable, got {value!r}")

  def schedule(t):
    v = fn(t)
    if integer:
      if isinstance(v, float) and v.is_integer():
        v = int(v)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise ValueError(f"{name} at round {t} must be an int, got {v!r}")
      return int(v)
    v = float(v)
    if not math.isfinite(v):
      raise ValueError(f"{name} at round {t} must be finite, got {v!r}")
    return v

  return schedule


def linear_schedule(start, end, rounds, integer=False):
  """start at round 1, moving linearly to end at round `rounds`, then held."""
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1, got {rounds!r}")

  def fn(t):
    frac = min(max(t - 1, 0), rounds - 1) / max(rounds - 1, 1)
    v = start + (end - start) * frac
    return int(round(v)) if integer else v

  return fn


# ---------------------------------------------------------------------------------------------
# Queries.

QUERY_KINDS = ("quantile", "fixed", "median", "none")


def make_query(kind="quantile", noise_multiplier=1.0, clients_per_round=100, l2_norm_clip=1.0,
               target_unclipped_quantile=0.5, clip_learning_rate=0.2, clipped_count_stddev=None,
               seed=None):
  """The aggregation DPQuery of a round (records: flat client updates).

  kind: "quantile" (default; private adaptive clip, Andrew et al. 2021, starting at
  `l2_norm_clip`, count noise clipped_count_stddev = max(m/20, z) unless given; z is
  the total z), "fixed" (GaussianSumQuery with clip S, stddev z S), "median" (seed 003's
  median-norm clip: NOT private) or "none" (plain sum, epsilon = infinity).
  """
  if kind == "quantile":
    m = float(clients_per_round)
    # Andrew et al. suggest m/20; at least z so that the count takes <= 1/4 of the budget.
    cstd = max(m / 20.0, noise_multiplier) if clipped_count_stddev is None else clipped_count_stddev
    return dpq.QuantileAdaptiveClipSumQuery(
        initial_l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
        target_unclipped_quantile=target_unclipped_quantile, learning_rate=clip_learning_rate,
        clipped_count_stddev=cstd, expected_num_records=m, seed=seed)
  if kind == "fixed":
    return dpq.GaussianSumQuery(l2_norm_clip, noise_multiplier * l2_norm_clip, seed=seed)
  if kind == "median":
    return queries_lib.MedianNormClipSumQuery(noise_multiplier, l2_norm_clip, seed=seed)
  if kind == "none":
    return dpq.NoPrivacySumQuery()
  raise ValueError(f"kind must be one of {QUERY_KINDS}, got {kind!r}")


# ---------------------------------------------------------------------------------------------
# Reports.

@dataclasses.dataclass
class RoundReport:
  """One communication round. cr: rounds so far; cc: sum of m_t so far (seed 003, Table 1).

  between_clients_variance V_c and update_scale U_s (seed 003, Section 6) are computed on the
  round's unclipped updates: diagnostics of the simulation, NOT differentially private.
  epsilon/delta: the guarantee after this round (one of them is the fixed value).
  """
  round: int
  clients: int
  noise_multiplier: float
  accuracy: Optional[float]
  cr: int
  cc: int
  clip: Optional[float]
  between_clients_variance: float
  update_scale: float
  rejected: int
  epsilon: Optional[float]
  delta: Optional[float]
  seconds: float
  average_accuracy: Optional[float] = None


@dataclasses.dataclass
class RunReport:
  """The run: per-round reports, why it stopped, and the privacy statement."""
  rounds: List[RoundReport]
  stopped_reason: str
  guarantee_holds: bool
  privacy_statement: str
  warnings: Tuple[str, ...]

  @property
  def accuracy(self):
    accs = [r.accuracy for r in self.rounds if r.accuracy is not None]
    return accs[-1] if accs else None

  @property
  def average_accuracy(self):
    """Accuracy of the exponential moving average of w_t after the last round (if kept)."""
    accs = [r.average_accuracy for r in self.rounds if r.average_accuracy is not None]
    return accs[-1] if accs else None

  @property
  def cr(self):
    return len(self.rounds)

  @property
  def cc(self):
    return self.rounds[-1].cc if self.rounds else 0

  def __str__(self):
    lines = [f"rounds (CR) = {self.cr}, CC = {self.cc}, accuracy = {self.accuracy}"
             + ("" if self.average_accuracy is None
                else f", accuracy of the averaged model = {self.average_accuracy}"),
             f"stopped: {self.stopped_reason}", self.privacy_statement]
    lines += [f"WARNING: {w}" for w in self.warnings]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def update_statistics(records, mask):
  """(V_c, U_s) of seed 003, Section 6 over the rows of `records` with mask 1.

  V_c = (1/qp) sum_ij Var_k[Delta w_ij]; U_s = (1/qp) sum_ij mu_ij^2, mu = mean_k Delta w.
  """
  mask = tf.cast(mask, tf.float32)[:, None]
  n = tf.maximum(tf.reduce_sum(mask), 1.0)
  mu = tf.reduce_sum(records * mask, 0) / n
  var = tf.reduce_sum(tf.square(records - mu) * mask, 0) / n
  return tf.reduce_mean(var), tf.reduce_mean(tf.square(mu))


class DPServer:
  """Server side of client-level DP federated averaging, shared by the simulation
  (`DPFedAvg`) and the Flower strategy: it owns w_t, the DPQuery wrapped in
  `QueryWithLedger`, the ledger, the budget look-ahead and the server optimizer.

  Args:
    query: the inner DPQuery (records: flat updates [d]).
    initial_weights: flat float32 vector w_0 [d].
    population_size: K; clients_per_round: m of the first round (for the ledger).
    sampling, fixed_epsilon, max_delta, fixed_delta, max_epsilon, accountant,
    server_learning_rate, server_momentum: as in `DPFedAvg`.
  """

  def __init__(self, query, initial_weights, population_size, clients_per_round,
               sampling="fixed_size", fixed_epsilon=None, max_delta=None, fixed_delta=None,
               max_epsilon=None, accountant="rdp", server_learning_rate=1.0,
               server_momentum=0.0):
    if sampling not in SAMPLINGS:
      raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    if max_delta is not None and fixed_epsilon is None:
      raise ValueError(f"max_delta={max_delta!r} needs fixed_epsilon (delta is measured at a "
                       "fixed epsilon)")
    if max_epsilon is not None and fixed_delta is None:
      raise ValueError(f"max_epsilon={max_epsilon!r} needs fixed_delta")
    if fixed_epsilon is not None and fixed_delta is not None:
      raise ValueError(f"give fixed_epsilon or fixed_delta, not both (got {fixed_epsilon!r}, "
                       f"{fixed_delta!r})")
    if fixed_epsilon is not None:
      dpq.validation.check_positive("fixed_epsilon", fixed_epsilon)
    if fixed_delta is not None:
      dpq.validation.check_delta("fixed_delta", fixed_delta)
    if max_delta is not None:
      dpq.validation.check_delta("max_delta", max_delta)
    if max_epsilon is not None:
      dpq.validation.check_positive("max_epsilon", max_epsilon)
    if not isinstance(query, dpq.DPQuery):
      raise ValueError(f"query must be a DPQuery, got {query!r}")
    self.server_learning_rate = float(server_learning_rate)
    self.server_momentum = float(server_momentum)
    if not 0 <= self.server_momentum < 1:
      raise ValueError(f"server_momentum must be in [0, 1), got {server_momentum!r}")
    if not self.server_learning_rate > 0:
      raise ValueError(f"server_learning_rate must be > 0, got {server_learning_rate!r}")
    self.population_size = int(population_size)
    m1 = self.check_clients(clients_per_round, 1)
    self.inner_query = query
    self.sampling = sampling
    self.policy = ledger_lib.FIXED_SIZE if sampling == "fixed_size" else ledger_lib.POISSON
    self.query = ledger_lib.QueryWithLedger(
        query, self.population_size, m1 / self.population_size, policy=self.policy,
        sample_size=m1 if self.policy == ledger_lib.FIXED_SIZE else 0)
    self.ledger = self.query.ledger
    self.fixed_epsilon, self.max_delta = fixed_epsilon, max_delta
    self.fixed_delta, self.max_epsilon = fixed_delta, max_epsilon
    self.accountant = accountant
    self.w = tf.Variable(tf.convert_to_tensor(initial_weights, tf.float32), trainable=False)
    self.v = tf.Variable(tf.zeros_like(self.w), trainable=False)
    self.dim = int(self.w.shape[0])
    self._record_spec = tf.TensorSpec([self.dim], tf.float32)
    self.global_state = self.query.initial_global_state()
    self._aggregate_fns = {}
    self.is_median = isinstance(query, queries_lib.MedianNormClipSumQuery)
    self.is_non_private = isinstance(query, (dpq.NoPrivacySumQuery, dpq.NoPrivacyAverageQuery))

  def check_clients(self, m, t):
    if not isinstance(m, (int, np.integer)) or not 1 <= m <= self.population_size:
      raise ValueError(f"clients_per_round must be in [1, K={self.population_size}] at round "
                       f"{t}, got {m}")
    return int(m)

  def begin_round(self, m, noise_multiplier=None, t=None):
    """Sets the ledger's sampling (n = K, q = m/K, sample size m) and sigma_t for a round."""
    m = self.check_clients(m, t)
    q = m / self.population_size
    if self.policy == ledger_lib.FIXED_SIZE:
      self.query.set_sampling(self.population_size, q, m)
    else:
      self.query.set_sampling(self.population_size, q)
    if noise_multiplier is not None:
      self.global_state = queries_lib.set_noise_multiplier(self.inner_query, self.global_state,
                                                           noise_multiplier)
    if isinstance(self.inner_query, dpq.QuantileAdaptiveClipSumQuery):
      # The private quantile's fraction below uses the expected sample size m_t.
      self.global_state = self.inner_query.set_expected_num_records(self.global_state, m)
    return m

  def planned_events(self):
    """Events the next round's query will report: a dry run of the inner query on an empty
    sample with the current global state (the events of a private query depend on the
    global state only; for median clipping the last median stands in)."""
    state = self.inner_query.initial_sample_state(self._record_spec)
    _, _, events = self.inner_query.get_noised_result(state, self.global_state)
    return tuple(events)

  def noise_multiplier(self):
    """Total noise multiplier z of the next round (Eq. (1) of seed 002 over its events)."""
    events = [e for e in self.planned_events() if isinstance(e, dpq.GaussianSumEvent)]
    if not events:
      return 0.0
    return dpq.effective_noise_multiplier([float(e.l2_norm_clip) for e in events],
                                          [float(e.stddev) for e in events])

  def clip(self):
    """The clip the next round uses (None for queries without one)."""
    metrics = self.inner_query.derive_metrics(self.global_state)
    for key in ("clip", "l2_norm_clip"):
      if key in metrics:
        return float(metrics[key])
    return None

  def guarantee(self, ledger=None):
    """(epsilon, delta) of the ledger from tf_dpiter.accounting; (None, None) if no target."""
    ledger = self.ledger if ledger is None else ledger
    if self.fixed_epsilon is not None:
      return float(self.fixed_epsilon), accounting.delta(ledger, self.fixed_epsilon,
                                                         accountant=self.accountant)
    if self.fixed_delta is not None:
      return accounting.epsilon(ledger, self.fixed_delta, accountant=self.accountant), float(
          self.fixed_delta)
    return None, None

  def would_exceed_budget(self, m, t=None):
    """Accounts the ledger plus a planned round of m clients; a reason string or None."""
    if self.max_delta is None and self.max_epsilon is None:
      return None
    scratch = ledger_lib.PrivacyLedger.from_dict(self.ledger.to_dict())
    q = m / self.population_size
    scratch.record_sample(self.population_size, q, self.planned_events(), policy=self.policy,
                          sample_size=m if self.policy == ledger_lib.FIXED_SIZE else 0)
    eps, delta = self.guarantee(scratch)
    label = f"round {t}" if t is not None else "the next round"
    if self.max_delta is not None and delta > self.max_delta:
      return (f"{label} would raise delta at epsilon={self.fixed_epsilon} to {delta:.3g} > "
              f"max_delta={self.max_delta}")
    if self.max_epsilon is not None and eps > self.max_epsilon:
      return (f"{label} would raise epsilon at delta={self.fixed_delta} to {eps:.4g} > "
              f"max_epsilon={self.max_epsilon}")
    return None

  def _aggregate_fn(self, m):
    if m not in self._aggregate_fns:
      query, inner = self.query, self.inner_query

      def aggregate(records, mask, global_state):
        params = query.derive_sample_params(global_state)
        state = query.initial_sample_state(self._record_spec)
        # Accumulation goes to the inner query (QueryWithLedger passes every other method
        # through, but its accumulate_records assumes a sum-aggregation inner query); the
        # wrapper's get_noised_result records the sample in the ledger.
        state = inner.accumulate_records(params, state, records, mask)
        result, new_state, _ = query.get_noised_result(state, global_state)
        return result, new_state

      self._aggregate_fns[m] = tf.function(aggregate, reduce_retracing=True)
    return self._aggregate_fns[m]

  @staticmethod
  def screen(records):
    """(records with non-finite rows zeroed, mask [M] of accepted rows, rejected count)."""
    records = tf.convert_to_tensor(records, tf.float32)
    finite = tf.reduce_all(tf.math.is_finite(records), axis=1)
    rejected = int(tf.shape(records)[0]) - int(tf.reduce_sum(tf.cast(finite, tf.int32)))
    return tf.where(finite[:, None], records, 0.0), tf.cast(finite, tf.float32), rejected

  def apply(self, records, mask, m):
    """Aggregates the round's records through the query (ledger entry) and steps w.

    The noised sum is divided by the public expected sample size m_t, then
    v <- beta v + update; w <- w + eta_s v.
    """
    noised_sum, self.global_state = self._aggregate_fn(int(m))(records, mask, self.global_state)
    update = noised_sum / float(m)
    self.v.assign(self.server_momentum * self.v + update)
    self.w.assign_add(self.server_learning_rate * self.v)
    return update

  def privacy_statement(self, diagnostics=False):
    """(guarantee_holds, statement, warnings) for a run report."""
    warnings = []
    holds = not (self.is_median or self.is_non_private)
    if self.is_median:
      warnings.append(queries_lib.NOT_PRIVATE_WARNING)
    if diagnostics:
      warnings.append("V_c and U_s are computed on raw client updates: simulation "
                      "diagnostics, not differentially private")
    if int(self.ledger.sample_count) == 0:
      statement = "no round run: nothing recorded in the ledger"
    elif self.fixed_epsilon is not None or self.fixed_delta is not None:
      kw = ({"epsilon": self.fixed_epsilon} if self.fixed_epsilon is not None
            else {"delta": self.fixed_delta})
      statement = str(accounting.privacy_report(self.ledger, accountant=self.accountant, **kw))
    else:
      statement = (f"{int(self.ledger.sample_count)} samples recorded; call "
                   "tf_dpiter.accounting.epsilon(ledger, delta) for the guarantee")
    if self.is_median:
      statement = "NOT PRIVATE (median-norm clip): " + statement
    return holds, statement, tuple(warnings)


class DPFedAvg:
  """Client-level DP federated averaging, simulated with vectorized clients.

  Args:
    model: an `MLP` (the paper's model: MLP((784, 600, 100, 10), use_bias=False)).
    data: a `FederatedData` partition (K = data.num_clients).
    query: the aggregation DPQuery (records: flat updates [d]); default
      make_query("quantile", noise_multiplier(1), clients_per_round(1)).
    clients_per_round: m_t: int, sequence or callable of the round (1-based).
    noise_multiplier: sigma_t schedule; None keeps the query's own z. Changed between rounds
      with `queries.set_noise_multiplier`.
    local_epochs, batch_size, client_learning_rate: E, B (examples), eta of ClientUpdate.
    server_learning_rate, server_momentum: eta_s, beta of the server step (1, 0: the paper).
    sampling: "fixed_size" (m_t clients uniformly without replacement; ledger policy
      fixed_size) or "poisson" (each client with q_t = m_t/K; ledger policy poisson).
    fixed_epsilon + max_delta: stop before delta(fixed_epsilon) would exceed max_delta
      (seed 003: epsilon = 8, delta_0); fixed_delta + max_epsilon: stop before
      epsilon(fixed_delta) would exceed max_epsilon. Either alone only reports the other.
    accountant: "rdp" (required for fixed_size sampling) or "pld".
    eval_data: (x, y) for per-round accuracy, or None.
    initial_params: list of numpy arrays, else model.init_params(seed).
    seed: fixes sampling, shuffling and initialization (tests only: sampling from a fixed
      seed is not private).
    max_clients_per_chunk: clients trained together in one vectorized call (memory bound).
    diagnostics: compute V_c and U_s each round.
    average_decay: beta in [0, 1): also keep the exponential moving average
      a_t = beta a_{t-1} + (1 - beta) w_t (a_1 = w_1) of the server models and report its
      accuracy. Post-processing of the released w_t: no privacy cost. None: not kept.
  """

  def __init__(self, model, data, query=None, clients_per_round=10, noise_multiplier=None,
               local_epochs=1, batch_size=60, client_learning_rate=0.1,
               server_learning_rate=1.0, server_momentum=0.0, sampling="fixed_size",
               fixed_epsilon=None, max_delta=None, fixed_delta=None, max_epsilon=None,
               accountant="rdp", eval_data=None, initial_params=None, seed=None,
               max_clients_per_chunk=128, diagnostics=True, eval_every=1, average_decay=None):
    if average_decay is not None and not (0.0 <= float(average_decay) < 1.0):
      raise ValueError(f"average_decay must be None or in [0, 1), got {average_decay!r}")
    self.average_decay = None if average_decay is None else float(average_decay)
    self._average = None
    if not isinstance(max_clients_per_chunk, int) or max_clients_per_chunk < 1:
      raise ValueError(f"max_clients_per_chunk must be an int >= 1, got {max_clients_per_chunk!r}")
    self.model = model
    self.data = data
    self.num_clients = data.num_clients
    self._m_schedule = as_schedule("clients_per_round", clients_per_round, integer=True)
    self._z_schedule = (None if noise_multiplier is None
                        else as_schedule("noise_multiplier", noise_multiplier))
    m1 = self._m_schedule(1)
    if query is None:
      z1 = self._z_schedule(1) if self._z_schedule else 1.0
      query = make_query("quantile", z1, m1, seed=seed)
    params = initial_params if initial_params is not None else model.init_params(seed)
    self.server = DPServer(query, model.flatten([tf.constant(p) for p in params]),
                           self.num_clients, m1, sampling=sampling,
                           fixed_epsilon=fixed_epsilon, max_delta=max_delta,
                           fixed_delta=fixed_delta, max_epsilon=max_epsilon,
                           accountant=accountant, server_learning_rate=server_learning_rate,
                           server_momentum=server_momentum)
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
    self.round_index = 0

  @property
  def params(self):
    """The server model w_t as a list of numpy arrays."""
    return [p.numpy() for p in self.model.unflatten(self.server.w)]

  @property
  def average_params(self):
    """The moving average of the server models (average_decay), or None."""
    if self._average is None:
      return None
    return [p.numpy() for p in self.model.unflatten(self._average)]

  def _begin_round(self, t):
    m = self._m_schedule(t)
    z = self._z_schedule(t) if self._z_schedule is not None else None
    return self.server.begin_round(m, z, t)

  def _sample_clients(self, m):
    k = self.num_clients
    keys = self._sample_gen.uniform([k])
    if self.sampling == "fixed_size":
      return tf.argsort(keys)[:m]
    return tf.cast(tf.where(keys < m / k)[:, 0], tf.int32)

  def client_updates(self, clients):
    """Flattened updates [M, d] of the given clients (vectorized ClientUpdate from w_t)."""
    params = self.model.unflatten(self.server.w)
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
    if not out:
      return tf.zeros([0, self.dim], tf.float32)
    return tf.concat(out, 0)

  def run_round(self):
    """One communication round (without the budget check). Returns its RoundReport."""
    t0 = time.time()
    t = self.round_index + 1
    m = self._begin_round(t)
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
      w = tf.identity(self.server.w)
      self._average = w if self._average is None else (
          self.average_decay * self._average + (1.0 - self.average_decay) * w)
    acc = avg_acc = None
    if self.eval_data is not None and (t % self.eval_every == 0):
      acc = model_lib.accuracy(self.model, self.model.unflatten(self.server.w), *self.eval_data)
      if self._average is not None:
        avg_acc = model_lib.accuracy(self.model, self.model.unflatten(self._average),
                                     *self.eval_data)
    eps, delta = self.server.guarantee()
    cc = (self.rounds[-1].cc if self.rounds else 0) + int(records.shape[0])
    report = RoundReport(round=t, clients=int(records.shape[0]), noise_multiplier=z,
                         accuracy=acc, cr=t, cc=cc, clip=clip, between_clients_variance=vc,
                         update_scale=us, rejected=rejected, epsilon=eps, delta=delta,
                         seconds=time.time() - t0, average_accuracy=avg_acc)
    self.rounds.append(report)
    return report

  def run(self, max_rounds, callback=None):
    """Rounds until max_rounds or until the next round would pass the privacy budget."""
    if not isinstance(max_rounds, int) or max_rounds < 0:
      raise ValueError(f"max_rounds must be an int >= 0, got {max_rounds!r}")
    reason = f"max_rounds={max_rounds} reached"
    for _ in range(max_rounds):
      t = self.round_index + 1
      m = self._begin_round(t)
      over = self.server.would_exceed_budget(m, t)
      if over:
        reason = "privacy budget: " + over
        break
      rep = self.run_round()
      if callback is not None:
        callback(rep)
    return self.report(reason)

  def report(self, stopped_reason=""):
    """RunReport with the accountant's statement on the current ledger."""
    holds, statement, warnings = self.server.privacy_statement(self.diagnostics)
    return RunReport(list(self.rounds), stopped_reason, holds, statement, warnings)
