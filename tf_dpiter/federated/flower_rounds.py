"""The DP rounds of a Flower deployment, shared by both Flower APIs (`tf_dpiter.federated.flower`).

`DPRounds` is the server's side of client-level DP FedAvg (Geyer et al. 2017, Algorithm 1)
whatever carries the messages: it checks that K clients are connected (the ledger's n), runs
the budget look-ahead, samples m_t of them without replacement (ledger policy
client_fixed_size) and aggregates the screened updates through the `DPServer`'s query (one
ledger entry per round). `DeploymentMixin` gives both strategies the same public state.
Imports no Flower.
"""

import operator

import numpy as np
import tensorflow as tf

from tf_dpiter import dp_query as dpq
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.federated import schedules
from tf_dpiter.federated import server as server_lib


class DPRounds:
  """The DP rounds of a Flower deployment, whatever Flower API carries the messages.

  Args: as `flower.DPFedAvgMessageStrategy` (model, query, initial_params, num_clients,
  clients_per_round, noise_multiplier, the budget, the server step, seed), all required here,
  and its ledger_journal and journal_key (`DPServer`). With a resumed journal, Flower's
  server_round r (from 1 again after a restart) is the deployment's round
  `server.resumed_rounds` + r: the schedules and the rounds' info continue from there.
  """

  def __init__(self, model, query, initial_params, num_clients, clients_per_round,
               noise_multiplier, fixed_epsilon, max_delta, fixed_delta, max_epsilon,
               server_learning_rate, server_momentum, seed, ledger_journal=None,
               journal_key=None):
    self.model = model
    self.num_clients = int(num_clients)
    self.schedule = schedules.RoundSchedule(clients_per_round, noise_multiplier)
    w0 = model.flatten([tf.constant(p) for p in initial_params])
    self.server = server_lib.DPServer(
        query, w0, self.num_clients, self.schedule.clients_per_round(1), sampling="fixed_size",
        fixed_epsilon=fixed_epsilon, max_delta=max_delta, fixed_delta=fixed_delta,
        max_epsilon=max_epsilon, server_learning_rate=server_learning_rate,
        server_momentum=server_momentum, ledger_journal=ledger_journal, journal_key=journal_key)
    self._gen = dpq.make_generator(seed)
    self._round_m = {}
    self._round_picked = {}   # round -> the ids sampled, until its replies are aggregated
    self.rounds = []
    self.stopped_reason = None

  def params(self):
    """The server model w_t as a list of numpy arrays in the model's layout."""
    return [p.numpy() for p in self.model.unflatten(self.server.weights)]

  def sample(self, server_round, client_ids):
    """The ids of this round's m_t clients, [] once the budget stops the run.

    One round is in flight at a time: sampling a round abandons any earlier round not yet
    aggregated (its late replies are not summed and it is not charged), since the query's
    sampling and noise are now this round's and the budget look-ahead did not count it.
    """
    self._round_m.clear()
    self._round_picked.clear()
    if self.stopped_reason is not None:
      return []
    ids = sorted(client_ids)
    if len(ids) != self.num_clients:
      raise ParameterValueError(f"num_clients: expected {self.num_clients} connected clients, got "
                                f"{len(ids)} (the ledger's population size must be exact)")
    if len(set(ids)) != len(ids):   # a client listed twice would be sampled with 2 q
      raise ParameterValueError(f"num_clients: expected {self.num_clients} distinct connected "
                                f"clients, got {len(set(ids))} distinct among {len(ids)} ids")
    t = self.server.resumed_rounds + server_round
    m = self.server.begin_round(*self.schedule(t), t)
    over = self.server.would_exceed_budget(m, t)
    if over:
      self.stopped_reason = "privacy budget: " + over
      return []
    pick = server_lib.sample_clients(self._gen, len(ids), m, "fixed_size").numpy()
    self._round_m[server_round] = m
    self._round_picked[server_round] = [ids[i] for i in pick]
    return list(self._round_picked[server_round])

  def record(self, arrays):
    """A client's update as a flat float32 record [d], None if its shapes are wrong or an
    array is not of a real number dtype (bool, int, uint or float: a string or complex
    array would be parsed or lose its imaginary part, or raise out of the round)."""
    shapes = [tuple(s) for s in self.model.shapes]
    if len(arrays) != len(shapes) or any(tuple(a.shape) != s for a, s in zip(arrays, shapes)):
      return None
    if any(np.asarray(a).dtype.kind not in "biuf" for a in arrays):
      return None
    return np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays])

  def aggregate(self, server_round, replies, failures):
    """Aggregates a round's replies: the first update of each client sampled this round.

    Geyer et al. 2017 (Algorithm 1) sums one clipped update per sampled client, and the ledger
    charges the round as fixed-size sampling of m_t of the K clients (replace one client: the
    sum moves by at most 2 S). So a reply from a client not sampled this round, or a second
    reply of a sampled one (a duplicated message), is not summed: it counts in `rejected`.

    Args:
      server_round: the round `sample` picked clients for.
      replies: (client id, update) pairs, the update a list of arrays in the model's layout;
        the id as `sample` returned it.
      failures: the count of error replies (nothing summed for them).

    Returns:
      the round's info dict, or None for a round that sampled nobody (stopped) or was
      abandoned (a later round was sampled before its replies came: `sample`).
    """
    if server_round not in self._round_m:
      return None
    m = self._round_m.pop(server_round)
    waiting = set(self._round_picked.pop(server_round))
    updates, foreign = [], 0
    for sender, arrays in replies:
      if sender in waiting:
        waiting.discard(sender)
        updates.append(arrays)
      else:
        foreign += 1
    rows, bad = [], int(failures) + foreign
    for arrays in updates:
      rec = self.record(arrays)
      if rec is None:
        bad += 1
      else:
        rows.append(rec)
    records = np.stack(rows) if rows else np.zeros([1, self.server.dim], np.float32)
    records, mask, rejected = self.server.screen(records)
    if not rows:
      mask = tf.zeros([1])
    self.server.apply(records, mask, m)
    eps, delta = self.server.guarantee()
    info = dict(round=self.server.resumed_rounds + server_round, clients=m, returned=len(rows),
                rejected=int(bad + rejected), clip=self.server.clip() or 0.0)
    if eps is not None:
      info.update(epsilon=float(eps), delta=float(delta))
    self.rounds.append(info)
    return info


def _from_rounds(path, doc):
  """A read-only property reading `path` (dotted) of the strategy's `DPRounds` (`_dp`)."""
  return property(lambda self: operator.attrgetter(path)(self._dp), doc=doc)  # pylint: disable=protected-access


class DeploymentMixin:
  """Public state shared by both strategies (they hold a `DPRounds` as `_dp`)."""

  server = _from_rounds("server", "The `DPServer` (w_t, the query with its ledger, the budget "
                                  "look-ahead).")
  ledger = _from_rounds("server.ledger", "The `PrivacyLedger` every round is recorded in (one "
                                         "sample per round).")
  rounds = _from_rounds("rounds", "Per-round info dicts: round, clients (m_t), returned, "
                                  "rejected, clip, epsilon, delta.")
  stopped_reason = _from_rounds("stopped_reason", "Why no more rounds are run (the budget), "
                                                  "or None.")
  model = _from_rounds("model", "The `MLP` shared with the clients.")
  num_clients = _from_rounds("num_clients", "K, the number of clients that must be connected "
                                            "(the ledger's n).")

  def report(self):
    """(guarantee_holds, privacy statement, warnings) from the ledger's accountant."""
    return self._dp.server.privacy_statement()
