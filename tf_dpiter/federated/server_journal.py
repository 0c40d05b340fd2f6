"""A federated server's ledger journal: a restarted deployment continues its ledger or is refused.

Rule: every round aggregated is charged, and a restart continues the ledger or is refused, so
epsilon never starts from 0 again for the same clients. `DPServer(ledger_journal=path)`
appends its ledger to a `ledger.LedgerJournal` after every round, before the round's noised
sum leaves the server (the journal's crash safety: each append fsynced and hash-chained; a
last line torn by a crash is dropped with a warning, and its round's sum never left the
server). A server built on an existing journal merges its rounds into its ledger (`resume`):
they count in epsilon and in the budget look-ahead, and the round counters of `DPFedAvg` and
the Flower strategies continue after them.

The rounds are refused (PrivacyConfigError naming the parameter) unless a server of the same
recipe recorded them (`check_recipe`): the sampling policy, hence the neighbouring relation
(replace one client under fixed_size, add or remove one under poisson; McMahan et al., "A
General Approach to Adding Differential Privacy to Iterative Training Procedures",
Section 5), the population K, one client per record, no shuffled passes, the query's events
(their kinds and number) and, for a query whose clip is fixed, its clip. Each round's noise
and m_t are recorded with the round (schedules change them) and are not compared; an adaptive
clip (quantile, median) restarts from the query's initial clip, and the server model w_t from
the `initial_weights` given (the journal holds the ledger, not the model).

Cuts: the journal keeps a tally beside it (`PATH.tally`, `ledger.LedgerJournal(tally=True)`:
the number of rounds' chunks and the last one's digest, replaced whole after every append), so
whole rounds cut from the journal's end, or an older copy of it put in place, are refused at
the restart. Limits: a journal cut together with its tally (both restored from one older
backup, or the tally deleted) cannot be told from rounds never run: keep them on
append-only storage. One server per journal: a second one on
the same file is refused at its first append, before its sum leaves (`ledger.journal`). A
query or sampler built with a seed (tests only: not private) draws the same noise and
clients again after a restart.
"""

import os

from tf_dpiter import dp_query as dpq
from tf_dpiter import ledger as ledger_lib
from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.federated import queries as queries_lib
from tf_dpiter.ledger import records as rec

# Queries whose first event's clip is the round's adapted clip S_t (recorded with each round).
_ADAPTIVE_CLIP = (dpq.QuantileAdaptiveClipSumQuery, queries_lib.MedianNormClipSumQuery)


def resume(server, path, key=None):
  """Opens the server's journal and merges the rounds it holds into `server.ledger`.

  Args:
    server: a `DPServer` whose ledger has recorded nothing yet.
    path: the journal file (str or os.PathLike; created on the first round if missing).
    key: optional str/bytes, the HMAC key of the journal's chunks.

  Returns:
    (the `ledger.LedgerJournal`, the number of rounds it held).

  Raises:
    ParameterValueError: `path` is not a file path, or the journal was altered (a chunk
      edited, removed or reordered) or is not a ledger journal.
    PrivacyConfigError: its rounds were recorded with another recipe (`check_recipe`).
  """
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise ParameterValueError(validation.message("ledger_journal", "a file path", path))
  journal = ledger_lib.LedgerJournal(path, key=key, tally=True)
  rounds = journal.resume(server.ledger)
  check_recipe(server, os.fspath(path))
  return journal, rounds


def _next_round(server):
  """The `records.SampleRun` the server's next round would record (its current sampling and
  planned events, written to a scratch ledger by the ledger's own rules)."""
  scratch = ledger_lib.PrivacyLedger(initial_capacity=1)
  sampling = server.query.sampling
  scratch.record_sample(sampling.population_size, sampling.selection_probability,
                        server.planned_events(), policy=server.policy,
                        sample_size=sampling.sample_size)
  return rec.to_records(rec.run_length_encode(*scratch.get_arrays()))[0]


def check_recipe(server, path):
  """Refuses a ledger holding rounds that a server of `server`'s recipe did not record
  (module docstring: policy, K, one client per record, no passes, the events, a fixed clip).

  Args:
    server: the `DPServer` whose ledger was resumed.
    path: the journal's path (for the messages).

  Raises:
    PrivacyConfigError: the first difference, naming the parameter to change.
  """
  samples, queries = server.ledger.get_arrays()
  passes = int(server.ledger.passes.numpy())
  where = f"the rounds in ledger_journal {path!r}"
  if passes:
    raise PrivacyConfigError(f"`ledger_journal` must be a federated server's journal; {where} "
                             f"count {passes} shuffled passes (a training run's journal). "
                             f"Received: ledger_journal={path!r}")
  expected = _next_round(server)
  for run in rec.to_records(rec.run_length_encode(samples, queries)):
    # before the client-unit policies a server recorded each round under the policy named
    # as its sampling ("fixed_size", "poisson"), whose unit is the example
    if run.policy == server.sampling != expected.policy:
      raise PrivacyConfigError(
          f"`ledger_journal` must hold rounds recorded with the client as the unit; {where} "
          f"were recorded under the policy {run.policy!r} (the unit stated: example), as "
          "servers before the client-unit policies recorded them, and one ledger cannot "
          f"compose them with rounds under {expected.policy!r}. Finish that run with the "
          "version that wrote it (its epsilon is the same number; only the unit named "
          f"differs). Received: ledger_journal={path!r}")
    if run.policy != expected.policy:
      raise PrivacyConfigError(
          f"`sampling` must be {run.policy!r}, the sampling of {where} (another sampling is "
          "another neighbouring relation). Received: sampling=" + repr(server.sampling))
    if run.population_size != expected.population_size:
      raise PrivacyConfigError(
          f"`population_size` (K, num_clients) must be {run.population_size:g}, the population "
          f"of {where}. Received: population_size={server.population_size}")
    if run.examples_per_record != 1:
      raise PrivacyConfigError(
          f"`ledger_journal` must be a federated server's journal (one client per record); "
          f"{where} record {run.examples_per_record} examples per record. Received: "
          f"ledger_journal={path!r}")
    kinds = tuple(q.kind for q in run.queries)
    if kinds != tuple(q.kind for q in expected.queries):
      raise PrivacyConfigError(
          f"`query` must report the events of {where} {kinds}, not "
          f"{tuple(q.kind for q in expected.queries)}. Received: "
          f"query={type(server.inner_query).__name__}")
    adaptive = isinstance(server.inner_query, _ADAPTIVE_CLIP)
    for j, (got, want) in enumerate(zip(run.queries, expected.queries)):
      if got.clip != want.clip and not (adaptive and j == 0):
        raise PrivacyConfigError(
            f"`l2_norm_clip` of the query (its event {j}) must be {got.clip!r}, the clip of "
            f"{where}. Received: l2_norm_clip={want.clip!r}")
