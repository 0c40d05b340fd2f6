"""CPU cost of one Gaussian noise draw of a DP step: fixed cost and cost per value.

  python benchmarks/noise_draw_cost.py [--structures cnn,mlp,4m,32m] [--modes graph,xla]
                                       [--rounds 3] [--seconds 1.0] [--ops]

Each structure is a list of float32 leaves shaped like a model's gradients: `cnn` the tutorial
CNN's 8 leaves (26,010 values), `mlp` the 784-512-10 MLP's 4 (407,050), `4m` a BERT-like
attention block's 9 leaves (3,541,248), `32m` two BERT-base layers and its token embedding
(37,608,960), `109m` BERT-base's leaf sizes (109,482,240). For each structure and mode
(`graph`: a tf.function; `xla`: the same with jit_compile=True) one function draws
`gaussian_query.add_gaussian_noise(generator, leaves, 1.3)` on leaves passed as arguments;
the functions are called round robin in one process (--rounds rounds, each call repeated for
about --seconds), after two warm-up calls. Figures: median over rounds of process CPU ms per
call (`time.process_time`: every thread's CPU) and wall ms per call; per mode, the least
line cpu_ms = fixed_ms + ns_per_value * n / 1e6 (`_line`).

--ops: the graph mode's executed TensorFlow ops per draw of each structure (a v1 Session
with FULL_TRACE step stats: nodes run and their summed kernel microseconds by op type, 20
draws, medians) in place of the timing.
Prints one JSON line last ({"results": ...}, as benchmarks/compare_revisions.py reads).
"""

import argparse
import collections
import json
import os
import statistics
import time


def _bert_layer():
  h, f = 768, 3072
  return ([(h, h), (h,)] * 4 + [(h,), (h,)] + [(h, f), (f,), (f, h), (h,)] + [(h,), (h,)])


STRUCTURES = {
    "cnn": [(8, 8, 1, 16), (16,), (4, 4, 16, 32), (32,), (512, 32), (32,), (32, 10), (10,)],
    "mlp": [(784, 512), (512,), (512, 10), (10,)],
    "4m": [(768, 768), (768,)] * 4 + [(768, 1536)],
    "32m": [(30522, 768), (512, 768), (2, 768), (768,), (768,)] + _bert_layer() * 2,
    "109m": ([(30522, 768), (512, 768), (2, 768), (768,), (768,)] + _bert_layer() * 12
             + [(768, 768), (768,)]),
}


def _parse():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--structures", default="cnn,mlp,4m,32m")
  p.add_argument("--modes", default="graph,xla")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--seconds", type=float, default=1.0)
  p.add_argument("--ops", action="store_true")
  return p.parse_args()


def _size(shapes):
  total = 0
  for s in shapes:
    n = 1
    for d in s:
      n *= d
    total += n
  return total


def _timed(fns, rounds, seconds):
  """{key: (median CPU ms, median wall ms)} per call, round robin."""
  reps = {}
  for k, f in fns.items():
    f()
    t = time.perf_counter()
    f()
    reps[k] = max(1, int(seconds / max(time.perf_counter() - t, 1e-6)))
  cpu, wall = collections.defaultdict(list), collections.defaultdict(list)
  for _ in range(rounds):
    for k, f in fns.items():
      c0, w0 = time.process_time(), time.perf_counter()
      for _ in range(reps[k]):
        f()
      cpu[k].append(1e3 * (time.process_time() - c0) / reps[k])
      wall[k].append(1e3 * (time.perf_counter() - w0) / reps[k])
  return {k: (statistics.median(cpu[k]), statistics.median(wall[k])) for k in fns}


def _line(points):
  """(fixed_ms, ns_per_value) of cpu_ms against n: the slope through the two largest
  structures, the fixed cost the smallest one's cpu_ms less slope * n (a least squares line is
  led by the large sizes and gives the small ones' fixed cost no weight)."""
  if len(points) < 3:
    return None, None
  points = sorted(points)
  (n1, y1), (n2, y2) = points[-2:]
  slope = (y2 - y1) / (n2 - n1)
  return round(points[0][1] - slope * points[0][0], 3), round(slope * 1e6, 3)


def _timing(a, tf, gaussian_query):
  gen = tf.random.Generator.from_non_deterministic_state(alg="philox")
  fns, sizes = {}, {}
  for name in a.structures.split(","):
    leaves = [tf.zeros(s) for s in STRUCTURES[name]]
    sizes[name] = _size(STRUCTURES[name])
    for mode in a.modes.split(","):
      fn = tf.function(lambda *v: gaussian_query.add_gaussian_noise(gen, list(v), 1.3),
                       jit_compile=(mode == "xla"), autograph=False)
      fns[(mode, name)] = (lambda fn=fn, leaves=leaves: fn(*leaves))
  timed = _timed(fns, a.rounds, a.seconds)
  results = {}
  for mode in a.modes.split(","):
    per = {name: {"values": sizes[name], "cpu_ms": round(timed[(mode, name)][0], 3),
                  "wall_ms": round(timed[(mode, name)][1], 3)}
           for name in a.structures.split(",")}
    fixed, ns = _line([(sizes[n], r["cpu_ms"]) for n, r in per.items()])
    results[mode] = dict(per, fit={"fixed_cpu_ms": fixed, "cpu_ns_per_value": ns})
  return results


def _ops(a, tf, gaussian_query):
  import numpy as np  # pylint: disable=g-import-not-at-top
  results = {}
  for name in a.structures.split(","):
    g = tf.Graph()
    with g.as_default():
      gen = tf.random.Generator.from_non_deterministic_state(alg="philox")
      leaves = [tf.compat.v1.placeholder(tf.float32, s) for s in STRUCTURES[name]]
      out = gaussian_query.add_gaussian_noise(gen, leaves, 1.3)
      init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=g) as sess:
      sess.run(init)
      feed = {p: np.zeros(s, np.float32) for p, s in zip(leaves, STRUCTURES[name])}
      for _ in range(3):
        sess.run(out, feed)
      opts = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
      counts, micros, nodes = collections.Counter(), collections.defaultdict(list), []
      for _ in range(20):
        md = tf.compat.v1.RunMetadata()
        sess.run(out, feed, options=opts, run_metadata=md)
        run = collections.Counter()
        stats = [ns for dev in md.step_stats.dev_stats for ns in dev.node_stats]
        nodes.append(len(stats))
        for ns in stats:
          label = ns.timeline_label
          op = label.split("=", 1)[1].split("(")[0].strip() if "=" in label else ns.node_name
          counts[op] += 1
          run[op] += ns.all_end_rel_micros
        for op in counts:
          micros[op].append(run.get(op, 0))
    by_op = {op: {"per_draw": round(counts[op] / 20, 2),
                  "us": round(statistics.median(micros[op] + [0] * (20 - len(micros[op]))), 1)}
             for op in sorted(counts, key=lambda o: -sum(micros[o]))}
    results[name] = {"nodes_per_draw_median": statistics.median(nodes),
                     "kernel_us_median": round(sum(v["us"] for v in by_op.values()), 1),
                     "by_op": by_op}
  return results


def main():
  a = _parse()
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_dpiter.dp_query import gaussian_query  # pylint: disable=g-import-not-at-top
  load = os.getloadavg()
  results = _ops(a, tf, gaussian_query) if a.ops else _timing(a, tf, gaussian_query)
  print(json.dumps({"results": results, "tf": tf.__version__, "cpus": os.cpu_count(),
                    "load_avg_start": load, "load_avg_end": os.getloadavg(),
                    "utc": time.strftime("%H:%M:%S", time.gmtime())}), flush=True)


if __name__ == "__main__":
  main()
