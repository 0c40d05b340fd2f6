"""Client partitions of a labelled data set for federated simulation (Geyer et al. 2017, Section 4).

A partition is a `FederatedData`: the shared arrays `x`, `y` and, per client k, the indices
of the examples client k holds (`client_indices[k, :client_sizes[k]]`; the rest is padding
with index 0 and is never read by training). Repeated indices are allowed: for K > 100 MNIST
clients of 600 examples each, data points repeat, as in the paper.
"""

import dataclasses
import numpy as np

from tf_dpiter import validation
from tf_dpiter.data import mnist
from tf_dpiter.errors import ParameterValueError


def load_mnist(path=None):
  """MNIST as flat vectors, the clients' examples (`tf_dpiter.data.mnist.load_mnist`).

  Args:
    path: the .npz path (keys x_train, y_train, x_test, y_test); None: `default_mnist_path()`.

  Returns:
    (x_train, y_train, x_test, y_test): x float32 [n, 784] in [0, 1], y int32 [n].

  Raises:
    ParameterValueError: the file does not exist.
  """
  return mnist.load_mnist(path, flatten=True)


@dataclasses.dataclass
class FederatedData:
  """Shared examples plus each client's example indices (padded to the largest client).

  Attributes:
    x: float32 [n, ...], the shared examples.
    y: int32 [n], their labels.
    client_indices: int32 [K, n_max], each client's example indices (padded to the largest client).
    client_sizes: int32 [K], each client's number of examples, every entry >= 1.
  """
  x: np.ndarray
  y: np.ndarray
  client_indices: np.ndarray
  client_sizes: np.ndarray

  def __post_init__(self):
    self.x = np.asarray(self.x, np.float32)
    self.y = np.asarray(self.y, np.int32)
    self.client_indices = np.asarray(self.client_indices, np.int32)
    self.client_sizes = np.asarray(self.client_sizes, np.int32)
    if self.x.shape[0] != self.y.shape[0]:
      raise ParameterValueError(f"y: length {self.y.shape[0]} differs from x length {self.x.shape[0]}")
    if self.client_indices.ndim != 2:
      raise ParameterValueError(f"client_indices must be [K, n_max], got shape {self.client_indices.shape}")
    k = self.client_indices.shape[0]
    if self.client_sizes.shape != (k,):
      raise ParameterValueError(f"client_sizes must have shape ({k},), got {self.client_sizes.shape}")
    empty = np.flatnonzero(self.client_sizes <= 0)
    if empty.size:
      raise ParameterValueError(f"client_sizes: client(s) {empty[:10].tolist()} hold no data; "
                                "every client needs at least one example")
    if np.any(self.client_sizes > self.client_indices.shape[1]):
      raise ParameterValueError(
          "`client_sizes` must not exceed client_indices.shape[1]="
          f"{self.client_indices.shape[1]}. Received: max(client_sizes)="
          f"{int(np.max(self.client_sizes))}")
    used = self.client_indices
    if used.size and (used.min() < 0 or used.max() >= self.x.shape[0]):
      raise ParameterValueError(
          f"`client_indices` must lie in [0, len(x)={self.x.shape[0]}). Received: indices in "
          f"[{int(used.min())}, {int(used.max())}]")

  @property
  def num_clients(self):
    """K, the number of clients (an int)."""
    return int(self.client_indices.shape[0])

  @classmethod
  def from_client_lists(cls, x, y, client_lists):
    """Builds a partition from a list of per-client index lists (ragged).

    Args:
      x: the shared examples.
      y: their labels.
      client_lists: for each client, the indices of its examples.

    Returns:
      a FederatedData (rows padded with 0 to the largest client).
    """
    sizes = np.array([len(c) for c in client_lists], np.int32)
    n_max = int(max(sizes.max(initial=0), 1))
    idx = np.zeros((len(client_lists), n_max), np.int32)
    for k, c in enumerate(client_lists):
      idx[k, :len(c)] = np.asarray(c, np.int32)
    return cls(x, y, idx, sizes)

  def client_examples(self, k):
    """The examples of client k.

    Args:
      k: the client's index in [0, K).

    Returns:
      (x_k, y_k), unpadded numpy arrays.
    """
    ids = self.client_indices[k, :self.client_sizes[k]]
    return self.x[ids], self.y[ids]


def _check_counts(num_clients, examples_per_client, shards_per_client=1):
  validation.check_integer("num_clients", num_clients, 1)
  validation.check_integer("examples_per_client", examples_per_client, 1)
  validation.check_integer("shards_per_client", shards_per_client, 1)
  if examples_per_client % shards_per_client:
    raise ParameterValueError(validation.message(
        "shards_per_client", f"a divisor of examples_per_client={examples_per_client}",
        shards_per_client))


def _cycled_permutations(n_items, n_needed, rng):
  """n_needed draws that visit every item once per cycle, each cycle a new permutation."""
  reps = -(-n_needed // n_items)
  return np.concatenate([rng.permutation(n_items) for _ in range(reps)])[:n_needed]


def partition_noniid_shards(x, y, num_clients, shards_per_client=2, examples_per_client=600,
                            seed=None):
  """Pathological non-IID split of McMahan et al. 2017 used in Geyer et al. 2017, Section 4.

  Examples are sorted by label and cut into shards of examples_per_client/shards_per_client
  consecutive examples; each client gets `shards_per_client` shards. When more examples are
  needed than len(x), each cycle over all shards is a fresh permutation.

  Args:
    x: the examples and their integer labels.
    y: the examples and their integer labels.
    num_clients: K >= 1.
    shards_per_client: shards per client, an int >= 1 dividing examples_per_client.
    examples_per_client: examples per client, an int >= 1.
    seed: seeds the shard assignment (the partition is public, not a privacy mechanism).

  Returns:
    a FederatedData with K clients of examples_per_client examples each.

  Raises:
    ParameterTypeError: a count that is not an int (a TypeError).
    ParameterValueError: a count out of range, or fewer examples than one shard.
  """
  _check_counts(num_clients, examples_per_client, shards_per_client)
  x = np.asarray(x)
  y = np.asarray(y)
  shard_size = examples_per_client // shards_per_client
  n_shards = x.shape[0] // shard_size
  if n_shards < 1:
    raise ParameterValueError(f"x: {x.shape[0]} examples is fewer than one shard of {shard_size}")
  rng = np.random.default_rng(seed)
  order = np.argsort(y, kind="stable")[:n_shards * shard_size]
  shards = order.reshape(n_shards, shard_size)
  pick = _cycled_permutations(n_shards, num_clients * shards_per_client, rng)
  idx = shards[pick].reshape(num_clients, examples_per_client)
  return FederatedData(x, y, idx, np.full([num_clients], examples_per_client, np.int32))


def partition_iid(x, y, num_clients, examples_per_client=600, seed=None):
  """IID split: shuffled examples dealt out, examples_per_client each (repeating if needed).

  Args:
    x: the examples and their labels.
    y: the examples and their labels.
    num_clients: K >= 1.
    examples_per_client: an int >= 1.
    seed: seeds the split (public, not a privacy mechanism).

  Returns:
    a FederatedData with K clients of examples_per_client examples each.

  Raises:
    ParameterTypeError: a count that is not an int; ValueError: a count < 1.
  """
  _check_counts(num_clients, examples_per_client)
  x = np.asarray(x)
  rng = np.random.default_rng(seed)
  pick = _cycled_permutations(x.shape[0], num_clients * examples_per_client, rng)
  idx = pick.reshape(num_clients, examples_per_client)
  return FederatedData(x, y, idx, np.full([num_clients], examples_per_client, np.int32))
