"""Noise mechanisms of the DP optimizers, as values: `noise=dp.keras.noise.BLT(num_steps=...)`.

  IID()                                    DP-SGD's independent Gaussian noise (default).
  Tree(restart_every=R)                    DP-FTRL's online tree aggregation (Kairouz et al.
                                           2021); shuffled passes.
  BandMF(num_bands=b, num_steps=T,         banded matrix factorization (Choquette-Choo et al.
         strategy="toeplitz")              2023); cyclic Poisson with >= b groups.
  BLT(num_steps=T, num_buffers=4,          buffered linear Toeplitz (Dvijotham et al. 2024);
      min_separation=1)                    cyclic Poisson with >= min_separation groups.

Each is a final frozen dataclass (equality, `get_config`/`from_config`), checked when made,
that owns its query (`make_query`), the sampling its accounting needs
(`sampling_requirement`, `check_sampling`) and the structural event the ledger judges
(`requirement_event`). A new mechanism is a final subclass of `NoiseMechanism` with a unique
`name` (see tests/correlated/test_new_mechanism_fixture.py). The strings `noise="iid" |
"tree" | "band_mf" | "blt"` with the optimizers' flat keywords build these objects.
"""

from tf_dpiter.keras.optimizer.noise_mechanisms import BLT
from tf_dpiter.keras.optimizer.noise_mechanisms import BandMF
from tf_dpiter.keras.optimizer.noise_mechanisms import IID
from tf_dpiter.keras.optimizer.noise_mechanisms import NoiseMechanism
from tf_dpiter.keras.optimizer.noise_mechanisms import Tree
from tf_dpiter.keras.optimizer.noise_mechanisms import deserialize
from tf_dpiter.keras.optimizer.noise_mechanisms import from_shorthand
from tf_dpiter.keras.optimizer.noise_mechanisms import serialize

__all__ = ["NoiseMechanism", "IID", "Tree", "BandMF", "BLT", "from_shorthand", "serialize",
           "deserialize"]
