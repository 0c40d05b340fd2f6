"""User-level DP batches: Poisson sampling of users (McMahan et al. 2018, Table 1: a record can
be all of one user's data; TF Privacy's max_examples_per_user).

Relation: add or remove one user with all of their examples. A record is a user: their first
k = `max_examples_per_user` examples in data order (a function of that user's data alone).
Each step samples each of the U users independently with probability
q = expected_users_per_batch / U; the ledger records n = U, q, policy "user_poisson" and one
record per user (sensitivity C). A step's batch holds users one after the other, k rows each
(rows of weight 0 pad short users, empty users pad to a static size); `DPModel.fit` reads the
`UserGrouping` of the dataset's `SamplingSpec` and clips per user.

The epsilon is user-level, not an example-level epsilon at the same value (removing one
example of a user who stays moves that user's record by up to 2C); the statement names the
unit.
"""

import dataclasses

import numpy as np
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.data import python_source
from tf_dpiter.data import sampling as sampling_lib
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.ledger import records


@dataclasses.dataclass(frozen=True)
class UserGrouping:
  """The record layout of user-level batches: k consecutive rows per user."""
  examples_per_user: int
  num_users: int


def user_grouping(spec):
  """The UserGrouping of a SamplingSpec (user-level sampling); None for example-level data or
  no spec."""
  sampler = None if spec is None else spec.sampler
  return sampler if isinstance(sampler, UserGrouping) else None


def _kept_rows(user_ids, k):
  """Users (sorted ids) and, per user, the indices of their first k examples (data order)."""
  ids = np.asarray(user_ids).reshape(-1)
  users, inverse = np.unique(ids, return_inverse=True)
  order = np.argsort(inverse, kind="stable")
  starts = np.searchsorted(inverse[order], np.arange(len(users)))
  ends = np.r_[starts[1:], len(order)]
  return users, [order[s:min(e, s + k)] for s, e in zip(starts, ends)]


def _check(n, expected_users, k, num_users):
  validation.check_integer("max_examples_per_user", k, 1)
  if not 0 < expected_users <= num_users:
    raise ParameterValueError(f"expected_users_per_batch must be in (0, number of users={num_users}], "
                              f"got {expected_users!r}")
  if n == 0:
    raise ParameterValueError(f"`x` must hold at least one example. Received: x with n={n}")


def _rows_or_zeros(a, flat):
  """a's rows at the indices `flat`, zero rows where an index is -1 (padding). Padding must
  not copy a real example: weight 0 times a NaN or inf feature of that example is NaN, which
  would make other users' records depend on it (and the fast path drop them)."""
  rows = a[np.where(flat >= 0, flat, 0)]
  rows[flat < 0] = np.zeros((), a.dtype)
  return rows


def poisson_user_batches(x, y, user_ids, expected_users_per_batch, max_examples_per_user,
                         steps_per_epoch=None, max_users_per_batch="auto", seed=None):
  """tf.data.Dataset of Poisson samples of users: (x_pad, y_pad, weights) per step.

  Args:
    x: the features: arrays (or nests) with n examples on the leading axis.
    y: the labels, arrays (or nests) with n examples on the leading axis.
    user_ids: [n] the user of each example (any hashable dtype numpy can sort).
    expected_users_per_batch: q U, in (0, U].
    max_examples_per_user: k, examples kept per user (the first k in data order).
    steps_per_epoch: samples per iteration; default round(U / (q U)).
    max_users_per_batch: "auto" pads the users of a step to
      `sampling.default_max_batch_size(U, q)` (a larger sample is padded to the next
      multiple, never truncated); an int pads to that.
    seed: tests only: reproducible, hence NOT private (warns). None: OS entropy.

  Returns:
    A tf.data.Dataset of (x_pad, y_pad, weights) with S * k rows (S padded users), weights
    float32 1 for kept examples of sampled users, else 0. Its SamplingSpec is
    ("user_poisson", U, q, q U, UserGrouping(k, U)).

  Raises:
    ParameterValueError: arrays of different lengths or an argument out of range.
  """
  n = sampling_lib.num_records((x, y, np.asarray(user_ids)))
  users, rows = _kept_rows(user_ids, max_examples_per_user)
  num_users, k = len(users), max_examples_per_user
  _check(n, expected_users_per_batch, k, num_users)
  q = expected_users_per_batch / num_users
  steps = steps_per_epoch or max(1, int(round(num_users / expected_users_per_batch)))
  cap = (sampling_lib.default_max_batch_size(num_users, q) if max_users_per_batch == "auto"
         else int(max_users_per_batch))
  table = np.full((num_users, k), -1, np.int64)   # row indices per user, -1: padding
  for u, r in enumerate(rows):
    table[u, :len(r)] = r
  rng = sampling_lib.make_rng(seed, who="poisson_user_batches")
  xs, ys = tf.nest.map_structure(np.asarray, x), tf.nest.map_structure(np.asarray, y)

  def gen():
    for _ in range(steps):
      chosen = table[np.flatnonzero(rng.random(num_users) < q)]
      size = sampling_lib.padded_size(len(chosen), cap)
      idx = np.full((size, k), -1, np.int64)
      idx[:len(chosen)] = chosen
      flat = idx.reshape(-1)
      yield (tf.nest.map_structure(lambda a: _rows_or_zeros(a, flat), xs),
             tf.nest.map_structure(lambda a: _rows_or_zeros(a, flat), ys),
             (flat >= 0).astype(np.float32))

  ds = python_source.python_dataset(gen, sampling_lib.batch_signature(xs, ys))
  ds = ds.apply(tf.data.experimental.assert_cardinality(steps)).prefetch(2)
  return sampling_lib.attach_spec(ds, sampling_lib.SamplingSpec(
      records.USER_POISSON, num_users, q, float(expected_users_per_batch),
      UserGrouping(k, num_users)))
