import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter import federated as F


@pytest.mark.parametrize("epochs, batch_size, sizes", [
    (1, 10, [30, 30, 30]),
    (2, 7, [30, 12, 1, 25]),     # unequal clients, partial last batch, a one-example client
    (3, 64, [20, 33]),           # one batch bigger than every client
])
def test_vectorized_equals_one_client_at_a_time(tiny, epochs, batch_size, sizes):
  model, x, y = tiny
  rng = np.random.default_rng(3)
  lists = [rng.choice(len(x), s, replace=False) for s in sizes]
  fd = F.FederatedData.from_client_lists(x, y, lists)
  params = model.init_params(seed=5)
  gen = tf.random.Generator.from_seed(11)
  order = F.draw_example_order(gen, fd.client_sizes, fd.client_indices.shape[1], epochs)
  sgd = F.LocalSGD(model, epochs=epochs, batch_size=batch_size, learning_rate=0.3)
  stacked = sgd(params, x, y, fd.client_indices, fd.client_sizes, order)
  for k in range(len(sizes)):
    xk, yk = fd.client_examples(k)
    ref = F.local_sgd_one_client(model, params, xk, yk, order[k].numpy(), batch_size, 0.3)
    for a, b in zip(stacked, ref):
      # float32 reassociation in the batched matmuls: agreement to ~1e-6 relative.
      np.testing.assert_allclose(a[k].numpy(), b.numpy(), rtol=1e-4, atol=1e-6)
    assert float(tf.reduce_max(tf.abs(stacked[0][k]))) > 0  # the client really trained


def test_example_order_is_permutation_of_own_examples():
  gen = tf.random.Generator.from_seed(0)
  order = F.draw_example_order(gen, [3, 5, 1], 5, 2).numpy()
  assert order.shape == (3, 2, 5)
  for k, n in enumerate([3, 5, 1]):
    for e in range(2):
      assert sorted(order[k, e, :n].tolist()) == list(range(n))


@pytest.mark.parametrize("kwargs", [dict(epochs=0), dict(batch_size=0),
                                    dict(learning_rate=float("nan")), dict(learning_rate=-1.0)])
def test_local_sgd_bad_arguments(tiny, kwargs):
  with pytest.raises(ValueError):
    F.LocalSGD(tiny[0], **kwargs)
