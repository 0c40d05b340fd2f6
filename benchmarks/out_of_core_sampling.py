"""Examples/s of Poisson sampling by index from TFRecord shards vs reading them sequentially.

  python benchmarks/out_of_core_sampling.py [--n 200000] [--batch 256] [--steps 200] [--reps 3]

Writes n MNIST-shaped records (28x28 uint8 + int64 label; random bytes) as indexed TFRecord
shards in a temporary directory (tf_dpiter.data.write_indexed_tfrecords), then times, round
robin, --reps times each:
  poisson_by_index   poisson_batches_from_source(TFRecordSource) (q = batch / n): records
                     read by os.pread at their offsets, padded, through tf.data
  sequential_tfrecord tf.data.TFRecordDataset(shards).batch(batch) + decode_raw (no sampling)
  poisson_in_memory  dp.data.poisson_batches on the same arrays held in memory (one uniform
                     draw per record per step: O(n))
  poisson_by_index_in_memory  poisson_batches_from_source(ArraySource) on those arrays
                     (Binomial count + uniform subset: O(q n))
and the index draw alone for a population of 10^9 records (m ~ Binomial(n, q), uniform
m-subset: O(q n) per step, independent of n). Examples/s counts real records (weight 1).
The shards were just written, so they are in the page cache: these are warm-cache figures;
on a cold disk the sampler pays one random read per record. Prints one JSON line.
"""

import argparse
import json
import os
import tempfile
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dpiter as dp  # noqa: E402
from tf_dpiter.data import indexed_records  # noqa: E402
from tf_dpiter.data import indexed_sampling  # noqa: E402


def _chunks(n, chunk, seed=0):
  rng = np.random.RandomState(seed)
  for i in range(0, n, chunk):
    k = min(chunk, n - i)
    yield rng.randint(0, 256, (k, 28, 28)).astype(np.uint8), rng.randint(0, 10, k).astype(np.int64)


def _rate(ds, weights_at):
  t0, count = time.perf_counter(), 0
  for el in ds:
    count += int(tf.reduce_sum(el[weights_at])) if weights_at is not None else int(
        tf.shape(el[0])[0])
  return count / (time.perf_counter() - t0)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--n", type=int, default=200_000)
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--records_per_shard", type=int, default=50_000)
  a = p.parse_args()
  warnings.simplefilter("ignore")
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    path = indexed_records.write_indexed_tfrecords(os.path.join(tmp, "ds"), _chunks(a.n, 10_000),
                                                   a.records_per_shard)
    write_s = time.perf_counter() - t0
    src = indexed_records.TFRecordSource(path)
    x = np.concatenate([c[0] for c in _chunks(a.n, 10_000)])
    y = np.concatenate([c[1] for c in _chunks(a.n, 10_000)])
    layout = src.dtype

    def decode(raw):
      b = tf.io.decode_raw(raw, tf.uint8)
      xs = tf.reshape(b[:, :784], [-1, 28, 28])
      ys = tf.bitcast(b[:, 784:], tf.int64)
      return xs, ys

    assert layout.itemsize == 792, layout
    runs = {
        "poisson_by_index": lambda: _rate(indexed_sampling.poisson_batches_from_source(
            src, a.batch, steps_per_epoch=a.steps), 2),
        "sequential_tfrecord": lambda: _rate(tf.data.TFRecordDataset(src.shard_paths).take(
            a.batch * a.steps).batch(a.batch).map(decode).prefetch(2), None),
        "poisson_in_memory": lambda: _rate(dp.data.poisson_batches(
            x, y, a.batch, steps_per_epoch=a.steps), 2),
        "poisson_by_index_in_memory": lambda: _rate(indexed_sampling.poisson_batches_from_source(
            indexed_records.ArraySource(x, y), a.batch, steps_per_epoch=a.steps), 2),
    }
    rates = {k: [] for k in runs}
    for _ in range(a.reps):
      for k, fn in runs.items():
        rates[k].append(fn())
    big_n = 10**9
    rng = np.random.Generator(np.random.Philox(0))
    t0 = time.perf_counter()
    for _ in range(a.steps):
      indexed_sampling.poisson_indices(rng, 0, big_n, a.batch / big_n)
    draw_ms = 1e3 * (time.perf_counter() - t0) / a.steps
  med = {k: float(np.median(v)) for k, v in rates.items()}
  print(json.dumps({
      "n": a.n, "batch": a.batch, "steps": a.steps, "reps": a.reps, "write_s": round(write_s, 2),
      "examples_per_s_median": {k: round(v) for k, v in med.items()},
      "examples_per_s_all": {k: [round(r) for r in v] for k, v in rates.items()},
      "ratio_by_index_over_sequential": round(med["poisson_by_index"] / med["sequential_tfrecord"], 3),
      "ratio_by_index_over_in_memory": round(med["poisson_by_index"] / med["poisson_in_memory"], 3),
      "ratio_in_memory_by_index_over_poisson_batches": round(
          med["poisson_by_index_in_memory"] / med["poisson_in_memory"], 3),
      "index_draw_ms_per_step_n1e9": round(draw_ms, 3),
      "load_avg": os.getloadavg()}))


if __name__ == "__main__":
  main()
