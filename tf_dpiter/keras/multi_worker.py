"""What `model.fit` needs under tf.distribute.MultiWorkerMirroredStrategy (several processes).

Keras 3's TensorFlow trainer does not run `fit` under a multi-worker strategy as shipped
(Keras 3.15, TF 2.21), for any model:
1. `_maybe_symbolic_build` reduces the whole first distributed batch with
   `strategy.reduce("MEAN", batch)`; the collective strategy's reduce takes one tensor, not a
   nest (ValueError: "Attempt to convert a value (PerReplica ...)").
2. `reduce_per_replica(logs, reduction="auto")` calls `strategy.reduce("MEAN", v, axis=0)`
   on every log under a multi-worker strategy, which fails on the scalar logs a train step
   returns ("Invalid reduction dimension 0 for input with 0 dimensions").

`MultiWorkerFitMixin` fixes both for a DP model: the first batch is this worker's first
local replica's (shapes only: it builds the model), and every log gets a leading axis of 1,
so Keras' axis-0 MEAN is the mean over all replicas. Put it before the DP model class:
`class M(MultiWorkerFitMixin, DPSequential)`.

The data side is `tf_dpiter.data.indexed_sampling.distributed_poisson_batches` (one global
Poisson sample per step). Noise: every worker's optimizer draws noise on the all-reduced
clipped sum and Keras averages the workers' updates, so with independent generators the update
would carry noise of std z C / sqrt(W) for W workers, not z C. `MultiWorkerFitMixin.fit`
therefore gives every worker the chief's generator state before training
(`synchronize_noise`): all workers then draw the same noise, whose mean is that noise, std z C.
`secure_mode` (os.urandom, no state to share) is refused under several workers.
"""

import keras
import tensorflow as tf


def num_workers(strategy):
  """Worker processes of `strategy` (1 for a single-process strategy)."""
  resolver = getattr(strategy, "cluster_resolver", None)
  if resolver is None:
    return 1
  spec = resolver.cluster_spec().as_dict()
  return max(1, sum(len(spec.get(job, [])) for job in ("chief", "worker")))


def is_chief(strategy):
  """Whether this process is the chief (task "chief", or worker 0 without one)."""
  resolver = getattr(strategy, "cluster_resolver", None)
  if resolver is None or num_workers(strategy) == 1:
    return True
  spec = resolver.cluster_spec().as_dict()
  if "chief" in spec:
    return resolver.task_type == "chief"
  return resolver.task_type == "worker" and int(resolver.task_id) == 0


def broadcast_from_chief(strategy, value):
  """The chief's `value` (a tensor) on every worker: an all-reduce SUM to which only global
  replica 0 (on the chief) contributes. Call in cross-replica context (outside strategy.run),
  e.g. to give every worker the chief's noise-generator state."""
  value = tf.convert_to_tensor(value)

  def contribute():
    ctx = tf.distribute.get_replica_context()
    keep = tf.cast(tf.equal(ctx.replica_id_in_sync_group, 0), value.dtype)
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, value * keep)

  return strategy.experimental_local_results(strategy.run(contribute))[0]


def synchronize_noise(strategy, optimizer):
  """Makes the DP optimizer's noise generator on every worker a copy of the chief's.

  Call outside `strategy.scope()` and outside any tf.function, before training; afterwards
  every worker draws the same noise at every step (the draws are made in the same order).

  Args:
    strategy: the MultiWorkerMirroredStrategy.
    optimizer: a tf_dpiter DP optimizer.
  Raises:
    ValueError: secure_mode (os.urandom has no state to share), or a query without a
      `noise_generator`.
  """
  generator = optimizer.noise_generator
  if not isinstance(generator, tf.random.Generator):
    raise ValueError(
        f"secure_mode noise ({type(generator).__name__}) cannot be synchronized across "
        f"{num_workers(strategy)} workers: each would add its own noise and the average "
        "would carry std z C / sqrt(W). Train with secure_mode=False under "
        "MultiWorkerMirroredStrategy")
  generator.reset(broadcast_from_chief(strategy, generator.state))


class MultiWorkerFitMixin:
  """`fit` under MultiWorkerMirroredStrategy (module docstring); inert on one worker."""

  def fit(self, *args, **kwargs):  # pylint: disable=missing-function-docstring
    if num_workers(self.distribute_strategy) > 1:
      synchronize_noise(self.distribute_strategy, self.optimizer)
    return super().fit(*args, **kwargs)

  def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    if iterator is not None and data_batch is None and num_workers(self.distribute_strategy) > 1:
      for _, _, it in iterator:
        batch = next(it)
        break
      local = self.distribute_strategy.experimental_local_results
      data_batch = keras.tree.map_structure(
          lambda v: local(v)[0] if isinstance(v, tf.distribute.DistributedValues) else v, batch)
      iterator = None
    return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

  def train_step(self, data):  # pylint: disable=missing-function-docstring
    logs = super().train_step(data)
    if num_workers(self.distribute_strategy) == 1:
      return logs
    return keras.tree.map_structure(lambda t: tf.reshape(t, [1]), logs)
