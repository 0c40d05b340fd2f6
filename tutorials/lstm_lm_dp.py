"""DP training of an LSTM language model (port of TF Privacy's language-model tutorial, on
synthetic text: no download).

TF Privacy's `lm_dpsgd_tutorial.py` trains an LSTM next-token model on Penn Treebank with
DP-SGD. Here the text is sampled from a fixed random Markov chain over 40 tokens (each token
has a few likely successors), cut into sequences of 20 tokens; the model is Embedding ->
LSTM (unroll=False) -> Dense over the vocabulary, trained with the compiled per-token loss
(SparseCategoricalCrossentropy on [batch, time] labels) and the default `clipping="auto"`.

Privacy claim: (epsilon, delta)-DP for adding or removing ONE SEQUENCE (a record is a whole
sequence: its per-token losses are averaged into the record's loss before clipping). Batches
are Poisson samples (fit on arrays), epsilon comes from the ledger (RDP, dp-accounting).

  python tutorials/lstm_lm_dp.py --quick
  python tutorials/lstm_lm_dp.py --epochs 10

The last line printed is JSON: {"test_accuracy" (next-token), "bayes_accuracy" (the chain's
best possible), "epsilon", "delta", "steps", ...}.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402  (pip install -e . : see README)


def markov_chain(vocab, successors=3, seed=0):
  """Row-stochastic [vocab, vocab] transitions: each token has `successors` likely next
  tokens (weights 0.6, 0.25, 0.1 ...) and a little mass everywhere."""
  rng = np.random.RandomState(seed)
  p = np.full((vocab, vocab), 0.05 / vocab)
  weights = np.array([0.6, 0.25, 0.1, 0.05][:successors])
  for i in range(vocab):
    p[i, rng.choice(vocab, successors, replace=False)] += weights / weights.sum() * 0.95
  return p / p.sum(axis=1, keepdims=True)


def sample_sequences(p, num, length, seed):
  """num token sequences of length + 1 drawn from the chain (start uniform)."""
  rng = np.random.RandomState(seed)
  vocab = p.shape[0]
  seqs = np.zeros((num, length + 1), np.int32)
  seqs[:, 0] = rng.randint(0, vocab, num)
  cum = np.cumsum(p, axis=1)
  for t in range(1, length + 1):
    u = rng.rand(num, 1)
    seqs[:, t] = np.minimum((u > cum[seqs[:, t - 1]]).sum(axis=1), vocab - 1)
  return seqs[:, :-1], seqs[:, 1:]


def make_model(vocab, embed=16, units=64):
  return dp.keras.DPSequential([
      keras.Input((None,), dtype="int32"),
      keras.layers.Embedding(vocab, embed),
      keras.layers.LSTM(units, return_sequences=True, unroll=False),
      keras.layers.Dense(vocab),
  ])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--epochs", type=int, default=10)
  p.add_argument("--quick", action="store_true", help="2 epochs on 2000 sequences")
  p.add_argument("--num_sequences", type=int, default=20000)
  p.add_argument("--seq_len", type=int, default=20)
  p.add_argument("--vocab", type=int, default=40)
  p.add_argument("--batch_size", type=int, default=256, help="expected batch size (Poisson)")
  p.add_argument("--l2_norm_clip", type=float, default=1.0)
  p.add_argument("--noise_multiplier", type=float, default=1.0)
  p.add_argument("--learning_rate", type=float, default=0.1)
  p.add_argument("--delta", type=float, default=1e-5)
  p.add_argument("--verbose", type=int, default=2)
  args = p.parse_args(argv)
  if args.quick:
    args.epochs, args.num_sequences, args.batch_size = 2, 2000, 100
  chain = markov_chain(args.vocab)
  x, y = sample_sequences(chain, args.num_sequences, args.seq_len, seed=1)
  x_test, y_test = sample_sequences(chain, 500, args.seq_len, seed=2)
  model = make_model(args.vocab)
  model.compile(optimizer=dp.keras.DPKerasAdamOptimizer(
      l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
      learning_rate=args.learning_rate),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  start = time.time()
  model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=args.verbose,
            callbacks=[dp.keras.PrivacyMeter(args.delta, verbose=1)])
  seconds = time.time() - start
  pred = np.argmax(model.predict(x_test, batch_size=500, verbose=0), axis=-1)
  report = dp.accounting.privacy_report(model.ledger, delta=args.delta)
  print(report)
  print(json.dumps({
      "test_accuracy": float(np.mean(pred == y_test)),
      "bayes_accuracy": float(np.mean(np.argmax(chain[x_test], axis=-1) == y_test)),
      "epsilon": report.epsilon, "delta": args.delta, "clipping": model.optimizer.clipping,
      "steps": int(model.ledger.sample_count.numpy()), "epochs": args.epochs,
      "seconds": round(seconds, 1)}))


if __name__ == "__main__":
  main()
