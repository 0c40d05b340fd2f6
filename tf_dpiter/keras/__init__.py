"""Keras 3 DP training (seed 002, Section 7): DP optimizers, DP models, privacy callbacks."""

from tf_dpiter.keras import callbacks
from tf_dpiter.keras import example_models
from tf_dpiter.keras.callbacks import LedgerJournal
from tf_dpiter.keras.callbacks import PrivacyMeter
from tf_dpiter.keras.models import DPModel
from tf_dpiter.keras.models import DPModelMixin
from tf_dpiter.keras.models import DPSequential
from tf_dpiter.keras.models import check_no_batch_mixing
from tf_dpiter.keras.models import make_dp_model_class
from tf_dpiter.keras.models import make_private
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

# TF Privacy's names for the same classes (its vectorized optimizers are what ours do anyway).
VectorizedDPKerasSGDOptimizer = DPKerasSGDOptimizer
VectorizedDPKerasAdamOptimizer = DPKerasAdamOptimizer
VectorizedDPKerasAdagradOptimizer = DPKerasAdagradOptimizer
VectorizedDPKerasRMSpropOptimizer = DPKerasRMSpropOptimizer
