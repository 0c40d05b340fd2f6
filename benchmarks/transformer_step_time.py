"""~100M-parameter Transformer: ms/step and peak memory, DP vs non-private, full and LoRA.

  python benchmarks/transformer_step_time.py --all [--batch 4] [--seq 32] [--steps 3]
  python benchmarks/transformer_step_time.py --mode dp --lora 8 --clipping auto

The model: keras_hub's BertBackbone built from the BERT-base config (12 layers, hidden 768,
12 heads, intermediate 3072, vocabulary 30522: 109.5M parameters) with random weights (no
weights can be downloaded), pooled output -> Dense(2). Without keras_hub (not a dependency of
tf_dpiter; --model plain, or when it cannot be imported) a plain Keras encoder of the same
shape (Embedding + 12 x [MultiHeadAttention, LayerNorm, Dense 3072, Dense 768, LayerNorm]).
LoRA (--lora r): keras_hub's backbone.enable_lora(r) (every backbone layer frozen, then
Keras' layer.enable_lora(r) on backbone.default_lora_layer_names(): query/value EinsumDense
of every attention layer), the classification head trainable; the plain encoder gets the
same trainable set. The fast path's plan follows model.trainable_variables through the
frozen attention blocks (fast_clipping/plan.py), so the LoRA layers are ghost units.

keras_hub: `pip install -e ".[test]"` installs keras-hub 0.32 (whose layers the fast path
knows to act per example: clipping="auto" takes it). Without touching the project's
environment (tensorflow-text etc. are not needed to build a backbone from a config):
  pip install --no-deps --target /tmp/kh keras-hub==0.32.0 regex kagglehub kagglesdk tqdm tokenizers
  PYTHONPATH=/tmp/kh python benchmarks/transformer_step_time.py --all

--profile (DP): in one process, the parts of a DP step timed separately, called round robin
(--steps rounds after --warmup, medians): the non-private gradient (one tape.gradient of the
mean loss), the fast clipped sum (fast_clipping.clipped_grad_sum), the Gaussian noise for
every trainable variable (tf.random.Generator.normal, and the step's own draw: the Gaussian
query's exact-tail sampler added into zero sums, gaussian_query.add_gaussian_noise), the
Philox bits alone that draw consumes (32 per value: generator.uniform_full_int of N/2 int64,
the floor of any exact-tail draw from the query's Philox stream), the whole DP
train_on_batch, and the non-private train_on_batch of a second model built the same way
(keras.optimizers.SGD): so the DP-only costs and the step they are compared with are measured
under the same load. Prints the medians of wall ms (profile_ms) and of the process's CPU ms
(profile_cpu_ms, all threads).

--ab (DP): in one process, round robin (--steps rounds after --warmup, medians of wall ms,
of the process's CPU ms (all threads: less sensitive to other processes' load than wall time)
and of the allocator's peak above what was held before each call): the DP train_on_batch as the
library forms it, the same DP step as before the fold (PrivateStep.folds_denominator off: the
noised sum divided by the denominator, and the Box-Muller halves joined by a copy before they
are added), and the non-private train_on_batch. The three models are built the same way.

--words (DP): as --ab, the DP step as the library forms it (its Philox words drawn by the
process's XLA-compiled block, randomness._philox_words) and the DP step traced with every
Philox draw by TensorFlow's kernel (randomness.XLA_WORDS_FROM set above any count while it
traces), and the non-private step, in that order nonprivate, dp_kernel_words, dp; also the
process CPU seconds of each one's first call (first_step_cpu_s: dp's includes the block's
one compilation, dp_kernel_words' does not; the non-private one, first, also the process's
one-time warm-up).

--memory (DP): in one process, TensorFlow's CPU allocator peak of each part of the DP step
run alone after a warm-up call (reset_memory_stats before each; MiB above what was held before
it): the non-private gradient, the fast clipped sum, zero sums of the weights' shapes alone
(418 MiB) and the query's noise added into such sums (filled from a variable, so that they
are buffers the noise can write into, as the step's sums are), and the DP and the non-private
train_on_batch; so the DP step's excess over the non-private one is split into the sums, the
draw's temporaries and the rest.

--ops: the size of the traced graphs, in one process: ops of the non-private gradient (one
tape.gradient of the mean loss) and of the fast clipped sum (fast_clipping.clipped_grad_sum)
in their traced functions (get_concrete_function().graph), the clipped sum's by phase (its
name scopes: forward, backward_to_layers, norms, clipped_sum; the rest is the tape's backward
pass), nodes in function bodies (a tf.cond or while loop's branches), and the trace time.

--pair: the non-private and the DP configuration (same --lora, --seq, --batch), one process
each, non-private first; prints one JSON line with both runs and the DP / non-private ratios
of ms/step, peak RSS and the allocator's peak (for benchmarks/compare_revisions.py, which
alternates two revisions of the library: give this script's absolute path so that both
revisions run the same benchmark, with the library of each worktree).

One configuration per process (--all runs the four: nonprivate/dp x full/LoRA, each in a
subprocess) so the peak RSS (ru_maxrss) is the configuration's. Every step is
model.train_on_batch (the DP step: per-example clipping routed by --clipping, noise, ledger).
ms/step: median of --steps timed steps after --warmup steps; first_step_s: the first step
(tracing, graph optimization, first run), first_step_cpu_s its process CPU seconds (all
threads; steadier than the wall time on a loaded machine); alloc_peak_mib: TensorFlow's CPU allocator peak over
the timed steps (tf.config.experimental.reset_memory_stats after the warmup; the weights and
the optimizer's state included, tracing excluded), alloc_before_steps_mib: what it held before
them; alloc_peak_first_step_mib and peak_rss_after_first_step_mib: the allocator's peak and
the process's peak RSS up to the end of the first step; first_step_probe_s (DP): the wall
seconds of the batch-independence probe inside the first step (its two eager forward passes,
and the state-writes check's when it runs). Prints one JSON line per run.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dpiter as dp  # noqa: E402
from tf_dpiter.dp_query import gaussian_query  # noqa: E402
from tf_dpiter.keras.internals.batch_independence import PROBE_SECONDS_ATTR  # noqa: E402

BERT_BASE = dict(vocabulary_size=30522, num_layers=12, num_heads=12, hidden_dim=768,
                 intermediate_dim=3072, max_sequence_length=512)


def _keras_hub():
  try:
    import keras_hub  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return keras_hub


class _Positions(keras.layers.Layer):
  """Learned position embedding added to the token embedding."""

  def build(self, shape):
    self.table = self.add_weight(shape=tuple(shape[1:]), initializer="random_normal")

  def call(self, h):
    return h + self.table


# The same table is added to every example: per example, so clipping="auto" may take the fast
# path (an undeclared custom layer would send it to the vectorized one).
dp.keras.declare_per_example(_Positions, "adds one learned table to each example's embeddings; "
                             "nothing is taken across the batch")


def _plain_encoder(seq, lora):
  c = BERT_BASE
  L = keras.layers
  ids = keras.Input((seq,), dtype="int32", name="token_ids")
  h = L.Embedding(c["vocabulary_size"], c["hidden_dim"])(ids)
  h = L.LayerNormalization()(_Positions()(h))
  attn = []
  for _ in range(c["num_layers"]):
    mha = L.MultiHeadAttention(c["num_heads"], c["hidden_dim"] // c["num_heads"])
    attn.append(mha)
    h = L.LayerNormalization()(h + mha(h, h))
    f = L.Dense(c["intermediate_dim"], activation="gelu")(h)
    h = L.LayerNormalization()(h + L.Dense(c["hidden_dim"])(f))
  head = L.Dense(2)
  out = head(h[:, 0])
  model_in, model_out = ids, out
  if lora:
    for layer in keras.Model(model_in, model_out)._flatten_layers(include_self=False):  # pylint: disable=protected-access
      layer.trainable = False
    head.trainable = True
    for mha in attn:
      mha.trainable = True
      for sub in (mha.key_dense, mha.output_dense):
        sub.trainable = False
      mha.query_dense.enable_lora(lora)
      mha.value_dense.enable_lora(lora)
  return model_in, model_out


def build(kind, seq, lora, private):
  """(model, input batch builder, name of the architecture)."""
  keras.utils.set_random_seed(0)
  hub = _keras_hub() if kind == "keras_hub" else None
  if hub is not None:
    backbone = hub.models.BertBackbone(**BERT_BASE)
    if lora:
      backbone.enable_lora(lora)
    inputs = {k: keras.Input((seq,), dtype="int32", name=k)
              for k in ("token_ids", "segment_ids", "padding_mask")}
    outputs = keras.layers.Dense(2)(backbone(inputs)["pooled_output"])
    arch = "keras_hub.models.BertBackbone (BERT-base config, random weights)"
  else:
    inputs, outputs = _plain_encoder(seq, lora)
    arch = "plain Keras encoder (BERT-base shape, random weights)"
  model = (dp.keras.DPModel if private else keras.Model)(inputs, outputs)
  return model, arch, hub is not None


def batch(b, seq, hub):
  rng = np.random.RandomState(0)
  ids = rng.randint(1, 30522, (b, seq)).astype("int32")
  y = rng.randint(0, 2, b).astype("int32")
  if hub:
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": np.ones_like(ids)}
  else:
    x = ids
  return x, y


def run_one(a):
  warnings.simplefilter("ignore")
  model, arch, hub = build(a.model, a.seq, a.lora, a.mode == "dp")
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if a.mode == "dp":
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.01, clipping=a.clipping)
  else:
    opt = keras.optimizers.SGD(0.01)
  model.compile(optimizer=opt, loss=loss)
  if a.mode == "dp":
    opt.set_sampling(10000, a.batch / 10000, "poisson", a.batch)
  x, y = batch(a.batch, a.seq, hub)
  rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  times, first_step_s, alloc = [], None, {}
  for i in range(a.warmup + a.steps):
    if i == a.warmup:   # the allocator's peak over the timed steps (tracing excluded)
      tf.config.experimental.reset_memory_stats("CPU:0")
      alloc["base"] = tf.config.experimental.get_memory_info("CPU:0")["current"]
    t0, c0 = time.perf_counter(), time.process_time()
    model.train_on_batch(x, y)
    if i == 0:   # tracing, graph optimization and the first run
      first_step_s = round(time.perf_counter() - t0, 1)
      first_step_cpu_s = round(time.process_time() - c0, 1)
      alloc["first"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
      rss_first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if i >= a.warmup:
      times.append(1e3 * (time.perf_counter() - t0))
  print(json.dumps({
      "arch": arch, "params": int(model.count_params()),
      "trainable_params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
      "mode": a.mode, "lora": a.lora, "batch": a.batch, "seq": a.seq,
      "clipping": getattr(model, "_dp_traced_clipping", None),   # the path the step traced
      "vectorized_layers": (dp.keras.fast_clipping.unregistered_layers(model)
                            if a.mode == "dp" else None),
      "ms_per_step": round(float(np.median(times)), 1), "ms_all": [round(t) for t in times],
      "first_step_s": first_step_s, "first_step_cpu_s": first_step_cpu_s,
      "first_step_probe_s": (round(getattr(model, PROBE_SECONDS_ATTR, 0.0), 2)
                             if a.mode == "dp" else None),
      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
      "rss_after_build_mib": round(rss_built),
      "alloc_peak_mib": round(tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20),
      "alloc_before_steps_mib": round(alloc["base"] / 2**20),
      "alloc_peak_first_step_mib": round(alloc["first"] / 2**20),
      "peak_rss_after_first_step_mib": round(rss_first),
      "ledger_steps": int(model.ledger.sample_count.numpy()) if a.mode == "dp" else None,
      "load_avg": os.getloadavg()}), flush=True)


def _wait(out):
  """Blocks until every tensor in `out` is computed."""
  for t in tf.nest.flatten(out, expand_composites=True):
    if tf.is_tensor(t):
      t.numpy()


def _round_robin_ms(parts, warmup, rounds):
  """({name: median wall ms}, {name: median process CPU ms}) of the zero-argument functions
  `parts`, called round robin: `warmup` rounds untimed, then `rounds` timed rounds (each part
  once per round, so a change of the machine's load reaches every part alike; CPU ms sum all
  threads and move less than wall ms when other processes load the machine)."""
  times = {k: [] for k in parts}
  cpu = {k: [] for k in parts}
  for r in range(warmup + rounds):
    for k, fn in parts.items():
      t0, c0 = time.perf_counter(), time.process_time()
      _wait(fn())
      if r >= warmup:
        times[k].append(1e3 * (time.perf_counter() - t0))
        cpu[k].append(1e3 * (time.process_time() - c0))
  median = lambda d: {k: round(float(np.median(v)), 1) for k, v in d.items()}  # noqa: E731
  return median(times), median(cpu)


def _dp_and_plain(a):
  """The DP model (compiled, Poisson sampling declared at batch a.batch), the same model
  non-private (SGD), one batch and the per-example loss: what `profile` and `memory` time."""
  warnings.simplefilter("ignore")
  model, _, hub = build(a.model, a.seq, a.lora, True)
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.01, clipping=a.clipping)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  opt.set_sampling(10000, a.batch / 10000, "poisson", a.batch)
  plain, _, _ = build(a.model, a.seq, a.lora, False)
  plain.compile(optimizer=keras.optimizers.SGD(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  x, y = batch(a.batch, a.seq, hub)
  per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
  return model, opt, plain, x, y, per_example


def profile(a):
  """The DP step's parts, timed in one process (see module docstring)."""
  model, opt, plain, x, y, per_example = _dp_and_plain(a)
  variables = model.trainable_variables
  values = int(sum(np.prod(v.shape) for v in variables))
  gen = tf.random.Generator.from_seed(0)

  @tf.function
  def grads():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(per_example(y, model(x, training=True)))
    return tape.gradient(loss, variables)

  parts = {
      "nonprivate_gradient": tf.function(grads),
      "fast_clipped_sum": tf.function(lambda: dp.keras.fast_clipping.clipped_grad_sum(
          model, x, y, per_example, 1.0)[0]),
      "noise_draw_tf_normal": tf.function(lambda: [gen.normal(v.shape) for v in variables]),
      # the step's own draw: the Gaussian query's exact-tail sampler, added into sums
      "query_noise_into_sums": tf.function(lambda: gaussian_query.add_gaussian_noise(
          gen, [tf.zeros(v.shape) for v in variables], 1.1)),
      # the Philox bits that draw consumes, alone (32 per value)
      "philox_bits_floor": tf.function(
          lambda: gen.uniform_full_int([(values + 1) // 2], dtype=tf.int64)[:1]),
      "dp_train_on_batch": lambda: model.train_on_batch(x, y),
      "nonprivate_train_on_batch": lambda: plain.train_on_batch(x, y),
  }
  out, cpu = _round_robin_ms(parts, a.warmup, a.steps)
  print(json.dumps({"profile_ms": out, "profile_cpu_ms": cpu, "mode": "dp", "lora": a.lora,
                    "batch": a.batch,
                    "seq": a.seq, "trainable_params": values,
                    "load_avg": os.getloadavg()}), flush=True)


def ab(a):
  """--ab / --words: DP variants and the non-private step, round robin (docstring)."""
  from tf_dpiter.dp_query import randomness  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.optimizer import private_step  # pylint: disable=g-import-not-at-top
  warnings.simplefilter("ignore")
  folds = private_step.PrivateStep.folds_denominator
  halves = randomness.padded_normal_halves
  words_from = randomness.XLA_WORDS_FROM

  def joined(generator, size, stddev=None):   # the draw before: halves joined by a copy
    z = tf.concat(halves(generator, size, stddev), 0)
    m = z.shape[0] // 2
    return z[:m], z[m:]

  def divided():   # the fold off and the halves joined
    private_step.PrivateStep.folds_denominator = property(lambda self: False)
    randomness.padded_normal_halves = joined

  def kernel_words():   # every Philox draw by TensorFlow's kernel
    randomness.XLA_WORDS_FROM = 1 << 62

  def restore():
    private_step.PrivateStep.folds_denominator = folds
    randomness.padded_normal_halves = halves
    randomness.XLA_WORDS_FROM = words_from

  # name -> what is changed while it traces (its first call); None: the library as it is
  variants = ({"nonprivate": None, "dp_kernel_words": kernel_words, "dp": None} if a.words
              else {"dp_folded": None, "dp_divided": divided, "nonprivate": None})
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  models = {}
  for name in variants:
    model, _, hub = build(a.model, a.seq, a.lora, name != "nonprivate")
    opt = (dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.01, clipping=a.clipping)
           if name != "nonprivate" else keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss=loss)
    if name != "nonprivate":
      opt.set_sampling(10000, a.batch / 10000, "poisson", a.batch)
    models[name] = model
  x, y = batch(a.batch, a.seq, hub)

  def call(name):
    def fn():
      if variants[name] is not None:
        variants[name]()
      try:
        return models[name].train_on_batch(x, y)
      finally:
        restore()
    return fn

  times = {k: [] for k in models}
  cpu = {k: [] for k in models}
  peaks = {k: [] for k in models}
  first_cpu_s = {}
  for r in range(a.warmup + a.steps):
    for name in models:
      before = tf.config.experimental.get_memory_info("CPU:0")["current"]
      tf.config.experimental.reset_memory_stats("CPU:0")
      t0, c0 = time.perf_counter(), time.process_time()
      _wait(call(name)())
      if r == 0:
        first_cpu_s[name] = round(time.process_time() - c0, 2)
      if r >= a.warmup:
        times[name].append(1e3 * (time.perf_counter() - t0))
        cpu[name].append(1e3 * (time.process_time() - c0))
        peaks[name].append(
            (tf.config.experimental.get_memory_info("CPU:0")["peak"] - before) / 2**20)
  ms = {k: round(float(np.median(v)), 1) for k, v in times.items()}
  cpu_ms = {k: round(float(np.median(v)), 1) for k, v in cpu.items()}
  mib = {k: round(float(np.median(v)), 1) for k, v in peaks.items()}
  dps = [k for k in models if k != "nonprivate"]
  print(json.dumps({"ab_ms": ms, "ab_cpu_ms": cpu_ms, "ab_alloc_peak_above_held_mib": mib,
                    "first_step_cpu_s": first_cpu_s,
                    **{"ratio_" + k.replace("dp_", "", 1): round(ms[k] / ms["nonprivate"], 3)
                       for k in dps},
                    **{"cpu_ratio_" + k.replace("dp_", "", 1):
                       round(cpu_ms[k] / cpu_ms["nonprivate"], 3) for k in dps},
                    "ms_all": {k: [round(t) for t in v] for k, v in times.items()},
                    "cpu_ms_all": {k: [round(t) for t in v] for k, v in cpu.items()},
                    "lora": a.lora, "batch": a.batch, "seq": a.seq,
                    "load_avg": os.getloadavg()}), flush=True)


def memory(a):
  """The allocator peak of the DP step's parts, each alone (see module docstring)."""
  model, opt, plain, x, y, per_example = _dp_and_plain(a)
  variables = model.trainable_variables
  gen = tf.random.Generator.from_seed(0)
  zero = tf.Variable(0.0)   # sums filled from a variable: not constants folded by Grappler

  @tf.function
  def grads():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(per_example(y, model(x, training=True)))
    return tape.gradient(loss, variables)

  parts = {
      "nonprivate_gradient": grads,
      "zero_sums_alone": tf.function(lambda: [tf.fill(v.shape, zero.read_value())
                                              for v in variables]),
      "fast_clipped_sum": tf.function(lambda: dp.keras.fast_clipping.clipped_grad_sum(
          model, x, y, per_example, 1.0)[0]),
      "query_noise_into_zero_sums": tf.function(lambda: gaussian_query.add_gaussian_noise(
          gen, [tf.fill(v.shape, zero.read_value()) for v in variables], 1.1)),
      "dp_train_on_batch": lambda: model.train_on_batch(x, y),
      "nonprivate_train_on_batch": lambda: plain.train_on_batch(x, y),
  }
  out = {}
  for name, fn in parts.items():
    for _ in range(a.warmup):
      _wait(fn())
    peaks = []
    for _ in range(a.steps):
      before = tf.config.experimental.get_memory_info("CPU:0")["current"]
      tf.config.experimental.reset_memory_stats("CPU:0")
      _wait(fn())
      peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    out[name] = round(float(np.median(peaks)) / 2**20, 1)
  weights = sum(int(np.prod(v.shape)) for v in variables) * 4 / 2**20
  print(json.dumps({"alloc_peak_above_held_mib": out, "weights_mib": round(weights, 1),
                    "lora": a.lora, "batch": a.batch, "seq": a.seq,
                    "load_avg": os.getloadavg()}), flush=True)


def _graph_size(fn):
  """(ops, ops per top-level name scope, function-body nodes, trace seconds) of fn traced."""
  t0 = time.perf_counter()
  graph = tf.function(fn).get_concrete_function().graph
  seconds = round(time.perf_counter() - t0, 1)
  phases = {}
  for op in graph.get_operations():
    scope = op.name.split("/")[0]
    scope = scope if scope in ("forward", "backward_to_layers", "norms", "clipped_sum") else (
        "backward" if scope == "gradient_tape" else "other")
    phases[scope] = phases.get(scope, 0) + 1
  library = sum(len(f.node_def) for f in graph.as_graph_def().library.function)
  return len(graph.get_operations()), phases, library, seconds


def graph_ops(a):
  """Op counts of the non-private gradient and of the clipped sum (see module docstring)."""
  warnings.simplefilter("ignore")
  model, _, hub = build(a.model, a.seq, a.lora, True)
  x, y = batch(a.batch, a.seq, hub)
  per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
  variables = model.trainable_variables

  def grads():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(per_example(y, model(x, training=True)))
    return tape.gradient(loss, variables)

  out = {}
  for name, fn in (("nonprivate_gradient", grads),
                   ("fast_clipped_sum", lambda: dp.keras.fast_clipping.clipped_grad_sum(
                       model, x, y, per_example, 1.0)[0])):
    ops, phases, library, seconds = _graph_size(fn)
    out[name] = {"ops": ops, "by_phase": phases, "function_body_nodes": library,
                 "trace_s": seconds}
  print(json.dumps({"graph_ops": out, "lora": a.lora, "batch": a.batch, "seq": a.seq,
                    "load_avg": os.getloadavg()}), flush=True)


def set_xla_vector_width(bits):
  """--xla-vector-width: XLA's preferred CPU vector width for this process and its children
  (XLA_FLAGS, read at the process's first XLA compilation, the library's compiled Philox draw
  included). 0: leaves XLA_FLAGS alone."""
  if not bits:
    return
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_cpu_prefer_vector_width")]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_cpu_prefer_vector_width={int(bits)}"])


def _child(mode, lora, common):
  """The JSON result of one configuration run in a child process (its failure as a dict)."""
  r = subprocess.run([sys.executable, os.path.abspath(__file__), "--mode", mode, "--lora",
                      str(lora)] + common, capture_output=True, text=True, check=False)
  lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
  return json.loads(lines[-1]) if lines else {
      "mode": mode, "lora": lora, "failed": r.stderr.strip().splitlines()[-3:]}


def pair(a, common):
  """--pair: non-private then DP, one child process each; one JSON line (module docstring)."""
  runs = {mode: _child(mode, a.lora, common) for mode in ("nonprivate", "dp")}
  ratios = {}
  for key in ("ms_per_step", "peak_rss_mib", "alloc_peak_mib", "first_step_s",
              "first_step_cpu_s"):
    if all(key in r for r in runs.values()):
      ratios[key] = round(runs["dp"][key] / runs["nonprivate"][key], 3)
  print(json.dumps({"lora": a.lora, "seq": a.seq, "batch": a.batch,
                    "results": {"ratios": ratios,
                                **{m: {k: r.get(k) for k in ("ms_per_step", "peak_rss_mib",
                                                             "alloc_peak_mib", "first_step_s",
                                                             "first_step_cpu_s")}
                                   for m, r in runs.items()}},
                    "runs": runs, "load_avg": os.getloadavg()}), flush=True)
  return 0


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--all", action="store_true", help="the four configurations, one process each")
  p.add_argument("--pair", action="store_true",
                 help="non-private and DP (one process each), one JSON line with the ratios")
  p.add_argument("--model", choices=["keras_hub", "plain"], default="keras_hub")
  p.add_argument("--mode", choices=["nonprivate", "dp"], default="dp")
  p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
  p.add_argument("--clipping", choices=["auto", "fast", "vectorized"], default="auto")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=32)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--profile", action="store_true", help="time the DP step's parts (one process)")
  p.add_argument("--ab", action="store_true",
                 help="DP step with and without the fold, and non-private (one process)")
  p.add_argument("--words", action="store_true",
                 help="DP step with the compiled Philox block and with the kernel's words, "
                      "and non-private (one process)")
  p.add_argument("--memory", action="store_true",
                 help="allocator peak of each part of the DP step, alone (one process)")
  p.add_argument("--ops", action="store_true",
                 help="op counts of the traced non-private gradient and clipped sum")
  p.add_argument("--xla-vector-width", type=int, default=0,
                 help="XLA's preferred CPU vector width in bits (0: XLA_FLAGS left alone)")
  a = p.parse_args()
  set_xla_vector_width(a.xla_vector_width)
  if a.profile:
    return profile(a)
  if a.ops:
    return graph_ops(a)
  if a.memory:
    return memory(a)
  if a.ab or a.words:
    return ab(a)
  common = ["--model", a.model, "--clipping", a.clipping, "--batch", str(a.batch),
            "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup)]
  if a.pair:
    return pair(a, common)
  if not a.all:
    return run_one(a)
  for lora in (0, 8):
    for mode in ("nonprivate", "dp"):
      print(json.dumps(_child(mode, lora, common)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
