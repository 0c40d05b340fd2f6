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

import json
import os
import socket
import subprocess
import sys
import time

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


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _run_two_workers(tmp_path, sync, timeout=480):
  """Each worker's JSON output of mw_custom_loop_worker.py (2 processes on loopback)."""
  tmp_path.mkdir(parents=True, exist_ok=True)
  socks = [socket.socket() for _ in range(2)]
  for s in socks:
    s.bind(("127.0.0.1", 0))
  cluster = {"worker": [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]}
  for s in socks:
    s.close()
  procs, outs = [], []
  for i in range(2):
    outs.append(tmp_path / f"worker_{i}.json")
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="",
               TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
    with open(tmp_path / f"worker_{i}.log", "w", encoding="utf-8") as log:
      procs.append(subprocess.Popen(
          [sys.executable, os.path.join(HERE, "mw_custom_loop_worker.py"), str(outs[-1])]
          + (["sync"] if sync else []), env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
  deadline = time.monotonic() + timeout
  while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
    time.sleep(0.5)
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()
  assert all(p.returncode == 0 for p in procs), [
      (tmp_path / f"worker_{i}.log").read_text()[-2000:] for i in range(2)]
  return [json.loads(o.read_text()) for o in outs]


@pytest.mark.slow
def test_two_real_workers_release_the_charged_noise_once_synchronized(tmp_path):
  # 2 workers, 6 steps, 18,000 zero-gradient weights (the weights are the noise alone),
  # Poisson q = 0.1, z = 1.25, C = 1: the weights' std over its charged value; the ratio's own
  # spread is about 0.005 (before the fix: 0.696 and 0.706, 1/sqrt(2) = 0.707)
  refused = _run_two_workers(tmp_path / "plain", sync=False)
  assert all("not synchronized" in o.get("error", "") for o in refused), refused
  outs = _run_two_workers(tmp_path / "sync", sync=True)
  assert all(o["ledger"] == 6 and o["iterations"] == 6 for o in outs), outs
  assert outs[0]["head"] == outs[1]["head"], outs   # one model on both workers
  ratio = outs[0]["noise_std_ratio"]
  assert 0.95 < ratio < 1.05, f"released noise std / charged std = {ratio:.3f}"
