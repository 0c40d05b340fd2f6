"""The server of client-level DP federated averaging (Geyer et al. 2017, Algorithm 1, server side).

`DPServer` (the simulation's and the Flower strategies') owns w_t, the DPQuery in
`QueryWithLedger` (records: the round's flat client updates), the ledger, the budget
look-ahead and the server optimizer

    v_{t+1} = beta v_t + (sum_k pi_S(Delta w_k) + N(0, sigma^2 S^2)) / m_t
    w_{t+1} = w_t + eta_s v_{t+1}                         (beta = 0, eta_s = 1: the paper)

Relation: one client's data replaced (fixed-size sampling, policy client_fixed_size) or added
or removed (Poisson, q_t = m_t / K, policy client_poisson); the unit of privacy is the client,
and the ledger's rows say so (the policies' `unit`).

Floating point: the clip, the sum over clients and the noise run in float64 (the clients'
float32 updates cast exactly), each client's clip shrunk by `summation.shrink` of the plan's
rounding margin for K rows (the public population bounds a round's clients, so the factor
does not depend on who replied); the noised sum is cast to float32 afterwards
(post-processing). One client then moves the computed sum by at most S (add/remove) or 2 S
(replace one), the ledger's sensitivity (Casacuberta et al., "Widespread underestimation of
sensitivity in differentially private libraries and how to fix it", CCS 2022).
"""

import dataclasses

import numpy as np
import tensorflow as tf

from tf_dpiter import accounting
from tf_dpiter import dp_query as dpq
from tf_dpiter import ledger as ledger_lib
from tf_dpiter import validation
from tf_dpiter.accounting import lookahead
from tf_dpiter.dp_query import summation
from tf_dpiter.errors import BudgetConfigError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.federated import queries as queries_lib
from tf_dpiter.federated import server_journal

__all__ = ["SAMPLINGS", "DPServer", "sample_clients"]

SAMPLINGS = ("fixed_size", "poisson")
# The ledger policy of each sampling: its relation (replace one client / add or remove one) and
# its unit, the client.
CLIENT_POLICIES = {"fixed_size": ledger_lib.CLIENT_FIXED_SIZE,
                   "poisson": ledger_lib.CLIENT_POISSON}


def sample_clients(generator, population_size, m, sampling):
  """The ids of a round's clients, drawn by the law the ledger records for the round.

  fixed_size: a uniform m-subset of the K clients, the m smallest of K float64 uniform keys,
  all K keys redrawn when two tie (probability <= K^2 2^-53; given no tie the subset is
  exactly uniform). poisson: client i joins iff u_i < m/K, u_i a float64 uniform on the
  2^-52 grid, so P = q up to 2^-52.

  Args:
    generator: the round's tf.random.Generator (Philox).
    population_size: K.
    m: the clients per round m_t (the expected count under poisson).
    sampling: "fixed_size" or "poisson".

  Returns:
    int32 ids [m] (fixed_size, in key order) or [<= K] (poisson, ascending).
  """
  k = int(population_size)
  while True:   # eager, once per round: the redraw needs the keys on the host
    keys = generator.uniform([k], dtype=tf.float64)
    if sampling == "poisson":
      return tf.cast(tf.where(keys < m / k)[:, 0], tf.int32)
    if int(tf.size(tf.unique(keys)[0])) == k:
      return tf.cast(tf.argsort(keys)[:m], tf.int32)


_CLIENT_UNIT = ("unit: one client; a record is one client's update from all of its examples, "
               "so an example several clients hold (partition_iid and partition_noniid_shards "
               "repeat examples when K x examples_per_client > len(x)) is covered only as a "
               "group of those clients")


def _client_level(report):
  """A ledger's `PrivacyReport` restated for one client, the unit of client-level DP (a record
  is one client's update: Geyer et al. 2017, Section 2.3), with `_CLIENT_UNIT` added."""
  relation = "neighbouring relation:"
  lines = tuple(a.replace("one example", "one client", 1) if a.startswith(relation) else a
                for a in report.assumptions)
  return dataclasses.replace(report, assumptions=lines + (_CLIENT_UNIT,))


class DPServer:
  """Server side of client-level DP federated averaging (module docstring).

  Args:
    query: the inner DPQuery (records: flat updates [d]).
    initial_weights: flat float32 vector w_0 [d].
    population_size: K.
    clients_per_round: m of the first round (for the ledger).
    sampling: "fixed_size" or "poisson" (as in `DPFedAvg`).
    fixed_epsilon: with max_delta, a budget in delta (as in `DPFedAvg`).
    max_delta: the largest delta allowed at fixed_epsilon.
    fixed_delta: with max_epsilon, a budget in epsilon (as in `DPFedAvg`).
    max_epsilon: the largest epsilon allowed at fixed_delta.
    accountant: "rdp" or "pld".
    server_learning_rate: eta_s (as in `DPFedAvg`).
    server_momentum: beta of the server step (as in `DPFedAvg`).
    ledger_journal: optional path of the ledger's journal (`server_journal`): each round is
      appended before its sum leaves the server, and an existing journal is resumed (its
      rounds count in epsilon and the budget) or refused (another recipe, an altered file).
      None: the ledger is held in memory only, and a restart starts it from 0.
    journal_key: optional str/bytes, the HMAC key of the journal's chunks.

  Attributes:
    weights: the server model w_t, a float32 variable [d].
    velocity: the server momentum buffer v_t, a float32 variable [d].
    query: the `QueryWithLedger` wrapping `inner_query`; ledger: its `PrivacyLedger`.
    journal: the `ledger.LedgerJournal` (or None); resumed_rounds: the rounds it held.

  Raises:
    ParameterTypeError: `query` is not a DPQuery, or a server rate that is not a number.
    BudgetConfigError: an inconsistent or out-of-range budget.
    PrivacyConfigError: a bad sampling, population or clients_per_round; a journal of
      another recipe (`server_journal.check_recipe`).
    ParameterValueError: server_momentum outside [0, 1) or server_learning_rate <= 0; an
      altered journal.
  """

  def __init__(self, query, initial_weights, population_size, clients_per_round,
               sampling="fixed_size", fixed_epsilon=None, max_delta=None, fixed_delta=None,
               max_epsilon=None, accountant="rdp", server_learning_rate=1.0,
               server_momentum=0.0, ledger_journal=None, journal_key=None):
    validation.check_one_of("sampling", sampling, SAMPLINGS, PrivacyConfigError)
    if max_delta is not None and fixed_epsilon is None:
      raise BudgetConfigError(f"max_delta={max_delta!r} needs fixed_epsilon (delta is measured at a "
                       "fixed epsilon)")
    if max_epsilon is not None and fixed_delta is None:
      raise BudgetConfigError(f"max_epsilon={max_epsilon!r} needs fixed_delta")
    if fixed_epsilon is not None and fixed_delta is not None:
      raise BudgetConfigError(f"give fixed_epsilon or fixed_delta, not both (got {fixed_epsilon!r}, "
                       f"{fixed_delta!r})")
    positive = validation.Optional(validation.Interval(float, 0, None, "neither"))
    delta = validation.Optional(validation.Interval(float, 0, 1, "neither"))
    validation.check_params({"fixed_epsilon": positive, "fixed_delta": delta, "max_delta": delta,
                             "max_epsilon": positive, "server_momentum": validation.Interval(
                                 float, 0, 1, "left", error=ParameterValueError)}, locals())
    if max_epsilon is not None or max_delta is not None:
      accounting.accountant.check_bound_accountant(accountant, "a max_epsilon / max_delta budget")
    validation.check_instance("query", query, dpq.DPQuery, "a DPQuery")
    self.server_learning_rate = float(validation.check_positive(
        "server_learning_rate", server_learning_rate, error=ParameterValueError))
    self.server_momentum = float(server_momentum)
    self.population_size = int(population_size)
    m1 = self.check_clients(clients_per_round, 1)
    self.inner_query = query
    self.sampling = sampling
    # a record is one client's update: the client-unit policies (Geyer et al., Section 2)
    self.policy = CLIENT_POLICIES[sampling]
    self.query = ledger_lib.QueryWithLedger(
        query, self.population_size, m1 / self.population_size, policy=self.policy,
        sample_size=m1 if sampling == "fixed_size" else 0)
    self.ledger = self.query.ledger
    self.fixed_epsilon, self.max_delta = fixed_epsilon, max_delta
    self.fixed_delta, self.max_epsilon = fixed_delta, max_epsilon
    self.accountant = accountant
    self.weights = tf.Variable(tf.convert_to_tensor(initial_weights, tf.float32),
                               trainable=False)
    self.velocity = tf.Variable(tf.zeros_like(self.weights), trainable=False)
    self.dim = int(self.weights.shape[0])
    self._record_spec = tf.TensorSpec([self.dim], tf.float64)
    # The clip shrink of a float64 sum of at most K clients (the pinned tree), with the
    # roundings of each client's own products charged as `products`: its norm (d squares
    # summed in any order: low by at most gamma_d / 2 plus the square root's u, Higham,
    # Sec. 4.2), the clip factor, the product, the mask times this factor: d + 8.
    self._shrink = summation.shrink(
        summation.rounding_margin(self.population_size, dtype=tf.float64,
                                  products=self.dim + 8), tf.float64)
    self.global_state = self.query.initial_global_state()
    self._aggregate_fns = {}
    self.is_median = isinstance(query, queries_lib.MedianNormClipSumQuery)
    self.is_non_private = isinstance(query, (dpq.NoPrivacySumQuery, dpq.NoPrivacyAverageQuery))
    self.journal, self.resumed_rounds = None, 0
    if ledger_journal is not None:
      self.journal, self.resumed_rounds = server_journal.resume(self, ledger_journal,
                                                                journal_key)

  def check_clients(self, m, t):
    """m as an int, checked.

    Args:
      m: the clients of a round.
      t: the round (for the message).

    Returns:
      int(m).

    Raises:
      PrivacyConfigError: m is not an int in [1, K].
    """
    if not isinstance(m, (int, np.integer)) or not 1 <= m <= self.population_size:
      raise PrivacyConfigError(f"clients_per_round must be in [1, K={self.population_size}] at round "
                       f"{t}, got {m}")
    return int(m)

  def begin_round(self, m, noise_multiplier=None, t=None):
    """Sets the ledger's sampling (n = K, q = m/K, sample size m) and sigma_t for a round.

    Args:
      m: the clients of the round.
      noise_multiplier: sigma_t, or None to keep the query's.
      t: the round (for messages).

    Returns:
      m, checked.

    Raises:
      PrivacyConfigError: a bad m or noise multiplier.
    """
    m = self.check_clients(m, t)
    q = m / self.population_size
    if self.sampling == "fixed_size":
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
    sample (a private query's events depend on the global state only).

    Returns:
      a tuple of privacy events (`dp_query.GaussianSumEvent`, ...).
    """
    state = self.inner_query.initial_sample_state(self._record_spec)
    _, _, events = self.inner_query.get_noised_result(state, self.global_state)
    return tuple(events)

  def noise_multiplier(self):
    """Total noise multiplier z of the next round (Eq. (1) of McMahan et al. 2018 over its events).

    Returns:
      z, a float (0.0 without a Gaussian event).
    """
    events = [e for e in self.planned_events() if isinstance(e, dpq.GaussianSumEvent)]
    if not events:
      return 0.0
    return accounting.effective_noise_multiplier([float(e.l2_norm_clip) for e in events],
                                                 [float(e.stddev) for e in events])

  def clip(self):
    """The clip S the next round uses.

    Returns:
      a float, or None for queries without one.
    """
    metrics = self.inner_query.derive_metrics(self.global_state)
    for key in ("clip", "l2_norm_clip"):
      if key in metrics:
        return float(metrics[key])
    return None

  def guarantee(self):
    """The ledger's guarantee so far, from tf_dpiter.accounting.

    Returns:
      (epsilon, delta) with one of them the fixed target (fixed_epsilon or fixed_delta);
      (None, None) without a target.
    """
    if self.fixed_epsilon is not None:
      return float(self.fixed_epsilon), accounting.delta(self.ledger, self.fixed_epsilon,
                                                         accountant=self.accountant)
    if self.fixed_delta is not None:
      return accounting.epsilon(self.ledger, self.fixed_delta, accountant=self.accountant), float(
          self.fixed_delta)
    return None, None

  def planned_sample(self, m):
    """The next round of m clients as the ledger will record it.

    Args:
      m: the clients of the round.

    Returns:
      a `lookahead.PlannedSample` (n = K, q = m/K, the planned events, the policy).
    """
    return lookahead.PlannedSample(
        self.population_size, m / self.population_size, self.planned_events(),
        policy=self.policy, sample_size=m if self.sampling == "fixed_size" else 0)

  def would_exceed_budget(self, m, t=None):
    """Accounts the ledger plus a planned round of m clients (`lookahead.report_after`).

    Args:
      m: the clients of the next round.
      t: its number (for the message).

    Returns:
      a reason string when the round would pass max_delta (at fixed_epsilon) or max_epsilon
      (at fixed_delta), else None.
    """
    if self.max_delta is None and self.max_epsilon is None:
      return None
    if self.fixed_epsilon is not None:
      eps = float(self.fixed_epsilon)
      delta = lookahead.delta_after(self.ledger, eps, self.planned_sample(m), 1,
                                    self.accountant)
    else:
      delta = float(self.fixed_delta)
      eps = lookahead.epsilon_after(self.ledger, delta, self.planned_sample(m), 1,
                                    self.accountant)
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
        records = tf.cast(records, tf.float64)   # exact: float32 values are float64 values
        mask = tf.cast(mask, tf.float64) * self._shrink
        params = query.derive_sample_params(global_state)
        state = query.initial_sample_state(self._record_spec)
        # the inner query accumulates (QueryWithLedger's accumulate_records assumes a
        # sum-aggregation inner query); the wrapper's get_noised_result records the sample
        state = inner.accumulate_records(params, state, records, mask)
        result, new_state, _ = query.get_noised_result(state, global_state)
        return result, new_state

      self._aggregate_fns[m] = tf.function(aggregate, reduce_retracing=True)
    return self._aggregate_fns[m]

  @staticmethod
  def screen(records):
    """Rejects non-finite updates.

    Args:
      records: float [M, d] client updates.

    Returns:
      (records with non-finite rows zeroed, float mask [M] of accepted rows, rejected count).
    """
    records = tf.convert_to_tensor(records, tf.float32)
    finite = tf.reduce_all(tf.math.is_finite(records), axis=1)
    rejected = int(tf.shape(records)[0]) - int(tf.reduce_sum(tf.cast(finite, tf.int32)))
    return tf.where(finite[:, None], records, 0.0), tf.cast(finite, tf.float32), rejected

  def aggregate(self, records, mask, m):
    """The round's mechanism: each client's update clipped to S (times the float64 plan's
    shrink), summed, N(0, sigma^2 S^2) added, in float64; one ledger entry, appended to the
    journal when there is one.

    Args:
      records: float32 [M, d] client updates (`screen`'s output).
      mask: [M] 0/1 weights.
      m: m_t, the round's clients (selects the compiled aggregation).

    Returns:
      the noised sum, a float64 tensor [d] (the differentially private output; anything
      computed from it is post-processing).
    """
    noised_sum, self.global_state = self._aggregate_fn(int(m))(records, mask, self.global_state)
    if self.journal is not None:   # before the sum leaves the server (`server_journal`)
      self.journal.append(self.ledger)
    return noised_sum

  def apply(self, records, mask, m):
    """`aggregate`, then the server step: update = noised sum / m_t (public), cast to float32,
    v <- beta v + update, w <- w + eta_s v.

    Args:
      records: float32 [M, d].
      mask: [M] 0/1 weights.
      m: m_t, the denominator.

    Returns:
      the update (noised sum / m_t), a float32 tensor [d].
    """
    update = tf.cast(self.aggregate(records, mask, m) / float(m), tf.float32)
    self.velocity.assign(self.server_momentum * self.velocity + update)
    self.weights.assign_add(self.server_learning_rate * self.velocity)
    return update

  def privacy_statement(self, diagnostics=False):
    """The privacy part of a run report.

    Args:
      diagnostics: whether V_c and U_s were computed (adds a warning: they are not private).

    Returns:
      (guarantee_holds, statement, warnings): False for median clipping or a non-private
      query; the accountant's statement on the ledger; what the statement does not cover.
    """
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
      statement = str(_client_level(accounting.privacy_report(self.ledger,
                                                             accountant=self.accountant, **kw)))
    else:
      statement = (f"{int(self.ledger.sample_count)} samples recorded; call "
                   "tf_dpiter.accounting.epsilon(ledger, delta) for the guarantee ("
                   + _CLIENT_UNIT + ")")
    if self.is_median:
      statement = "NOT PRIVATE (median-norm clip): " + statement
    return holds, statement, tuple(warnings)

