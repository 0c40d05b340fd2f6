"""tf_dpiter: differentially private iterative training for TensorFlow and Keras 3.

Three concerns kept apart, as in McMahan et al., "A General Approach to Adding Differential
Privacy to Iterative Training Procedures", Section 2: the privacy mechanism (`dp_query`), the
privacy ledger and its accountant (`ledger`, `accounting`), and the training procedures
(`keras`, `federated`, `draw_discard`); `data` holds the samplers, `auditing` the empirical
checks and `tuning` private hyperparameter selection.

Public names (`__all__`): the namespaces, loaded on first use (the Draw-and-Discard service
does not pay for TensorFlow's import), `errors` and its exceptions (the family every refused
argument raises), and `__version__`; everything else through a namespace
(`dp.keras.DPKerasSGDOptimizer`, `dp.accounting.epsilon`). The root tells the DPQuery
registry which upper-layer modules define serializable queries, so `dp_query.deserialize`
works in a fresh process while dp_query names no upper module.
"""

import importlib
import sys

from tf_dpiter import errors
from tf_dpiter.dp_query import declare_query_module as _declare_query_module
from tf_dpiter.errors import (
    BudgetConfigError, DPiterError, ParameterTypeError, ParameterValueError, PrivacyConfigError)

__version__ = "0.1.0"

_SUBPACKAGES = ("dp_query", "ledger", "accounting", "keras", "data", "federated",
                "draw_discard", "auditing", "tuning", "compat")

__all__ = list(_SUBPACKAGES) + ["errors", "DPiterError", "ParameterTypeError",
                                "ParameterValueError", "PrivacyConfigError",
                                "BudgetConfigError", "__version__"]

# Serializable queries of the upper layers: registered name -> module that registers it.
_declare_query_module("QueryWithLedger", "tf_dpiter.ledger.query_with_ledger")
_declare_query_module("MedianNormClipSumQuery", "tf_dpiter.federated.queries")


def __getattr__(name):
  if name in _SUBPACKAGES:
    return importlib.import_module(f"tf_dpiter.{name}")
  raise AttributeError(f"module 'tf_dpiter' has no attribute {name!r}")


def __dir__():
  return sorted(set(__all__) | {k for k in globals() if not k.startswith("_")} - {"importlib",
                                                                                   "sys"})


# Keras deserializes `tf_dpiter>DPSequential` etc. only once tf_dpiter.keras has registered
# them: a program that already uses Keras gets them at `import tf_dpiter`, so that
# `keras.models.load_model` works in a fresh process without touching `dp.keras` first.
if "keras" in sys.modules:
  importlib.import_module("tf_dpiter.keras")
