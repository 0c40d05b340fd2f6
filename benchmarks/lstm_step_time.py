"""Step time of an LSTM language model, DP (fast and vectorized) vs non-private (issue 14).

Embedding(2000, 64) -> LSTM(128, return_sequences=True, unroll=False) -> Dense(2000) logits
per token, sequences of 40 tokens, batch 64, both models compiled with the per-token
SparseCategoricalCrossentropy(from_logits=True) (the DP model's per-record loss is the mean
over the record's tokens). `model.train_on_batch` of a DPSequential with
DPKerasSGDOptimizer(C=1.0, z=1.1), clipping="auto" (asserted to resolve to the fast path)
and optionally "vectorized" (clipping, noise, ledger, update), against the keras.Sequential
step with SGD; median ms/step, configurations interleaved round by round in one process.

  python benchmarks/lstm_step_time.py --steps 10 --warmup 2 --rounds 3 [--vectorized]
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # pylint: disable=g-import-not-at-top
import numpy as np

from fast_clipping_dtype import make_step  # pylint: disable=g-import-not-at-top
from fast_clipping_dtype import time_steps

VOCAB, EMBED, UNITS, SEQ, BATCH = 2000, 64, 128, 40, 64


def lm_layers():
  L = keras.layers
  return [keras.Input((SEQ,), dtype="int32"), L.Embedding(VOCAB, EMBED),
          L.LSTM(UNITS, return_sequences=True, unroll=False), L.Dense(VOCAB)]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--vectorized", action="store_true",
                 help="also time clipping='vectorized' (about 1 s/step)")
  args = p.parse_args()
  rng = np.random.default_rng(0)
  x = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
  y = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
  models = {}
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  for clipping in ("auto", "vectorized", None) if args.vectorized else ("auto", None):
    model = make_step(lm_layers, clipping, loss, 100000, BATCH)
    name = "non_private" if clipping is None else model.optimizer.resolve_clipping(model)
    assert name == {"auto": "fast"}.get(clipping, name), (clipping, name)
    models[name] = model
  ms = time_steps(models, x, y, args.steps, args.warmup, args.rounds)
  out = {k: round(v, 1) for k, v in ms.items()}
  out["fast_over_non_private"] = round(ms["fast"] / ms["non_private"], 2)
  if args.vectorized:
    out["vectorized_over_non_private"] = round(ms["vectorized"] / ms["non_private"], 2)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
