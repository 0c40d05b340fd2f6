"""Sampling of training batches for DP training (seed 002, Section 5).

`poisson_batches` (policy "poisson", the default of `DPModel.fit` on arrays) and
`shuffled_batches` (policy "shuffle": a new permutation per pass, passes charged by the
ledger); both carry the `SamplingSpec` that `DPModel.fit` declares to the ledger.
They survive prefetch, with_options, assert_cardinality, repeat and take; records are
transformed one at a time with `map_fn=` or `map_records` (a map over whole batches, cache,
batch, filter... lose the declaration, and fit names the transform).
"""

from tf_dpiter.data.sampling import SamplingSpec
from tf_dpiter.data.sampling import default_max_batch_size
from tf_dpiter.data.sampling import get_sampling_spec
from tf_dpiter.data.sampling import poisson_batches
from tf_dpiter.data.shuffling import ShuffleSampler
from tf_dpiter.data.shuffling import shuffled_batches
from tf_dpiter.data.shuffling import steps_per_pass
from tf_dpiter.data.transforms import map_records
