"""Soundness under a real 2-replica tf.distribute.MirroredStrategy (run by mirrored_jobs_worker,
checked by test_distribute.py): a replica's batch past the public row bound
(`row_bound_refusals`), a DP optimizer created outside the strategy (`outside_scope`), and
`optimizer.iterations` rolled back (`rollback_noise`).

Relation and unit: add/remove one example. Under add/remove the clip shrink of the float32 sum
is planned for a public number of rows (Casacuberta, Shoemate, Vadhan and Wagaman, "Widespread
underestimation of sensitivity in differentially private libraries and how to fix it", CCS
2022, Secs. 3-5): R = `SamplingPolicy.public_row_bound`(n, q) for the whole step and, under P
replicas, R_P = `replica_row_bound`(n, q, P) for each replica's batch. With n = 200 and
q = 0.05 (declared by set_sampling), R = 48 and R_P = max(ceil(48 / 2), tail bound of
Binomial(101, 0.05)) = 40, both computed independently below from their formulas.

The job fits one batch of 16 rows (8 per replica, accepted), then a crafted batch of
2 (R_P + 8) = 96 rows (48 per replica, past R_P), without and with XLA. The crafted step must be
refused by the bound's own assertion (before: without XLA a pinned sum's gather failed first,
"indices = 6 is not in [0, 6)"), neither applied nor charged: weights bit-identical, the
ledger's sample count and the optimizer's iterations unchanged, and the noise generator's
counter never lowered (a refused step may consume noise, never reuse it). A later accepted
batch is applied and charged once.
"""

import json
import math
import warnings

import keras
import numpy as np
import tensorflow as tf

import tf_dpiter as dp

N, Q, REPLICAS = 200, 0.05, 2


def _tail_bound(n, q, p_refuse=1e-18):
  """By hand: the smallest multiple of 8, r, with exp(-(n + 1) KL((r + 1) / (n + 1) || q)) <=
  p_refuse (Hoeffding 1963, Theorem 1: a Chernoff bound of P[Binomial(n + 1, q) > r])."""
  def kl(a, b):
    return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))
  r = 8
  while (r + 1) / (n + 1) < 1 and math.exp(-(n + 1) * kl((r + 1) / (n + 1), q)) > p_refuse:
    r += 8
  return r


def expected_bounds():
  """(R, R_P) by hand: R = max(2 ceil8(E + 4 sd), tail(n)), R_P = max(ceil(R / P),
  tail(ceil(n / P)))."""
  size = math.ceil(N * Q + 4 * math.sqrt(N * Q * (1 - Q)))
  rows = max(2 * 8 * math.ceil(size / 8), _tail_bound(N, Q))
  return rows, max(-(-rows // REPLICAS), _tail_bound(-(-N // REPLICAS), Q))


def _fit(model, rows):
  x = np.ones((rows, 1), np.float32)
  model.fit(tf.data.Dataset.from_tensor_slices((x, -x)).batch(rows), verbose=0)


def _state(model):
  opt = model.optimizer
  return (model.get_weights()[0].copy(), int(opt.ledger.sample_count.numpy()),
          int(opt.iterations.numpy()), opt.noise_generator.state.numpy().copy())


def _one_run(strategy, jit):
  keras.utils.set_random_seed(0)
  with strategy.scope():
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=1.0)
    model = dp.keras.DPSequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
    model.compile(optimizer=opt, loss=lambda yt, yp: tf.reduce_sum(yt * yp, axis=-1),
                  jit_compile=jit)
  opt.set_sampling(N, Q, "poisson")
  sampling = opt.private_step.sampling
  out = {"jit": jit, "R": sampling.public_row_bound,
         "R_P": sampling.replica_row_bound(REPLICAS)}
  _fit(model, 16)
  before = _state(model)
  crafted = 2 * (out["R_P"] + 8)
  try:
    _fit(model, crafted)
    out["refused"] = None
  except tf.errors.InvalidArgumentError as e:
    out["refused"] = str(e)
  after = _state(model)
  _fit(model, 16)
  later = _state(model)
  out.update({
      "crafted_rows": crafted,
      "weights_same": bool(np.array_equal(before[0], after[0])),
      "samples": [before[1], after[1], later[1]],
      "iterations": [before[2], after[2], later[2]],
      # the Philox counter (the state's first word, uint64 held as int64)
      "counter": [int(np.uint64(s[3][0].astype(np.int64).view(np.uint64)))
                  for s in (before, after, later)],
      "later_moved": bool(not np.array_equal(after[0], later[0]))})
  return out


def row_bound_refusals(strategy):
  """Prints one RESULT json line per run (without, then with XLA), under TensorFlow's default
  Grappler setting (on), as a user runs: the default tier switches Grappler off in its
  subprocesses (tests/subprocess_site), and with it off the old fault's op order did not show."""
  assert strategy.num_replicas_in_sync == REPLICAS
  options = tf.config.optimizer.get_experimental_options()
  tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      for jit in (False, True):
        print("RESULT " + json.dumps(_one_run(strategy, jit)), flush=True)
  finally:
    tf.config.optimizer.set_experimental_options(
        {"disable_meta_optimizer": bool(options.get("disable_meta_optimizer", False))})


def check_refusals(lines):
  """The job's RESULT lines: both runs refused by the bound, nothing applied or charged."""
  results = [json.loads(l[len("RESULT "):]) for l in lines if l.startswith("RESULT ")]
  assert [r["jit"] for r in results] == [False, True], lines
  rows, share = expected_bounds()
  assert (rows, share) == (48, 40)
  for r in results:
    assert (r["R"], r["R_P"]) == (rows, share), r
    assert r["crafted_rows"] == 96
    message = r["refused"]
    assert message is not None, f"a replica batch of 48 rows past R_P = 40 was not refused: {r}"
    assert "must be at most 40" in message and "public bound" in message, message[-1500:]
    assert "is not in [0," not in message, message[-1500:]
    assert r["weights_same"], r
    assert r["samples"][1] == r["samples"][0] and r["samples"][2] == r["samples"][0] + 1, r
    assert r["iterations"][1] == r["iterations"][0], r
    assert r["iterations"][2] == r["iterations"][0] + 1, r
    assert r["counter"][1] >= r["counter"][0], r          # never lowered by the refusal
    assert r["counter"][2] > r["counter"][1], r           # the accepted step drew fresh noise
    assert r["later_moved"], r


def outside_scope(strategy):
  """A DP optimizer created outside `strategy.scope()` and compiled inside it: refused at
  compile, naming the scope (before: each replica counted the step, iterations 2 against one
  ledger sample, and the next fit was refused as "restored without its ledger"). Prints one
  RESULT json line."""
  out = {}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
    with strategy.scope():
      model = dp.keras.DPSequential([keras.Input((1,)), keras.layers.Dense(1)])
      try:
        model.compile(optimizer=opt, loss="mse")
        out["refused"] = None
      except dp.errors.PrivacyConfigError as e:
        out["refused"] = str(e)
      inside = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
      model.compile(optimizer=inside, loss="mse")   # accepted
    inside.set_sampling(N, Q, "poisson")
    x = np.ones((16, 1), np.float32)
    model.fit(tf.data.Dataset.from_tensor_slices((x, x)).batch(16), verbose=0)
  out["iterations"] = int(inside.iterations.numpy())
  out["samples"] = int(inside.ledger.sample_count.numpy())
  print("RESULT " + json.dumps(out), flush=True)


def check_outside_scope(lines):
  """The outside_scope job's RESULT line: refused with a message naming the scope; the
  optimizer made inside counts one iteration and one ledger sample per step."""
  results = [json.loads(l[len("RESULT "):]) for l in lines if l.startswith("RESULT ")]
  assert len(results) == 1, lines
  r = results[0]
  assert r["refused"] is not None, r
  assert "must be created inside `strategy.scope()`" in r["refused"], r
  assert "2 replicas" in r["refused"] and "DPKerasSGDOptimizer" in r["refused"], r
  assert (r["iterations"], r["samples"]) == (1, 1), r


def rollback_noise(strategy):
  """Three fits of one batch with zero gradients (the loss 0 * y_pred: each update is the
  noise alone), `optimizer.iterations.assign(0)` after the first, without and with XLA.
  Prints one RESULT json line per run: the (iterations, ledger samples) after each fit and
  whether each pair of the three updates differs."""
  x = np.ones((16, 3), np.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for jit in (False, True):
      with strategy.scope():
        opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=1.0)
        model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(
            4, kernel_initializer="zeros")])
        model.compile(optimizer=opt, jit_compile=jit,
                      loss=lambda yt, yp: 0.0 * tf.reduce_sum(yp, axis=-1))
      opt.set_sampling(N, 0.08, "poisson")
      counts, updates = [], []
      for k in range(3):
        before = model.get_weights()[0].copy()
        model.fit(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(16), verbose=0)
        updates.append(model.get_weights()[0] - before)
        counts.append([int(opt.iterations.numpy()), int(opt.ledger.sample_count.numpy())])
        if k == 0:
          opt.iterations.assign(0)
      print("RESULT " + json.dumps({
          "jit": jit, "counts": counts,
          "norms": [float(np.linalg.norm(u)) for u in updates],
          "differ": [bool(not np.allclose(updates[i], updates[j]))
                     for i in range(3) for j in range(i + 1, 3)]}), flush=True)


def check_rollback_noise(lines):
  """Each rollback run: the ledger charges every step (1, 2, 3 samples) though iterations went
  back to 0, and no update repeats another's noise."""
  results = [json.loads(l[len("RESULT "):]) for l in lines if l.startswith("RESULT ")]
  assert [r["jit"] for r in results] == [False, True], lines
  for r in results:
    assert r["counts"] == [[1, 1], [1, 2], [2, 3]], r
    assert all(n > 1e-3 for n in r["norms"]), r     # noise on: every update moved
    assert r["differ"] == [True, True, True], r     # never the same noise twice
