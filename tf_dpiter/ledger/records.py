"""The ledger's records and file format (McMahan et al. 2018, Section 6; Appendix A for adjacency).

Pure Python and numpy (no TensorFlow: `tf_dpiter.accounting` and `dp_ledger report` start
fast). A ledger is a sequence of *samples* (sampling events), each stating
  * its sampling policy and hence the neighbouring relation: Poisson / full batches -> add
    or remove one example; fixed-size samples and shuffled passes -> replace one example
    (n is public there: the steps per pass show it);
  * the unit of a record: `examples_per_record` k (k > 1: a microbatch of k examples; the
    unit of privacy stays the example);
  * its sum queries: clip S (per record), noise, and the *sensitivity under the relation*:
    S for add/remove of a whole record, 2S when one example changes inside a record
    (replace-one, or a microbatch: the record moves between two vectors of norm <= S).
The ledger also counts the shuffled *passes* its sampler started. Files: versioned JSON,
run-length coded, SHA-256 digest and optional HMAC-SHA256 (`ledger_file`).
"""

import dataclasses
from typing import Tuple

import numpy as np

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import policies
from tf_dpiter.ledger import selection as _selection
from tf_dpiter.ledger.schema import (  # pylint: disable=unused-import  (re-exported)
    ADD_OR_REMOVE, BALLS_IN_BINS, CLIENT_FIXED_SIZE, CLIENT_POISSON, CYCLIC_POISSON, FIXED_SIZE,
    FORMAT_NAME, FORMAT_VERSION, FULL, POISSON, POLICIES, RELATIONS, REPEAT_AND_SELECT,
    REPEAT_AND_SELECT_CODE, REPLACE_ONE, SHUFFLE, TRUNCATED_POISSON, USER_POISSON)
from tf_dpiter.ledger.schema import (  # pylint: disable=unused-import  (re-exported)
    BANDED_GAUSSIAN, GAUSSIAN, LAPLACE, MATRIX_GAUSSIAN, NON_PRIVATE, QUERY_COLUMNS,
    SAMPLE_COLUMNS, TREE_GAUSSIAN)
from tf_dpiter.ledger.schema import CORRELATED_KIND_OF_ROWS as _CORRELATED_KIND_OF_ROWS
from tf_dpiter.ledger.schema import KIND_NAME as _KIND_NAME


def unit_of_policy(policy):
  """The unit of privacy, "example", "user" or "client", that a registered policy's records
  stand for (the policy object's `unit`; the selection marker: "example").

  Raises:
    PrivacyConfigError: an unknown policy.
  """
  if policy == REPEAT_AND_SELECT:
    return "example"
  return policies.get(policy).unit

# Query kinds: codes in `schema`. Correlated-noise steps. A BANDED_GAUSSIAN row is
# one step of a banded matrix mechanism: clip S, noise sigma (per coordinate of Z), sensitivity = factor x zeta x S with zeta
# the strategy's largest column norm; it is only recorded under cyclic_poisson with b >= the
# strategy's bands. A TREE_GAUSSIAN row is one leaf of online tree aggregation: clip S, noise
# sigma per node, sensitivity = factor x S x sqrt(depth), depth = ceil(log2(tree_size + 1)) the
# nodes one participation touches; only under shuffle (one participation per pass).
# A MATRIX_GAUSSIAN row is one step of a non-banded matrix mechanism (BLT) under b-min-
# separation: clip S, noise sigma, sensitivity = factor x Delta x S with Delta its equivalent
# per-participation sensitivity; only under cyclic_poisson with b >= its min separation.


def policy_code(policy):
  """The stable int code of a registered policy name (the policy object's `code`) or of the
  selection marker `REPEAT_AND_SELECT`.

  Raises:
    PrivacyConfigError: if `policy` is unknown.
  """
  if policy == REPEAT_AND_SELECT:
    return REPEAT_AND_SELECT_CODE
  return policies.get(policy).code


def policy_name(code):
  """The policy name of a policy's code (int or float), or of the selection marker's.

  Raises:
    PrivacyConfigError: an unknown code.
  """
  if int(code) == REPEAT_AND_SELECT_CODE:
    return REPEAT_AND_SELECT
  policy = policies.by_code(int(code))
  if policy is None:
    raise PrivacyConfigError(f"`code` must be a registered policy's code ({_known_codes()}). "
                             f"Received: code={code!r}")
  return policy.name


def _known_codes():
  """{code: name} of the registered policies and the selection marker."""
  known = {p.code: p.name for p in map(policies.get, policies.names())}
  known[REPEAT_AND_SELECT_CODE] = REPEAT_AND_SELECT
  return dict(sorted(known.items()))


def relation_for_policy(policy):
  """The neighbouring relation a sample of `policy` is accounted under (see module doc).

  Args:
    policy: a sampling policy name.

  Returns:
    ADD_OR_REMOVE or REPLACE_ONE (the policy object's `relation`).

  Raises:
    PrivacyConfigError: an unknown policy, or the selection marker (it samples nothing).
  """
  if policy == REPEAT_AND_SELECT:
    raise PrivacyConfigError(f"{REPEAT_AND_SELECT!r} marks a private selection, not a sampling: it "
                             "has no neighbouring relation of its own (a ledger with a selection record "
                             "is accounted by the RDP accountant only)")
  return policies.get(policy).relation


def sensitivity_factor(relation, examples_per_record=1):
  """Sensitivity of a clipped sum over its per-record clip S, under `relation`.

  1 when one unit is one whole record added or removed; 2 when one example changes inside a
  record that stays (replace-one; a microbatch of k > 1 examples): the record's clipped
  vector goes from one point of the S-ball to another (McMahan et al. 2018, Appendix A).

  Args:
    relation: ADD_OR_REMOVE or REPLACE_ONE.
    examples_per_record: k, the examples in one record (1: a record is an example).

  Returns:
    1.0 or 2.0.

  Raises:
    PrivacyConfigError: `relation` is not one of RELATIONS.
  """
  if relation not in RELATIONS:
    raise PrivacyConfigError(f"relation must be one of {RELATIONS}, got {relation!r}")
  return 1.0 if relation == ADD_OR_REMOVE and examples_per_record <= 1 else 2.0


def _add_remove_codes():
  """The codes of the registered add/remove-one policies (for the vectorized checks)."""
  return [p.code for p in map(policies.get, policies.names()) if p.relation == ADD_OR_REMOVE]


def _sensitivity_factors(policy_codes, examples_per_record):
  """`sensitivity_factor` for arrays of policy codes and k (one rule, vectorized)."""
  add_remove = np.isin(policy_codes, _add_remove_codes())
  return np.where(add_remove & (examples_per_record <= 1), 1.0, 2.0)


def check_examples_per_record(policy, examples_per_record):
  """Refuses k = examples_per_record (the microbatch size) unless k >= 1, and k == 1 under an
  add/remove `policy`; a tensor k is not checked.

  Raises:
    ParameterValueError: if k < 1, or k > 1 under an add-or-remove policy.
  """
  k = examples_per_record
  if isinstance(k, (int, float, np.integer, np.floating)) and not isinstance(k, bool):
    if not k >= 1:
      raise ParameterValueError(f"examples_per_record must be >= 1, got {k!r}")
    if k > 1 and relation_for_policy(policy) == ADD_OR_REMOVE:
      raise PrivacyConfigError(
          f"examples_per_record={k!r} (microbatches) with policy {policy!r} is refused: under "
          "add or remove one example, removing an example can re-deal the others among "
          "microbatches. Sample with a replace-one policy ('shuffle' or 'fixed_size')")


@dataclasses.dataclass(frozen=True)
class QueryRecord:
  """One sum query of a sample: kind, clip S (per record), noise, sensitivity (relation units).

  Attributes:
    kind: the query's kind: "gaussian", "laplace" or "non_private".
    clip: S, the per-record clip.
    noise: the noise's standard deviation (Gaussian) or scale (Laplace), in sum units.
    sensitivity: the sum's sensitivity under the sample's relation (S times the relation's factor).
  """
  kind: str
  clip: float = 0.0
  noise: float = 0.0
  sensitivity: float = 0.0


@dataclasses.dataclass(frozen=True)
class SampleRun:
  """`count` consecutive identical samples.

  Attributes:
    count: the number of consecutive identical samples.
    policy: the sampling policy (one of records.ALL_POLICIES).
    population_size: n, the population of every sample.
    selection_probability: q, each record's probability to be in a sample.
    sample_size: the batch size recorded (0 for Poisson).
    examples_per_record: k, the examples in one record (1: a record is an example).
    queries: the QueryRecords of every sample of the run.
  """
  count: int
  policy: str
  population_size: float
  selection_probability: float
  sample_size: float
  examples_per_record: int
  queries: Tuple[QueryRecord, ...]

  @property
  def relation(self):
    """The run's neighbouring relation (`relation_for_policy`)."""
    return relation_for_policy(self.policy)


def _first_bad(mask):
  bad = np.flatnonzero(mask)
  return int(bad[0]) if bad.size else None


def _policy_sampling_problem(samples):
  """The first row whose sampling its own policy's `sampling_checks` refuses, as a message.

  Each registered policy checks the rows of its code (one statement of its rules, shared with
  the check of a declared sampling); no per-policy table here.
  """
  n, q, m, pol = samples[:, 0], samples[:, 1], samples[:, 2], samples[:, 3]
  first = None
  for policy in map(policies.get, policies.names()):
    rows = np.flatnonzero(pol == policy.code)
    if not rows.size:
      continue
    for bad, field, rule in policy.sampling_checks(n[rows], q[rows], m[rows]):
      j = _first_bad(bad)
      if j is not None and (first is None or rows[j] < first[0]):
        i = int(rows[j])
        first = (i, policy.sampling_message(field, rule, n[i], q[i], m[i]) + f" at sample {i}")
  return None if first is None else first[1]


def _check_samples(samples):
  if not np.all(np.isfinite(samples)):
    i = int(np.argwhere(~np.isfinite(samples))[0][0])
    raise PrivacyConfigError(f"sample {i} has a non-finite field: {samples[i].tolist()}")
  n, q, _, pol, k, _ = samples.T
  known = _known_codes()
  checks = [
      (n <= 0, "population_size must be > 0", n),
      (~((q > 0) & (q <= 1)), "selection_probability must be in (0, 1]", q),
      (~np.isin(pol, list(known)), f"policy code must be one of {known}", pol),
      ((k < 1) | (k != np.floor(k)), "examples_per_record must be an integer >= 1", k),
  ] + _selection.marker_checks(samples)
  for mask, msg, col in checks:
    i = _first_bad(mask)
    if i is not None:
      raise PrivacyConfigError(f"{msg}, got {col[i]!r} at sample {i}")
  problem = _policy_sampling_problem(samples)
  if problem is not None:
    raise PrivacyConfigError(problem)
  add_remove = np.isin(pol, _add_remove_codes())
  i = _first_bad(add_remove & (k > 1))
  if i is not None:
    raise PrivacyConfigError(
        f"sample {i}: microbatches (examples_per_record={k[i]:.0f}) under policy "
        f"{policy_name(pol[i])!r} (add or remove one example) are refused: removing an example "
        "can re-deal the others among microbatches. Use a replace-one policy (shuffle, fixed_size)")


def _covering_codes():
  """{correlated query kind code: (codes of the policies covering it, their names)}."""
  out = {}
  for rows, kind in _CORRELATED_KIND_OF_ROWS.items():
    covering = [p for p in map(policies.get, policies.names()) if rows in p.covers]
    out[kind] = ([p.code for p in covering], ", ".join(p.name for p in covering) or "none")
  return out


def _check_queries(samples, queries):
  nq = samples[:, 5]
  if int(nq.sum()) != queries.shape[0]:
    raise PrivacyConfigError(f"inconsistent ledger: samples declare {int(nq.sum())} queries, "
                             f"found {queries.shape[0]}")
  if not queries.size:
    return
  if not np.all(np.isfinite(queries)):
    i = int(np.argwhere(~np.isfinite(queries))[0][0])
    raise ParameterValueError(f"query {i} has a non-finite field: {queries[i].tolist()}")
  expected_idx = np.repeat(np.arange(samples.shape[0]), nq.astype(np.int64))
  if not np.array_equal(queries[:, 0], expected_idx):
    raise PrivacyConfigError("inconsistent ledger: query sample_index does not match the samples' num_queries")
  kind, clip, noise, sens = queries[:, 1], queries[:, 2], queries[:, 3], queries[:, 4]
  s = samples[queries[:, 0].astype(np.int64)]
  factor = _sensitivity_factors(s[:, 3], s[:, 4])
  checks = [
      (~np.isin(kind, list(_KIND_NAME)), f"query kind must be in {sorted(_KIND_NAME)}", kind),
      (clip < 0, "query clip must be >= 0", clip),
      (noise < 0, "query noise must be >= 0", noise),
      ((kind == LAPLACE) & ((clip <= 0) | (noise <= 0)), "Laplace query needs clip > 0 and scale > 0", clip),
      ((kind != NON_PRIVATE) & (sens < factor * clip),
       "query sensitivity is below what its relation and record unit imply (factor x clip)", sens),
  ] + [((kind == k) & ~np.isin(s[:, 3], codes),
         f"a {_KIND_NAME[k]} query is accounted only under policy {covering}", kind)
        for k, (codes, covering) in _covering_codes().items()]
  for mask, msg, col in checks:
    i = _first_bad(mask)
    if i is not None:
      raise PrivacyConfigError(f"{msg}, got {col[i]!r} at query {i} (clip {clip[i]!r}, needed "
                               f"sensitivity >= {factor[i] * clip[i]!r})")


def validate_arrays(samples, queries):
  """Checks ledger arrays for consistency; raises ValueError naming the bad field.

  Besides ranges, a query's recorded sensitivity must be at least the factor of
  `sensitivity_factor` times its clip, and microbatches under add/remove are refused.
  """
  samples = np.asarray(samples, dtype=np.float64).reshape(-1, len(SAMPLE_COLUMNS))
  queries = np.asarray(queries, dtype=np.float64).reshape(-1, len(QUERY_COLUMNS))
  _check_samples(samples)
  _check_queries(samples, queries)
  return samples, queries


def run_length_encode(samples, queries):
  """Runs of consecutive identical samples: list of (count, sample_row, query_rows).

  Args:
    samples: ledger sample array (rows of SAMPLE_COLUMNS).
    queries: ledger query array (rows of QUERY_COLUMNS).

  Returns:
    List of (count, sample_row, query_rows); empty when there are no samples.
  """
  if samples.shape[0] == 0:
    return []
  nq = samples[:, 5].astype(np.int64)
  width = int(nq.max())
  sig = np.zeros([samples.shape[0], 5 + 4 * width])
  sig[:, :5] = samples[:, :5]
  if queries.size:
    starts = np.concatenate([[0], np.cumsum(nq)[:-1]])
    pos = np.arange(queries.shape[0]) - np.repeat(starts, nq)
    rows = queries[:, 0].astype(np.int64)
    for c in range(4):
      sig[rows, 5 + 4 * pos + c] = queries[:, 1 + c]
  change = np.ones(sig.shape[0], dtype=bool)
  change[1:] = np.any(sig[1:] != sig[:-1], axis=1) | (nq[1:] != nq[:-1])
  heads = np.flatnonzero(change)
  counts = np.diff(np.append(heads, sig.shape[0]))
  qstart = np.concatenate([[0], np.cumsum(nq)])
  return [(int(c), samples[h], queries[qstart[h]:qstart[h] + nq[h]]) for h, c in zip(heads, counts)]


def runs_to_arrays(runs):
  """The (samples, queries) numpy arrays of runs (count, sample_row, query_rows), as from
  `run_length_encode`; query column 0 is the sample index."""
  if not runs:
    return np.zeros([0, len(SAMPLE_COLUMNS)]), np.zeros([0, len(QUERY_COLUMNS)])
  counts = np.asarray([c for c, _, _ in runs], dtype=np.int64)
  samples = np.repeat(np.stack([s for _, s, _ in runs]), counts, axis=0)
  blocks = [np.tile(q[:, 1:], (c, 1)) for c, _, q in runs if len(q)]
  nq = samples[:, 5].astype(np.int64)
  if not blocks:
    return samples, np.zeros([0, len(QUERY_COLUMNS)])
  sample_index = np.repeat(np.arange(samples.shape[0]), nq).astype(np.float64)
  return samples, np.concatenate([sample_index[:, None], np.concatenate(blocks, 0)], axis=1)


def _query_record(row):
  kind = _KIND_NAME[int(row[1])]
  return QueryRecord(kind, float(row[2]), float(row[3]), float(row[4]))


def to_records(runs):
  """One typed SampleRun per run (count, sample_row, query_rows)."""
  return [SampleRun(int(c), policy_name(s[3]), float(s[0]), float(s[1]), float(s[2]), int(s[4]),
                    tuple(_query_record(r) for r in qs)) for c, s, qs in runs]


# The correlated-noise rows live in `correlated_records` (it imports only the leaf `schema`:
# no cycle), re-exported here as `records.correlated_*`.
from tf_dpiter.ledger.correlated_records import (  # pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
    correlated_query_row, correlated_requirement, correlated_row_values)
