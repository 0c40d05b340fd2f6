"""The conv rule's batch-as-channels depthwise filter gradient, one call against chunks, by the
number of examples (rules/conv.py: _DEPTHWISE_CHANNELS, _DEPTHWISE_CHUNK_CHANNELS).

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/conv_depthwise_channels.py [--cin 1] [--cout 16]
      [--batches 256,384,500,512] [--chunks 128] [--rounds 5] [--calls 5]

The convolution: a 28x28xcin input, 8x8 kernel, stride 2, "same" (the tutorial CNN's first
convolution for cin 1, cout 16). For each batch size m, `rules/conv._depthwise_chunk` (one
depthwise filter gradient with the m cin examples' channels as input channels, Rochette et
al., "Efficient per-example gradient computations in convolutional neural networks", Sec. 3)
is timed in one call on the batch and over chunks of each --chunks size (tf.map_fn, one chunk
at a time, the last padded with zero examples as the rule's chunks of one size are), each a
tf.function with the batch axis unknown. Figure: median over --rounds rounds of the process
CPU ms of one call (--calls calls per round), and per example in microseconds. With oneDNN on,
one call slows down 2-2.5x per example from m cin = 512 input channels up. Prints one JSON
line.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tf_dpiter.keras.fast_clipping.rules import conv


def _forms(cin, cout, chunks):
  """{name: tf.function(x, dz) -> per-example gradients} of one call and of each chunk size."""
  spec = [tf.TensorSpec([None, 28, 28, cin]), tf.TensorSpec([None, 14, 14, cout])]
  grads = lambda x, dz: conv._depthwise_chunk(x, dz, (8, 8), (2, 2), "same")  # pylint: disable=protected-access
  forms = {"one_call": tf.function(grads, input_signature=spec)}

  def chunked(m):
    def fn(x, dz):
      n = (tf.shape(x)[0] + m - 1) // m
      pad = lambda t: tf.pad(t, [[0, m - tf.shape(t)[0]], [0, 0], [0, 0], [0, 0]])
      return tf.map_fn(lambda i: grads(pad(x[i * m:(i + 1) * m]), pad(dz[i * m:(i + 1) * m])),
                       tf.range(n), fn_output_signature=tf.TensorSpec([64, None, cin * cout]),
                       parallel_iterations=1)
    return tf.function(fn, input_signature=spec)

  for m in chunks:
    forms[f"chunks_{m}"] = chunked(m)
  return forms


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cin", type=int, default=1)
  p.add_argument("--cout", type=int, default=16)
  p.add_argument("--batches", default="256,384,500,512")
  p.add_argument("--chunks", default="128")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--calls", type=int, default=5)
  a = p.parse_args()
  batches = [int(b) for b in a.batches.split(",")]
  forms = _forms(a.cin, a.cout, [int(m) for m in a.chunks.split(",") if m])
  x = tf.random.normal([max(batches), 28, 28, a.cin])
  dz = tf.random.normal([max(batches), 14, 14, a.cout])
  out = {"cin": a.cin, "cout": a.cout, "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
         "load_avg_start": os.getloadavg(), "cpu_ms": {}, "cpu_us_per_example": {}}
  for b in batches:
    xb, db = x[:b], dz[:b]
    times = {k: [] for k in forms}
    for fn in forms.values():
      fn(xb, db)
    for _ in range(a.rounds):
      for k, fn in forms.items():
        c = time.process_time()
        for _ in range(a.calls):
          g = fn(xb, db)
        g.numpy()
        times[k].append((time.process_time() - c) / a.calls * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    out["cpu_ms"][b] = {k: round(v, 2) for k, v in med.items()}
    out["cpu_us_per_example"][b] = {k: round(1e3 * v / b, 1) for k, v in med.items()}
  out["load_avg_end"] = os.getloadavg()
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
