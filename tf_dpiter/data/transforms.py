"""Per-record transforms of a sampled dataset that keep its sampling declaration.

A function over whole batches (`dataset.map(f)`) may mix records (batch-mean normalization,
mixup...), so the per-record sensitivity the ledger records would not hold: `get_sampling_spec`
refuses such a dataset. `map_records(dataset, fn)` applies `fn` to each record alone
(tf.vectorized_map, or a while loop), so the batch is still the drawn sample and keeps its
SamplingSpec; `map_fn=` of the samplers does the same on (x, y), leaving the weights.
"""

import inspect

import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.data import sampling
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError


def map_records(dataset, fn, num_parallel_calls=tf.data.AUTOTUNE):
  """`dataset` with `fn` applied to each record alone; keeps its SamplingSpec.

  `fn(x, y) -> (x, y)` (or `fn(x) -> x`) transforms the leading components, the trailing ones
  (sample weights, the Poisson mask) passing through; `fn(x, y, weight)` receives every
  component. Which is meant is read from `fn`'s required positional parameters (`*args`: all).

  Args:
    dataset: a dataset from poisson_batches / shuffled_batches (or derived from one through
      a transform that keeps the declaration).
    fn: called with the first k components of one record (batch axis removed), k its number
      of required positional parameters, returning k components (one value when k = 1).
    num_parallel_calls: as in tf.data.Dataset.map.

  Returns:
    The mapped dataset, carrying the same SamplingSpec.

  Raises:
    PrivacyConfigError: `dataset` declares no sampling, or `fn` requires more arguments than a
      record has components (names both).
    ParameterTypeError: `fn` is not callable.
  """
  spec = sampling.get_sampling_spec(dataset)
  if spec is None:
    raise PrivacyConfigError("map_records needs a dataset from dp.data.poisson_batches or "
                             "shuffled_batches (it carries their sampling declaration); for other data "
                             "use dataset.map and declare the sampling with optimizer.set_sampling")
  validation.check_params({"fn": validation.Callable()}, {"fn": fn})

  arity = _required_positional(fn)

  def per_batch(*components):
    k = len(components) if arity is None else arity
    if k > len(components):
      raise ParameterValueError(
          f"fn={getattr(fn, '__name__', fn)!r} requires {k} positional arguments, but the "
          f"dataset's records have {len(components)} components (x, y[, weight]); write "
          "fn(x, y) or fn(x, y, weight)")
    head, tail = components[:k], components[k:]
    if k == 1:
      out = sampling.per_record(lambda c: (fn(c),), head)
    else:
      out = sampling.per_record(lambda *c: tuple(fn(*c)), head)
    out = tuple(out) + tuple(tail)
    return out if len(out) > 1 else out[0]

  mapped = dataset.map(per_batch, num_parallel_calls=num_parallel_calls)
  return sampling.attach_spec(mapped, spec)


def _required_positional(fn):
  """The number of required positional parameters of `fn`, or None (`*args`, or a callable
  whose signature cannot be read: it then gets every component)."""
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    return None
  if any(p.kind == p.VAR_POSITIONAL for p in params):
    return None
  n = sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
          and p.default is p.empty)
  return n or None
