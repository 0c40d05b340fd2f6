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
  `l2_norm_clip`, count noise clipped_count_stddev = m/20 unless given; noise_multiplier is
  the total z), "fixed" (GaussianSumQuery with clip S, stddev z S), "median" (seed 003's
  median-norm clip: NOT private) or "none" (plain sum, epsilon = infinity).
  """
  if kind == "quantile":
    m = float(clients_per_round)
    cstd = m / 20.0 if clipped_count_stddev is None else clipped_count_stddev
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
  def cr(self):
    return len(self.rounds)

  @property
  def cc(self):
    return self.rounds[-1].cc if self.rounds else 0

  def __str__(self):
    lines = [f"rounds (CR) = {self.cr}, CC = {self.cc}, accuracy = {self.accuracy}",
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
  """

  def __init__(self, model, data, query=None, clients_per_round=10, noise_multiplier=None,
               local_epochs=1, batch_size=60, client_learning_rate=0.1,
               server_learning_rate=1.0, server_momentum=0.0, sampling="fixed_size",
               fixed_epsilon=None, max_delta=None, fixed_delta=None, max_epsilon=None,
               accountant="rdp", eval_data=None, initial_params=None, seed=None,
               max_clients_per_chunk=128, diagnostics=True, eval_every=1):
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
    if not isinstance(max_clients_per_chunk, int) or max_clients_per_chunk < 1:
      raise ValueError(f"max_clients_per_chunk must be an int >= 1, got {max_clients_per_chunk!r}")
    self.model = model
    self.data = data
    self.num_clients = data.num_clients
    self._m_schedule = as_schedule("clients_per_round", clients_per_round, integer=True)
    self._z_schedule = (None if noise_multiplier is None
                        else as_schedule("noise_multiplier", noise_multiplier))
    m1 = self._clients(1)
    if query is None:
      z1 = self._z_schedule(1) if self._z_schedule else 1.0
      query = make_query("quantile", z1, m1, seed=seed)
    if not isinstance(query, dpq.DPQuery):
      raise ValueError(f"query must be a DPQuery, got {query!r}")
    self.inner_query = query
    policy = ledger_lib.FIXED_SIZE if sampling == "fixed_size" else ledger_lib.POISSON
    if m1 == self.num_clients and sampling == "fixed_size":
      policy_q = 1.0
    else:
      policy_q = m1 / self.num_clients
    self.query = ledger_lib.QueryWithLedger(query, self.num_clients, policy_q, policy=policy,
                                            sample_size=m1 if policy == ledger_lib.FIXED_SIZE else 0)
    self.ledger = self.query.ledger
    self.sampling = sampling
    self.local_sgd = client_lib.LocalSGD(model, local_epochs, batch_size, client_learning_rate)
    self.server_learning_rate = float(server_learning_rate)
    self.server_momentum = float(server_momentum)
    if not 0 <= self.server_momentum < 1:
      raise ValueError(f"server_momentum must be in [0, 1), got {server_momentum!r}")
    if not self.server_learning_rate > 0:
      raise ValueError(f"server_learning_rate must be > 0, got {server_learning_rate!r}")
    self.fixed_epsilon, self.max_delta = fixed_epsilon, max_delta
    self.fixed_delta, self.max_epsilon = fixed_delta, max_epsilon
    self.accountant = accountant
    self.eval_data = eval_data
    self.eval_every = int(eval_every)
    self.diagnostics = diagnostics
    self.max_clients_per_chunk = max_clients_per_chunk
    params = initial_params if initial_params is not None else model.init_params(seed)
    self._w = tf.Variable(model.flatten([tf.constant(p) for p in params]), trainable=False)
    self._v = tf.Variable(tf.zeros_like(self._w), trainable=False)
    self.dim = int(self._w.shape[0])
    self._record_spec = tf.TensorSpec([self.dim], tf.float32)
    self.global_state = self.query.initial_global_state()
    self._sample_gen = dpq.make_generator(seed)
    self._order_gen = (tf.random.Generator.from_seed(int(seed) + 1) if seed is not None
                       else tf.random.Generator.from_non_deterministic_state())
    self._x = tf.constant(data.x.reshape(data.x.shape[0], -1))
    self._y = tf.constant(data.y)
    self._client_indices = tf.constant(data.client_indices)
    self._client_sizes = tf.constant(data.client_sizes)
    self.rounds: List[RoundReport] = []
    self.round_index = 0
    self._aggregate_fns = {}
    self.is_median = isinstance(query, queries_lib.MedianNormClipSumQuery)
    self.is_non_private = isinstance(query, (dpq.NoPrivacySumQuery, dpq.NoPrivacyAverageQuery))

  # -- helpers -------------------------------------------------------------------------------

  @property
  def params(self):
    """The server model w_t as a list of numpy arrays."""
    return [p.numpy() for p in self.model.unflatten(self._w)]

  def _clients(self, t):
    m = self._m_schedule(t)
    if not 1 <= m <= self.num_clients:
      raise ValueError(f"clients_per_round must be in [1, K={self.num_clients}] at round {t}, "
                       f"got {m}")
    return m

  def _set_round_parameters(self, t):
    m = self._clients(t)
    if self.sampling == "fixed_size":
      q = m / self.num_clients
      self.query.set_sampling(self.num_clients, q, m)
    else:
      self.query.set_sampling(self.num_clients, m / self.num_clients)
    if self._z_schedule is not None:
      z = self._z_schedule(t)
      self.global_state = queries_lib.set_noise_multiplier(self.inner_query, self.global_state, z)
    if isinstance(self.inner_query, dpq.QuantileAdaptiveClipSumQuery):
      # The private quantile's fraction below uses the expected sample size m_t.
      self.inner_query._quantile._expected_num_records = float(m)  # pylint: disable=protected-access
    return m

  def current_noise_multiplier(self):
    """Total noise multiplier z of the next round (Eq. (1) of seed 002 over its events)."""
    events = self._planned_events()
    clips = [float(e.l2_norm_clip) for e in events if isinstance(e, dpq.GaussianSumEvent)]
    stds = [float(e.stddev) for e in events if isinstance(e, dpq.GaussianSumEvent)]
    if not clips:
      return 0.0
    if any(s == 0 for s in stds):
      return 0.0
    return float(sum((c / s) ** 2 for c, s in zip(clips, stds)) ** -0.5)

  def _planned_events(self):
    """Events the next round's query will report: a dry run of the inner query on an empty
    sample with the current global state (the events of a private query depend on the
    global state only; for median clipping the last median stands in)."""
    state = self.inner_query.initial_sample_state(self._record_spec)
    _, _, events = self.inner_query.get_noised_result(state, self.global_state)
    return tuple(events)

  def _guarantee(self, ledger):
    if self.fixed_epsilon is not None:
      return float(self.fixed_epsilon), accounting.delta(ledger, self.fixed_epsilon,
                                                         accountant=self.accountant)
    if self.fixed_delta is not None:
      return accounting.epsilon(ledger, self.fixed_delta, accountant=self.accountant), float(
          self.fixed_delta)
    return None, None

  def _would_exceed_budget(self, m):
    """Accounts the ledger plus the planned round; returns a reason string or None."""
    if self.max_delta is None and self.max_epsilon is None:
      return None
    scratch = ledger_lib.PrivacyLedger.from_dict(self.ledger.to_dict())
    q = m / self.num_clients
    if self.sampling == "fixed_size":
      scratch.record_sample(self.num_clients, q, self._planned_events(), policy="fixed_size",
                            sample_size=m)
    else:
      scratch.record_sample(self.num_clients, q, self._planned_events(), policy="poisson")
    eps, delta = self._guarantee(scratch)
    if self.max_delta is not None and delta > self.max_delta:
      return (f"round {self.round_index + 1} would raise delta at epsilon={self.fixed_epsilon} "
              f"to {delta:.3g} > max_delta={self.max_delta}")
    if self.max_epsilon is not None and eps > self.max_epsilon:
      return (f"round {self.round_index + 1} would raise epsilon at delta={self.fixed_delta} "
              f"to {eps:.4g} > max_epsilon={self.max_epsilon}")
    return None

  def _sample_clients(self, m):
    k = self.num_clients
    if self.sampling == "fixed_size":
      keys = self._sample_gen.uniform([k])
      return tf.argsort(keys)[:m]
    keys = self._sample_gen.uniform([k])
    return tf.cast(tf.where(keys < m / k)[:, 0], tf.int32)

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

  def client_updates(self, clients):
    """Flattened updates [M, d] of the given clients (vectorized ClientUpdate from w_t)."""
    params = self.model.unflatten(self._w)
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

  # -- the algorithm -------------------------------------------------------------------------

  def run_round(self):
    """One communication round (without the budget check). Returns its RoundReport."""
    t0 = time.time()
    t = self.round_index + 1
    m = self._set_round_parameters(t)
    z = self.current_noise_multiplier()
    clients = self._sample_clients(m)
    records = self.client_updates(clients)
    # Non-finite updates are rejected: zeroed, masked out of the sum and counted.
    finite = tf.reduce_all(tf.math.is_finite(records), axis=1)
    mask = tf.cast(finite, tf.float32)
    records = tf.where(finite[:, None], records, 0.0)
    rejected = int(tf.shape(records)[0]) - int(tf.reduce_sum(tf.cast(finite, tf.int32)))
    if self.diagnostics:
      vc, us = update_statistics(records, mask)
      vc, us = float(vc), float(us)
    else:
      vc = us = float("nan")
    clip_before = self.inner_query.derive_metrics(self.global_state)
    noised_sum, self.global_state = self._aggregate_fn(m)(records, mask, self.global_state)
    # The noised sum divided by the public (expected) sample size m_t.
    update = noised_sum / float(m)
    self._v.assign(self.server_momentum * self._v + update)
    self._w.assign_add(self.server_learning_rate * self._v)
    self.round_index = t
    clip = self._clip_used(clip_before)
    acc = None
    if self.eval_data is not None and (t % self.eval_every == 0):
      acc = model_lib.accuracy(self.model, self.model.unflatten(self._w), *self.eval_data)
    eps, delta = self._guarantee(self.ledger) if (
        self.fixed_epsilon is not None or self.fixed_delta is not None) else (None, None)
    cc = (self.rounds[-1].cc if self.rounds else 0) + int(records.shape[0])
    report = RoundReport(round=t, clients=int(records.shape[0]), noise_multiplier=z,
                         accuracy=acc, cr=t, cc=cc, clip=clip, between_clients_variance=vc,
                         update_scale=us, rejected=rejected, epsilon=eps, delta=delta,
                         seconds=time.time() - t0)
    self.rounds.append(report)
    return report

  def _clip_used(self, metrics_before):
    if self.is_median:
      return float(self.global_state.l2_norm_clip)
    for key in ("clip", "l2_norm_clip"):
      if key in metrics_before:
        return float(metrics_before[key])
    return None

  def run(self, max_rounds, callback=None):
    """Rounds until max_rounds or until the next round would pass the privacy budget."""
    if not isinstance(max_rounds, int) or max_rounds < 0:
      raise ValueError(f"max_rounds must be an int >= 0, got {max_rounds!r}")
    reason = f"max_rounds={max_rounds} reached"
    for _ in range(max_rounds):
      m = self._set_round_parameters(self.round_index + 1)
      over = self._would_exceed_budget(m)
      if over:
        reason = "privacy budget: " + over
        break
      rep = self.run_round()
      if callback is not None:
        callback(rep)
    return self.report(reason)

  def report(self, stopped_reason=""):
    """RunReport with the accountant's statement on the current ledger."""
    warnings = []
    holds = True
    if self.is_median:
      holds = False
      warnings.append(queries_lib.NOT_PRIVATE_WARNING)
    if self.is_non_private:
      holds = False
    if self.diagnostics:
      warnings.append("V_c and U_s are computed on raw client updates: simulation "
                      "diagnostics, not differentially private")
    if int(self.ledger.sample_count) == 0:
      statement = "no round run: nothing recorded in the ledger"
    elif self.fixed_epsilon is not None or self.fixed_delta is not None:
      kw = ({"epsilon": self.fixed_epsilon} if self.fixed_epsilon is not None
            else {"delta": self.fixed_delta})
      rep = accounting.privacy_report(self.ledger, accountant=self.accountant, **kw)
      statement = str(rep)
    else:
      statement = (f"{int(self.ledger.sample_count)} samples recorded; call "
                   "tf_dpiter.accounting.epsilon(ledger, delta) for the guarantee")
    if not holds and self.is_median:
      statement = "NOT PRIVATE (median-norm clip): " + statement
    return RunReport(list(self.rounds), stopped_reason, holds, statement, tuple(warnings))
