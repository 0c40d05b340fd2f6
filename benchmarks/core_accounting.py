"""Figures of the privacy core (issue 2): published epsilons, Eq. (1), ledger speed.

Run: python benchmarks/core_accounting.py   (prints one JSON object per figure)
"""

import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from tf_dpiter import accounting as A
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L
from tf_dpiter.ledger import ledger_file


def emit(**kw):
  print(json.dumps(kw), flush=True)


def main():
  for n, b, z, ep, acc in [(60000, 256, 1.1, 60, "rdp"), (60000, 256, 1.1, 60, "pld"),
                           (60000, 150, 1.3, 15, "rdp"), (60000, 256, 0.7, 45, "rdp")]:
    t = time.perf_counter()
    r = A.compute_dp_sgd_privacy(n, b, z, ep, 1e-5, accountant=acc)
    emit(figure="dp_sgd_epsilon", n=n, batch_size=b, noise_multiplier=z, epochs=ep,
         accountant=acc, steps=r.steps, epsilon=round(r.epsilon, 4),
         seconds=round(time.perf_counter() - t, 3))

  led = L.PrivacyLedger(initial_capacity=16)

  @tf.function
  def record(n):
    for _ in tf.range(n):
      led.record_sample(60000.0, 256 / 60000, (dq.GaussianSumEvent(1.0, 1.1),))
    return led.sample_count

  t = time.perf_counter()
  count = int(record(tf.constant(100_000, tf.int64)))
  emit(figure="ledger_record_100k_steps_in_tf_function", samples=count,
       seconds=round(time.perf_counter() - t, 2))

  d = ledger_file.runs_to_dict(
      [(10**6, [1e7, 1e-4, 0.0, 0, 1, 1], [[0, 0, 1.0, 1.0, 1.0]])])  # Poisson, clip 1, sigma 1
  big = L.PrivacyLedger.from_dict(d)
  for acc in A.ACCOUNTANTS:
    t = time.perf_counter()
    eps = A.epsilon(big, 1e-6, accountant=acc)
    emit(figure="epsilon_of_1e6_identical_samples", accountant=acc, epsilon=round(eps, 4),
         seconds=round(time.perf_counter() - t, 3))

  # Eq. (1): 3 groups vs one Gaussian with the derived z.
  clips, stds = [1.0, 0.5, 2.0], [1.5, 1.0, 4.0]
  z = sum((c / s) ** 2 for c, s in zip(clips, stds)) ** -0.5
  multi = L.PrivacyLedger()
  for _ in range(1000):
    multi.record_sample(60000.0, 0.01, tuple(dq.GaussianSumEvent(c, s) for c, s in zip(clips, stds)))
  single = L.PrivacyLedger()
  for _ in range(1000):
    single.record_sample(60000.0, 0.01, (dq.GaussianSumEvent(1.0, z),))
  emit(figure="eq1_three_groups_vs_single_gaussian", z=round(z, 6),
       epsilon_groups=A.epsilon(multi, 1e-5), epsilon_single=A.epsilon(single, 1e-5))


if __name__ == "__main__":
  main()
