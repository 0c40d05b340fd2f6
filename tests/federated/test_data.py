import numpy as np
import pytest

from tf_dpiter import federated as F


def _sorted_data(n=60000, classes=10):
  y = np.repeat(np.arange(classes), n // classes).astype(np.int32)
  x = np.arange(n, dtype=np.float32)[:, None]
  return x, y


@pytest.mark.parametrize("num_clients", [100, 1000])
def test_noniid_shards_paper_layout(num_clients):
  x, y = _sorted_data()
  fd = F.partition_noniid_shards(x, y, num_clients, shards_per_client=2,
                                 examples_per_client=600, seed=1)
  assert fd.client_indices.shape == (num_clients, 600)
  assert np.all(fd.client_sizes == 600)
  # Every example is used equally often: once for K=100, ten times for K=1000 (repeats).
  counts = np.bincount(fd.client_indices.ravel(), minlength=60000)
  assert np.all(counts == num_clients // 100)
  # Each client holds two shards of 300 consecutive sorted examples -> at most 2 labels.
  labels = np.array([len(np.unique(y[r])) for r in fd.client_indices])
  assert labels.max() <= 2
  for r in fd.client_indices[:20]:
    for half in (r[:300], r[300:]):
      assert np.all(np.diff(np.sort(half)) == 1)


def test_iid_partition_covers_data_once():
  x, y = _sorted_data(6000)
  fd = F.partition_iid(x, y, 10, examples_per_client=600, seed=0)
  assert sorted(fd.client_indices.ravel().tolist()) == list(range(6000))
  # IID: each client sees (almost) all labels.
  assert min(len(np.unique(y[r])) for r in fd.client_indices) == 10


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_clients=0), "num_clients"),
    (dict(num_clients=10, examples_per_client=0), "examples_per_client"),
    (dict(num_clients=10, shards_per_client=7), "shards_per_client"),
])
def test_partition_bad_arguments(kwargs, match):
  x, y = _sorted_data(6000)
  with pytest.raises(ValueError, match=match):
    F.partition_noniid_shards(x, y, **kwargs)


def test_client_without_data_is_an_error():
  x, y = _sorted_data(100)
  with pytest.raises(ValueError, match="client_sizes.*no data"):
    F.FederatedData.from_client_lists(x, y, [[0, 1, 2], [], [5]])


def test_ragged_clients_padded():
  x, y = _sorted_data(100)
  fd = F.FederatedData.from_client_lists(x, y, [[0, 1, 2], [7], [5, 9]])
  assert fd.client_indices.shape == (3, 3)
  assert fd.client_sizes.tolist() == [3, 1, 2]
  xk, yk = fd.client_examples(2)
  assert xk[:, 0].tolist() == [5.0, 9.0]
