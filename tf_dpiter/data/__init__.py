"""Sampling of training batches for DP training (seed 002, Section 5)."""

from tf_dpiter.data.sampling import SamplingSpec
from tf_dpiter.data.sampling import get_sampling_spec
from tf_dpiter.data.sampling import default_max_batch_size
from tf_dpiter.data.sampling import poisson_batches
from tf_dpiter.data.sampling import shuffled_batches
