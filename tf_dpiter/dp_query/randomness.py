"""Source of randomness for noise and sampling (seed 002, Section 8).

Noise and sampling come from a counter-based Philox `tf.random.Generator` (Salmon et al.
2011) seeded from operating-system entropy. A fixed seed exists for tests only: with it the
output is reproducible, hence not private, and a warning says so.
"""

import warnings

import tensorflow as tf


class NotPrivateSeedWarning(UserWarning):
  """A DP mechanism was given a fixed seed: its output is reproducible, not private."""


def make_generator(seed=None) -> tf.random.Generator:
  """Returns a Philox generator: OS entropy if `seed` is None, else seeded (tests only)."""
  if seed is None:
    return tf.random.Generator.from_non_deterministic_state(alg="philox")
  warnings.warn(
      f"seed={seed!r} given to a DP mechanism: its noise is reproducible and the output "
      "is NOT differentially private. Use a seed for tests only.",
      NotPrivateSeedWarning, stacklevel=3)
  return tf.random.Generator.from_seed(int(seed), alg="philox")
