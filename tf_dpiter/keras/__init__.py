"""Keras 3 DP training (seed 002, Section 7): DP optimizers, DP models, privacy callbacks."""

from tf_dpiter.keras import callbacks
from tf_dpiter.keras import example_models
from tf_dpiter.keras import fast_clipping
from tf_dpiter.keras.callbacks import LedgerJournal
from tf_dpiter.keras.callbacks import PrivacyMeter
from tf_dpiter.keras.models import DPModel
from tf_dpiter.keras.models import DPModelMixin
from tf_dpiter.keras.models import DPSequential
from tf_dpiter.keras.models import check_no_batch_mixing
from tf_dpiter.keras.models import make_dp_model_class
from tf_dpiter.keras.models import make_private
from tf_dpiter.keras.models import make_private_with_epsilon
from tf_dpiter.keras.models import private_class
from tf_dpiter.keras.optimizers import CLIPPING_MODES
from tf_dpiter.keras.optimizers import DPKerasAdagradOptimizer
from tf_dpiter.keras.optimizers import DPKerasAdamOptimizer
from tf_dpiter.keras.optimizers import DPKerasAdamWOptimizer
from tf_dpiter.keras.optimizers import DPKerasRMSpropOptimizer
from tf_dpiter.keras.optimizers import DPKerasSGDOptimizer
from tf_dpiter.keras.optimizers import DPOptimizer
from tf_dpiter.keras.optimizers import DPOptimizerMixin
from tf_dpiter.keras.optimizers import make_dp_optimizer_class

# TF Privacy's names (keras.compat): clipping="vectorized" by default.
from tf_dpiter.keras.compat import VectorizedDPKerasAdagradOptimizer
from tf_dpiter.keras.compat import VectorizedDPKerasAdamOptimizer
from tf_dpiter.keras.compat import VectorizedDPKerasSGDOptimizer

__all__ = [
    "CLIPPING_MODES", "DPKerasAdagradOptimizer", "DPKerasAdamOptimizer", "DPKerasAdamWOptimizer",
    "DPKerasRMSpropOptimizer", "DPKerasSGDOptimizer", "DPModel", "DPModelMixin", "DPOptimizer",
    "DPOptimizerMixin", "DPSequential", "LedgerJournal", "PrivacyMeter",
    "VectorizedDPKerasAdagradOptimizer", "VectorizedDPKerasAdamOptimizer",
    "VectorizedDPKerasSGDOptimizer", "callbacks", "check_no_batch_mixing", "example_models",
    "fast_clipping", "make_dp_model_class", "make_dp_optimizer_class", "make_private", "make_private_with_epsilon",
    "private_class",
]
