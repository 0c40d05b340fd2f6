"""DP fine-tuning of a keras_hub BERT text classifier, in full or with LoRA, offline.

A keras_hub task compiles itself in its constructor (BertTextClassifier: Adam, sparse
cross-entropy, accuracy). The usual keras_hub steps stay as they are: build the task,
optionally `backbone.enable_lora(rank)`, `compile` it with the optimizer you want; then one
line makes it private:

    classifier = dp.keras.make_private(classifier, l2_norm_clip=1.0, noise_multiplier=1.1)

which replaces the compiled Keras optimizer by its DP copy (same hyperparameters; per-example
gradients clipped to L2 norm 1.0, Gaussian noise of standard deviation 1.1 x 1.0 added to
their sum once per batch: McMahan et al., "A General Approach to Adding Differential Privacy
to Iterative Training Procedures", Section 7) and keeps the compiled loss and metrics. `fit`
then samples each batch by Poisson (q = batch_size / n) and the ledger records every step; ε
is computed from that ledger (RDP accountant, dp-accounting).

What an offline machine can and cannot load:
  * a preset (`keras_hub.models.BertTextClassifier.from_preset("bert_tiny_en_uncased",
    num_classes=2)`, with its pretrained weights and WordPiece vocabulary) is downloaded from
    Kaggle or Hugging Face on first use: it needs the network, or a preset directory copied
    to the machine beforehand (`from_preset("/path/to/preset_dir")` reads it locally);
  * a config does not: `BertBackbone(vocabulary_size=..., num_layers=..., ...)` and
    `BertTextClassifier(backbone, num_classes=..., preprocessor=None)` build the same
    architecture from constructor arguments, with random weights. That is what this tutorial
    does, so it runs anywhere; with a preset the code below is unchanged from `make_private` on.

The task (synthetic, derived from word lists, no download): each sentence mixes neutral words
with an odd number (1, 3 or 5) of sentiment words; the label is 1 when positive words
outnumber negative ones. Sentences are tokenized here with a fixed word-level vocabulary into
BERT's inputs ([CLS] words [SEP], padding mask, segment ids), so no tokenizer or preprocessor
is needed. Chance is 50%; every test label follows from its sentence, so 100% is reachable.

Two stages, as with a preset: (1) the stand-in for the preset's pretraining, WITHOUT DP, on a
public corpus that uses only half of the sentiment words (the pretrained model gets about 74%
on the test set: it knows those words); (2) DP fine-tuning on the private sentences, which use
all of them. The accuracy before and after stage 2 is printed.

Privacy claim: (ε, δ)-DP for adding or removing ONE SENTENCE of the private fine-tuning set
(Poisson sampling, ε from the run's ledger); the public corpus is not covered and needs none.

  python tutorials/keras_hub_dp_finetune.py                 # full fine-tuning
  python tutorials/keras_hub_dp_finetune.py --lora 4        # LoRA, rank 4
  python tutorials/keras_hub_dp_finetune.py --tiny --lora 2 # the CI size (a few steps)

Measured on 2 shared cores (2026-11-28), default size (4,000 private sentences, 48 steps of
expected batch 250, z = 1.0, S = 1.0): ε = 3.80 at δ = 1e-5; test accuracy 0.743 after public
pretraining, 0.900-0.904 after full DP fine-tuning (75,586 parameters trained; 3 runs, the
noise is not seeded), 0.799-0.840 after LoRA rank 4 (2,946 parameters trained; 3 runs);
20-25 s a run at load 4-5 (plus about 10 s of imports), most of it tracing the steps.

The last line printed is JSON: {"mode", "test_accuracy", "epsilon", "delta", "steps",
"trainable_params", ...}; `--ledger_path` also writes the ledger, from which the ε printed is
recomputed by `dp.accounting.epsilon(ledger_json, delta)`.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import keras_hub  # noqa: E402  (pip install -e ".[test]" installs keras-hub)
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402  (pip install -e . : see README)

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
POSITIVE = ["good", "great", "excellent", "fine", "happy", "love", "superb", "nice"]
NEGATIVE = ["bad", "awful", "poor", "sad", "hate", "terrible", "dull", "weak"]
NEUTRAL = ["the", "a", "movie", "film", "plot", "actor", "was", "is", "it", "this", "very",
           "really", "and", "but", "story", "scene", "music", "ending", "quite", "so"]
VOCAB = SPECIAL + POSITIVE + NEGATIVE + NEUTRAL
TOKEN_ID = {w: i for i, w in enumerate(VOCAB)}

# (examples, test examples, sequence length, layers, heads, hidden, intermediate)
SIZES = {"tiny": (256, 128, 12, 1, 2, 16, 32), "default": (4000, 1000, 24, 2, 2, 64, 128)}


def sentences(n, max_words, rng, positive_words=POSITIVE, negative_words=NEGATIVE):
  """n sentences and their labels: neutral words and 1, 3 or 5 sentiment words in random
  order; label 1 when positive words are the majority of the sentiment words.

  Args:
    n: the number of sentences.
    max_words: the most words a sentence holds (>= 5).
    rng: a numpy RandomState.
    positive_words: the positive words used.
    negative_words: the negative words used.
  Returns:
    (list of n word lists, int64 array of n labels in {0, 1}).
  """
  texts, labels = [], np.zeros(n, np.int64)
  for i in range(n):
    k = rng.choice([1, 3, 5])
    positive = rng.binomial(k, 0.5)
    words = ([positive_words[j] for j in rng.randint(len(positive_words), size=positive)] +
             [negative_words[j] for j in rng.randint(len(negative_words), size=k - positive)] +
             [NEUTRAL[j] for j in rng.randint(len(NEUTRAL), size=rng.randint(0, max_words - k + 1))])
    rng.shuffle(words)
    texts.append(words)
    labels[i] = int(2 * positive > k)
  return texts, labels


def tokenize(texts, sequence_length):
  """BERT's inputs for word lists: [CLS] ids [SEP], zero-padded to `sequence_length`.

  Args:
    texts: a list of word lists (each at most sequence_length - 2 words).
    sequence_length: T, the padded length.
  Returns:
    dict of int32 [n, T] arrays "token_ids", "padding_mask" (1 on real tokens),
    "segment_ids" (all 0: one segment).
  """
  ids = np.zeros((len(texts), sequence_length), np.int32)
  for i, words in enumerate(texts):
    row = ([TOKEN_ID["[CLS]"]] + [TOKEN_ID.get(w, TOKEN_ID["[UNK]"]) for w in words] +
           [TOKEN_ID["[SEP]"]])
    ids[i, :len(row)] = row
  return {"token_ids": ids, "padding_mask": (ids != 0).astype(np.int32),
          "segment_ids": np.zeros_like(ids)}


def build_classifier(sequence_length, num_layers, num_heads, hidden_dim, intermediate_dim):
  """A BertTextClassifier from a config (no download): random weights, no preprocessor.

  Args:
    sequence_length: T, the backbone's max_sequence_length.
    num_layers: transformer encoder layers.
    num_heads: attention heads per layer.
    hidden_dim: the model width.
    intermediate_dim: the feed-forward width.
  Returns:
    the task, as keras_hub builds it (compiled with its default Adam).
  """
  backbone = keras_hub.models.BertBackbone(
      vocabulary_size=len(VOCAB), num_layers=num_layers, num_heads=num_heads,
      hidden_dim=hidden_dim, intermediate_dim=intermediate_dim,
      max_sequence_length=sequence_length, dropout=0.0)
  return keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None,
                                             dropout=0.0)


def accuracy(model, x, y):
  """The fraction of (x, y) the model's argmax gets right."""
  return float(np.mean(model.predict(x, batch_size=512, verbose=0).argmax(axis=-1) == y))


def main(argv=None):
  """Pretrains on public data, makes private, fine-tunes on private data; prints accuracy
  and ε.

  Args:
    argv: command-line arguments (None: sys.argv).
  Returns:
    the summary dict printed as the last (JSON) line.
  """
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tiny", action="store_true", help="the CI size: 256 sentences, 1 layer")
  p.add_argument("--lora", type=int, default=0,
                 help="LoRA rank (backbone.enable_lora(rank)); 0: full fine-tuning")
  p.add_argument("--pretrain_epochs", type=int, default=None,
                 help="non-private epochs on the public corpus; default 2 (--tiny: 1)")
  p.add_argument("--epochs", type=int, default=None, help="DP epochs; default 3 (--tiny: 1)")
  p.add_argument("--batch_size", type=int, default=None, help="default 250 (--tiny: 64)")
  p.add_argument("--learning_rate", type=float, default=None,
                 help="Adam's in fine-tuning; default 1e-3 full, 3e-2 LoRA")
  p.add_argument("--l2_norm_clip", type=float, default=1.0)
  p.add_argument("--noise_multiplier", type=float, default=1.0)
  p.add_argument("--delta", type=float, default=1e-5)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--ledger_path", default=None, help="write the ledger JSON here")
  p.add_argument("--verbose", type=int, default=2)
  args = p.parse_args(argv)
  size = "tiny" if args.tiny else "default"
  n, n_test, seq_len, layers, heads, hidden, inter = SIZES[size]
  pretrain_epochs = (1 if args.tiny else 2) if args.pretrain_epochs is None else args.pretrain_epochs
  epochs = args.epochs or (1 if args.tiny else 3)
  batch_size = args.batch_size or (64 if args.tiny else 250)
  lr = args.learning_rate or (3e-2 if args.lora else 1e-3)

  t0 = time.time()
  keras.utils.set_random_seed(args.seed)
  rng = np.random.RandomState(args.seed)
  # public corpus: half of the sentiment words; private data and test: all of them
  public_text, y_public = sentences(n, seq_len - 2, rng, POSITIVE[:4], NEGATIVE[:4])
  train_text, y_train = sentences(n, seq_len - 2, rng)
  test_text, y_test = sentences(n_test, seq_len - 2, rng)
  x_public, x_train, x_test = (tokenize(t, seq_len) for t in (public_text, train_text, test_text))
  print("e.g.", " ".join(train_text[0]), "->", int(y_train[0]))
  print("offline: BertBackbone + BertTextClassifier built from constructor arguments (no "
        "download); a preset (from_preset('bert_tiny_en_uncased')) needs the network or a "
        "preset directory copied here")

  # 1. The stand-in for a preset: the architecture from a config, pretrained without DP on
  # PUBLIC data (a preset's weights come from public pretraining the same way).
  classifier = build_classifier(seq_len, layers, heads, hidden, inter)
  if pretrain_epochs:
    classifier.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=None,
                       weighted_metrics=["accuracy"])
    classifier.fit(x_public, y_public, batch_size=64, epochs=pretrain_epochs, verbose=0)
  pretrained_accuracy = accuracy(classifier, x_test, y_test)
  print(f"pretrained on the public corpus: test accuracy {pretrained_accuracy:.4f}")

  # 2. DP fine-tuning on the private data, as keras_hub fine-tunes: LoRA or not, compile.
  if args.lora:
    classifier.backbone.enable_lora(rank=args.lora)   # before compile: it fixes what trains
  # weighted_metrics: Keras' `metrics` ignore sample weights, so fit's Poisson batches'
  # padding rows (weight 0) would count as answers.
  classifier.compile(optimizer=keras.optimizers.Adam(lr), metrics=None,
                     weighted_metrics=["accuracy"])
  # The one DP line: the compiled Adam becomes DP Adam (same hyperparameters).
  classifier = dp.keras.make_private(classifier, l2_norm_clip=args.l2_norm_clip,
                                     noise_multiplier=args.noise_multiplier)
  trainable = int(sum(np.prod(v.shape) for v in classifier.trainable_variables))
  print(f"{'LoRA rank ' + str(args.lora) if args.lora else 'full fine-tuning'}: "
        f"{trainable:,} trainable parameters, optimizer {type(classifier.optimizer).__name__}")

  callbacks = [dp.keras.PrivacyMeter(delta=args.delta)]
  if args.ledger_path:
    callbacks.append(dp.keras.callbacks.LedgerExport(args.ledger_path))
  classifier.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, callbacks=callbacks,
                 verbose=args.verbose)
  test_accuracy = accuracy(classifier, x_test, y_test)
  report = dp.accounting.privacy_report(classifier.ledger, delta=args.delta)
  print(f"test accuracy {test_accuracy:.4f} (pretrained {pretrained_accuracy:.4f}, chance 0.5); "
        f"{report}")
  summary = {
      "mode": f"lora{args.lora}" if args.lora else "full", "size": size,
      "test_accuracy": round(test_accuracy, 4), "pretrained_accuracy": round(pretrained_accuracy, 4),
      "epsilon": float(report.epsilon), "delta": args.delta,
      "steps": int(classifier.ledger.sample_count.numpy()), "epochs": epochs,
      "pretrain_epochs": pretrain_epochs, "batch_size": batch_size, "learning_rate": lr,
      "l2_norm_clip": args.l2_norm_clip, "noise_multiplier": args.noise_multiplier,
      "trainable_params": trainable, "total_params": int(classifier.count_params()),
      "train_examples": n,
      "clipping": classifier.optimizer.resolve_clipping(classifier),
      "seconds": round(time.time() - t0, 1)}
  print(json.dumps(summary))
  return summary


if __name__ == "__main__":
  main()
