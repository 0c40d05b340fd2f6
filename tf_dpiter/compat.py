"""TF Privacy's and Opacus' spellings, in one place (the migration guides point here).

`tf_dpiter.compat` re-exports `tf_dpiter.keras.compat` (TF Privacy's names: `DPSequential(
l2_norm_clip=..., noise_multiplier=..., num_microbatches=..., layers=...)`,
`make_dp_model_class`, `make_keras_optimizer_class`, the `Vectorized*` optimizers,
`compute_dp_sgd_privacy`, `compute_dp_sgd_privacy_statement`, `compute_eps_poisson`) and adds
Opacus' entry point `make_private_with_epsilon`. These only choose defaults and argument orders:
the privacy, the ledger and the accounting are those of the `tf_dpiter.keras` names.

Loading this module imports TensorFlow and Keras (it is loaded lazily by `tf_dpiter.compat`).
"""

from tf_dpiter.keras.compat import *  # noqa: F401,F403  pylint: disable=wildcard-import
from tf_dpiter.keras.compat import __all__ as _KERAS_COMPAT_ALL
from tf_dpiter.keras.model.models import make_private_with_epsilon

__all__ = list(_KERAS_COMPAT_ALL) + ["make_private_with_epsilon"]
