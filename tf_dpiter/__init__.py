"""tf_dpiter: differentially private iterative training for TensorFlow and Keras 3.

Three concerns kept apart (seed 002): the privacy mechanism (`dp_query`), the privacy
ledger and its accountant (`ledger`, `accounting`), and the training procedure
(`keras`, `federated`, `draw_discard`).
"""

import importlib

__version__ = "0.1.0"

# Submodules load on first use, so that e.g. the Draw-and-Discard service does not pay for
# TensorFlow's import when it does not need it.
_LAZY = ("dp_query", "ledger", "accounting", "keras", "data", "federated", "draw_discard",
         "auditing")


def __getattr__(name):
  if name in _LAZY:
    return importlib.import_module(f"tf_dpiter.{name}")
  raise AttributeError(f"module 'tf_dpiter' has no attribute {name!r}")


# Keras deserializes `tf_dpiter>DPSequential` etc. only once tf_dpiter.keras has registered
# them: a program that already uses Keras gets them at `import tf_dpiter`, so that
# `keras.models.load_model` works in a fresh process without touching `dp.keras` first.
if "keras" in __import__("sys").modules:
  importlib.import_module("tf_dpiter.keras")
