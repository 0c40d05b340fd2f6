"""A custom loop under several workers draws one noise, or is refused.

Claim: a step's released noise has std z C (the ledger's Gaussian), add/remove one example,
unit = example. Review R3 (session 34): a custom loop (`strategy.run` of
compute_private_gradients and apply_private_gradients) under MultiWorkerMirroredStrategy with
2 workers added each worker's own draw to the all-reduced sum; the update averaged them:
released std 0.70 z C (measured 0.696 and 0.706, 1/sqrt(2) = 0.707), 1.925 charged where the
noise released gives 3.895. `fit` shared the chief's generator state first; the custom loop
did not. Now the private step refuses a draw under several workers until
`optimizer.synchronize_noise(strategy)` made every worker's generator the chief's (the
two-process measurement of the synchronized loop: tests/keras/test_multi_worker.py's workers).
Here the worker count is faked (one process, MirroredStrategy on the CPU).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.internals import runtime


def test_a_custom_loop_under_two_workers_is_refused_until_the_noise_is_synchronized(
    monkeypatch):
  monkeypatch.setattr(runtime, "num_workers", lambda strategy: 2)
  strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
  opt.set_sampling(40, 0.1, "poisson", 4)
  x, y = np.ones((4, 2), np.float32), np.zeros((4, 1), np.float32)

  def replica_step(a, b):
    grads = opt.compute_private_gradients(
        lambda r: keras.losses.mean_squared_error(r[1], model(r[0])),
        model.trainable_variables, data=(a, b))
    opt.apply_private_gradients(grads, model.trainable_variables)

  step = tf.function(lambda a, b: strategy.run(replica_step, args=(a, b)))
  with pytest.raises(dp.errors.PrivacyConfigError,
                     match="2 workers whose noise generators were not synchronized"):
    step(x, y)
  assert int(opt.ledger.sample_count.numpy()) == 0
  before = opt.private_step.noise_generator.state.numpy().copy()
  opt.synchronize_noise(strategy)   # the chief's state (here: this process's own)
  np.testing.assert_array_equal(opt.private_step.noise_generator.state.numpy(), before)
  tf.function(lambda a, b: strategy.run(replica_step, args=(a, b)))(x, y)
  assert int(opt.ledger.sample_count.numpy()) == 1
