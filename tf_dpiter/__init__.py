"""tf_dpiter: differentially private iterative training for TensorFlow and Keras 3.

Three concerns kept apart (seed 002): the privacy mechanism (`dp_query`), the privacy
ledger and its accountant (`ledger`, `accounting`), and the training procedure
(`keras`, `federated`, `draw_discard`).
"""

import importlib

from tf_dpiter import dp_query
from tf_dpiter import ledger
from tf_dpiter import accounting

__version__ = "0.1.0"

_LAZY = ("keras", "data", "federated", "draw_discard")


def __getattr__(name):
  if name in _LAZY:
    return importlib.import_module(f"tf_dpiter.{name}")
  raise AttributeError(f"module 'tf_dpiter' has no attribute {name!r}")
