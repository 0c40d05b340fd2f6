"""Sampling of training batches for DP training (McMahan et al. 2018, Section 5).

`poisson_batches` (policy "poisson", the default of `DPModel.fit` on arrays) and
`shuffled_batches` (policy "shuffle", passes charged by the ledger) carry the `SamplingSpec`
that `DPModel.fit` declares to the ledger; per-record transforms keep it (`map_fn=`,
`map_records`). Also cyclic Poisson (banded matrix factorization), truncated Poisson,
balls-in-bins, out-of-core Poisson by index (`poisson_batches_from_source`,
`distributed_poisson_batches`), user-level Poisson (`poisson_user_batches`), and
`declare_shuffled` for a user's own shuffled pipeline.
"""

from tf_dpiter.data.sampling import (
    SamplingSpec, default_max_batch_size, get_sampling_spec, poisson_batches)
from tf_dpiter.data.declared import declare_shuffled
from tf_dpiter.data.mnist import default_mnist_path, load_mnist
from tf_dpiter.data.shuffling import ShuffleSampler, shuffled_batches, steps_per_pass
from tf_dpiter.data.transforms import map_records
from tf_dpiter.data.cyclic_poisson import CyclicPoissonSampler, cyclic_poisson_batches
from tf_dpiter.data.truncated_poisson import TruncatedPoissonSampler, truncated_poisson_batches
from tf_dpiter.data.balls_in_bins import balls_in_bins_batches
from tf_dpiter.data.indexed_records import ArraySource, TFRecordSource, write_indexed_tfrecords
from tf_dpiter.data.indexed_sampling import distributed_poisson_batches, poisson_batches_from_source
from tf_dpiter.data.user_sampling import poisson_user_batches

__all__ = [
    "ArraySource", "CyclicPoissonSampler", "SamplingSpec", "ShuffleSampler", "TFRecordSource",
    "TruncatedPoissonSampler", "cyclic_poisson_batches", "default_max_batch_size",
    "declare_shuffled", "default_mnist_path", "distributed_poisson_batches", "get_sampling_spec", "load_mnist", "map_records", "poisson_batches",
    "poisson_batches_from_source", "poisson_user_batches", "shuffled_batches", "steps_per_pass",
    "truncated_poisson_batches", "write_indexed_tfrecords",
    "balls_in_bins_batches",
]
