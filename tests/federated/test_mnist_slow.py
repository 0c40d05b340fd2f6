"""End-to-end on MNIST with the paper's model (slow: CI skips it by default)."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter import federated as F

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mnist():
  path = F.default_mnist_path()
  if not os.path.exists(path):
    pytest.skip(f"MNIST not found at {path} (set TF_DPITER_MNIST)")
  return F.load_mnist(path)


def test_paper_model_vectorized_equals_one_client(mnist):
  x, y, _, _ = mnist
  fd = F.partition_noniid_shards(x, y, 100, seed=0)
  model = F.MLP()
  params = model.init_params(seed=0)
  ids = np.array([3, 50, 97])
  order = F.draw_example_order(tf.random.Generator.from_seed(0), fd.client_sizes[ids], 600, 1)
  sgd = F.LocalSGD(model, epochs=1, batch_size=60, learning_rate=0.1)
  got = sgd(params, x, y, fd.client_indices[ids], fd.client_sizes[ids], order)
  for j, k in enumerate(ids):
    ref = F.local_sgd_one_client(model, params, *fd.client_examples(k), order[j].numpy(), 60, 0.1)
    for a, b in zip(got, ref):
      np.testing.assert_allclose(a[j].numpy(), b.numpy(), rtol=1e-3, atol=1e-5)


def test_dp_fedavg_learns_on_noniid_mnist(mnist):
  x, y, xt, yt = mnist
  fd = F.partition_noniid_shards(x, y, 100, seed=0)
  alg = F.DPFedAvg(F.MLP(), fd, F.make_query("quantile", 0.5, 30, seed=0),
                   clients_per_round=30, sampling="poisson", fixed_epsilon=8.0, seed=0,
                   eval_data=(xt[:2000], yt[:2000]))
  rep = alg.run(5)
  # 5 rounds of 30 two-digit clients: far above chance (0.1) with a light noise z = 0.5.
  assert rep.accuracy > 0.4
  assert int(alg.ledger.sample_count) == 5
  assert 0 < rep.rounds[-1].delta < 1
