"""Keras layers of tf_dpiter: data-independent feature extractors for DP training.

`Scattering2D`: the wavelet scattering transform (Bruna and Mallat, "Invariant Scattering
Convolution Networks", Section 3), the features of Tramer and Boneh, "Differentially Private
Learning Needs Better Features (or Much More Data)", ICLR 2021.
"""

from tf_dpiter.keras.layers.scattering import Scattering2D

__all__ = ["Scattering2D"]
