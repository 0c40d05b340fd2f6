"""The private step of the DP optimizers, as one object: query, clipping, noise and ledger write.

McMahan et al., "A General Approach to Adding Differential Privacy to Iterative Training
Procedures" (2018), Section 7: a private training step is a DPQuery over the records of a
sample. Each record's gradient is clipped to L2 norm S and the clipped gradients are summed;
N(0, sigma^2) noise with sigma = z S is added once per logical batch; the noised sum is
divided by the batch's denominator; the ledger records the sample (Section 6). With the
default Gaussian query this is DP-SGD (Abadi et al., "Deep Learning with Differential
Privacy", 2016, Algorithm 1).

Neighbouring relation and unit: those of the declared sampling policy, recorded with every
sample: add/remove one example under Poisson-type sampling, replace-one under "shuffle" and
"fixed_size". The unit is the example (the user under user-level batches); a record is one
example or a microbatch of k = ceil(B / M) examples, charged at sensitivity 2S.

The Keras DP optimizer holds one `PrivateStep` (`optimizer.private_step`). Its state are TF
variables tracked by the optimizer under fixed names ("_dp_ledger", "_dp_expected_records",
and for IID noise or a custom dp_query "_dp_global_state_<i>", public parameters such as
(S, sigma) or an adaptive clip), so checkpoints, `save_weights` and `model.save` carry them
(the float16 overflow count, an un-noised diagnostic, is not tracked: no file carries it).
The noise generator is deliberately not among them, so no restore can make it draw a noise
it drew before. Nor is a correlated mechanism's state (tree nodes, BandMF history, BLT
buffers): it is the noise itself (the tree's open nodes sum to the cumulative noise of the
released weights, Kairouz et al. 2021, Section 3), so a file holding it would release the
noise-free model. Such a run therefore cannot continue from a file: a step whose ledger holds
samples its in-memory noise state did not draw is refused (`require_noise_state`), unless
the private `restore_noise_state` file of the same step is restored. Helpers: `step_sampling`,
`noise_mechanisms`, `chunking`; per-variable pipelining (Bu et al., "Differentially private
optimization on large model at small cost", Section 3): `gate_sums_on_noise`, below.
"""

import contextlib
import json
import sys
import weakref

import numpy as np
import tensorflow as tf

from tf_dpiter import dp_query as dp_query_lib
from tf_dpiter import ledger as ledger_lib
from tf_dpiter import validation
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import randomness
from tf_dpiter.dp_query import summation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras import fast_clipping
from tf_dpiter.keras.internals import runtime
from tf_dpiter.keras.optimizer import chunking
from tf_dpiter.keras.optimizer import dp_config
from tf_dpiter.keras.optimizer import gradients as grads_lib
from tf_dpiter.keras.optimizer import noise_mechanisms
from tf_dpiter.keras.optimizer import routing
from tf_dpiter.keras.optimizer import step_sampling
from tf_dpiter.keras.optimizer import update_binding
from tf_dpiter.ledger import policies as ledger_policies
from tf_dpiter.ledger import privacy_ledger


class PrivateStep:
  """The DP step of one optimizer (see module docstring), built from a frozen plan
  (`dp_config.DPConfig`) and performance flags (`dp_config.PerformanceFlags`); the plan's
  and flags' fields are read-only properties.

  Attributes:
    optimizer: the Keras optimizer holding this step (its variables are tracked by it).
    flags: the PerformanceFlags.
    record_microbatches: M as records are cut for the declared sampling (None: one example
      per record; step_sampling.record_microbatches).
    base_query: the query that clips and draws the noise (the mechanism's, or the user's).
    sampling: the ledger.LedgerSampling the step records with (None until declared).
    sampling_source: "user", "fit" or None (who declared the sampling).
    expected_size_denominator: the declared policy's batch size is random (Poisson-type): the
      average is divided by the expected batch size and XLA pads to a static size.
  """

  def __init__(self, optimizer, plan, flags=None):
    """Args:
      optimizer: the Keras optimizer that holds the step.
      plan: a dp_config.DPConfig (validated when it was made).
      flags: a dp_config.PerformanceFlags (None: the defaults).
    """
    self.optimizer = optimizer
    self._plan = plan
    self.flags = flags if flags is not None else dp_config.PerformanceFlags()
    self.record_microbatches = plan.num_microbatches   # set again by each declared sampling
    self.base_query = plan.dp_query   # made lazily (make_state) unless given
    self.sampling = None              # ledger.LedgerSampling, made by set_sampling
    self._wrapped = None              # (base_query, sampling, their QueryWithLedger)
    self.sampling_source = None
    self._ledger = None   # the variables (make_state)
    self._expected_records = None
    self._overflow_count = None
    self._restored_ledger = None   # (samples, queries, passes[, grouping]), merged by make_state
    self._restored_global_state = None    # the config's "dp_global_state", used once
    self._global_vars = None              # the query's global state variables (flattened)
    self._global_struct = None
    self._noise_draws = None   # correlated: draws made with the in-memory noise state (untracked)
    # a restored noise state's run table until the ledger is seen to hold it, and its flag
    self._noise_runs_pending = None
    self._noise_runs_ok = None
    self._pending_sampling = None
    self.expected_size_denominator = False   # set by adopt_sampling from the declared policy
    self._query_facts = None   # (base query, gives_clip_factors, adds_scaled_noise of it)
    self._route = None   # (resolve_clipping's key, its path): _route_key
    self._noised = update_binding.NoisedResults()
    # the declarations' epoch (`require_user_sampling`; -1 in the variable once fit declared)
    self._sampling_epoch = 0
    self._user_epoch = None
    self._traced_user_epochs = weakref.WeakKeyDictionary()   # graph -> epoch checked
    self._layer_keys = None   # the random layers' key source (keyed_layer_draws; untracked)
    self.draws_keyed = False   # inside a keyed_layer_draws block with random layers

  # ---- the plan and the flags (read-only) -----------------------------------------------

  plan = property(lambda self: self._plan, doc="The frozen DPConfig of this step.")
  mechanism = property(lambda self: self._plan.noise, doc="The noise mechanism object.")
  l2_norm_clip = property(lambda self: self._plan.l2_norm_clip, doc="S (None: dp_query).")
  noise_multiplier = property(lambda self: self._plan.noise_multiplier, doc="z (None: dp_query).")
  num_microbatches = property(lambda self: self._plan.num_microbatches, doc="M.")
  normalize = property(lambda self: self._plan.normalize, doc="Divide by the denominator.")
  seed = property(lambda self: self._plan.seed, doc="The noise seed (tests only).")
  secure_mode = property(lambda self: self._plan.secure_mode, doc="os.urandom noise.")
  custom_query = property(lambda self: self._plan.custom_query, doc="A user's dp_query.")
  noise = property(lambda self: self._plan.noise.name, doc='The mechanism\'s name ("iid", ...).')
  max_physical_batch_size = property(lambda self: self.flags.max_physical_batch_size,
                                     doc="P, examples per physical chunk.")
  clipping = property(lambda self: self.flags.clipping, doc="The clipping path.")
  skip_padding_tail = property(lambda self: self.flags.skip_padding_tail,
                               doc="chunking.chunk_layout skips all-padding chunks.")
  noise_in_compiled_program = property(lambda self: self.flags.compiled_noise,
                                       doc="None: on an accelerator only (compiles_noise).")

  @property
  def noise_params(self):
    """The mechanism's flat parameters (the optimizer's keywords; {} for IID)."""
    return self._plan.noise.flat_params()

  @property
  def private_batch_size(self):
    """True unless the declared sampling's batch size is public (a fixed size, shuffled
    passes): under Poisson-type sampling, or none declared yet, a batch's size depends on
    which records were sampled, so a value computed from it is data."""
    return self.sampling is None or self.expected_size_denominator

  @property
  def stddev(self):
    """sigma = z S in sum units (None with a custom dp_query)."""
    if self._plan.custom_query:
      return None
    return dp_query_lib.gaussian_stddev(self._plan.l2_norm_clip, self._plan.noise_multiplier)

  def set_flags(self, **changes):
    """Replaces performance flags (`**changes`: PerformanceFlags field -> value, validated) and
    returns the new PerformanceFlags; the privacy plan is unchanged."""
    self.flags = self.flags.replace(**changes)
    return self.flags

  def restore_saved(self, global_state=None, ledger=None):
    """Applies a saved config's query global state (used when the state is made) and ledger
    ((samples, queries, passes, grouping) of its verified "dp_ledger"), either may be None."""
    self._restored_global_state = global_state
    if ledger is not None:
      self.adopt_ledger(*ledger)

  # ---- state: the variables ---------------------------------------------------------

  expected_records = property(lambda self: self._expected_records,
                              doc="The public expected batch size variable (None until made).")
  restored_ledger = property(lambda self: self._restored_ledger,
                             doc="A ledger's arrays waiting for make_state, else None.")

  def _track(self, name, trackable):
    """Makes `trackable` a checkpoint dependency of the optimizer under `name`."""
    self.optimizer._track_trackable(trackable, name=name, overwrite=True)  # pylint: disable=protected-access
    return trackable

  def adopt_ledger(self, samples, queries, passes, grouping=None, runs=None):
    """Merges a ledger of this run (arrays, passes, cyclic grouping and run table, as
    `PrivacyLedger.merge_arrays` takes them) into the ledger, or, before it exists, into the
    one `make_state` starts from."""
    if self._ledger is not None:
      self._ledger.merge_arrays(samples, queries, passes, grouping, runs)
    elif self._restored_ledger is None:
      self._restored_ledger = (samples, queries, int(passes), grouping, runs)
    else:
      self._restored_ledger = privacy_ledger.merged_arrays(
          self._restored_ledger, (samples, queries, int(passes), grouping, runs))

  def make_state(self):
    """Creates the default query, the ledger and the sampling variables, once, outside any
    tf.distribute scope (growing buffers cannot be mirrored; the noise has one generator).

    Raises:
      PrivacyConfigError: called in a tf.distribute cross-replica scope.
    """
    if self._ledger is not None:
      return
    if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
      raise PrivacyConfigError(
          "the DP state (ledger, noise generator) must be created outside a tf.distribute "
          "scope: call model.fit / optimizer.set_sampling outside `with strategy.scope():` "
          "(build and compile the model inside it as usual)")
    if self.mechanism.needs_variables and self.base_query is None:
      self.base_query = noise_mechanisms.Unbuilt(self.noise)   # replaced in build_mechanism
    with tf.init_scope():
      if self.base_query is None:   # the mechanism's query (IID: sigma = z S, computed once)
        self.base_query = self._plan.make_query()
      self._expected_records = self._track("_dp_expected_records", tf.Variable(
          1.0, dtype=tf.float32, trainable=False, name="dp_expected_records"))
      # un-noised diagnostic: out of the object graph, so no file carries it
      self._overflow_count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                         name="dp_overflowed_records")
      # noised results drawn and used by updates (`charged_gradients`): untracked, so no
      # restore lowers either and an adopted ledger's samples pay for nothing
      self._noised_results = tf.Variable(0, dtype=tf.int64, trainable=False,
                                         name="dp_noised_results")
      self._used_results = tf.Variable(0, dtype=tf.int64, trainable=False,
                                       name="dp_used_noised_results")
      self._ledger = self._track("_dp_ledger", ledger_lib.PrivacyLedger())
      self._layer_key_source()   # before any trace (a variable made in a trace retraces)
      if self._restored_ledger is not None:   # from from_config or adopt_ledger
        pending, self._restored_ledger = self._restored_ledger, None
        self._ledger.merge_arrays(*pending)

  @property
  def ledger(self):
    """The PrivacyLedger every private step writes to (made on first use)."""
    self.make_state()
    return self._ledger

  @property
  def existing_ledger(self):
    """The ledger if it was made, else None (nothing is created)."""
    return self._ledger

  @property
  def overflow_counter(self):
    """The int64 variable counting records whose float16 gradient overflowed (zeroed)."""
    self.make_state()
    return self._overflow_count

  def count_overflowed(self, finite, record_mask):
    """Adds the real records (`record_mask`) whose float16 gradient was zeroed (`finite` False;
    None: no loss scale) to the overflow counter and warns; returns the control dependencies
    for the accumulation. A zeroed record adds 0 to the clipped sum (norm 0 <= C): the
    guarantee holds; the count and warning are un-noised diagnostics outside it (no checkpoint
    carries the count)."""
    if finite is None:
      return []
    zeroed = tf.logical_and(tf.logical_not(finite), tf.cast(record_mask, tf.float32) > 0)
    count = tf.reduce_sum(tf.cast(zeroed, tf.int64))

    def warn():
      tf.print("WARNING: tf_dpiter: the float16 gradients of", count, "record(s) overflowed "
               "and were zeroed (they add 0 to the clipped sum; the privacy guarantee holds). "
               "Lower the learning rate or train under mixed_bfloat16/float32; "
               "optimizer.overflowed_records counts them.", output_stream=sys.stderr)
      return tf.constant(True)

    added = self.overflow_counter.assign_add(count)
    with tf.control_dependencies([added]):
      return [tf.cond(count > 0, warn, lambda: tf.constant(False))]

  @property
  def noise_generator(self):
    """The noise source of the query (`GaussianSumQuery.noise_generator`).

    Raises:
      PrivacyConfigError: a custom `dp_query` that does not expose `noise_generator`.
    """
    self.make_state()
    generator = getattr(self.base_query, "noise_generator", None)
    if generator is None:
      raise PrivacyConfigError(
          f"dp_query={self.base_query!r} does not expose `noise_generator`: its noise "
          "cannot be synchronized across workers")
    return generator

  def synchronize_noise(self, strategy):
    """`DPOptimizerBase.synchronize_noise`: every worker's generator becomes a copy of the chief's.

    Raises:
      PrivacyConfigError: secure_mode (os.urandom has no state to share), or a query without
        a `noise_generator`.
    """
    generator = self.noise_generator
    if not isinstance(generator, tf.random.Generator):
      raise PrivacyConfigError(
          f"secure_mode noise ({type(generator).__name__}) cannot be synchronized across "
          f"{runtime.num_workers(strategy)} workers: each would add its own noise and the "
          "average would carry std z C / sqrt(W). Train with secure_mode=False under "
          "MultiWorkerMirroredStrategy")
    generator.reset(runtime.broadcast_from_chief(strategy, generator.state))
    self._noise_workers = runtime.num_workers(strategy)

  def charged_gradients(self, grads):
    """(`grads`, control dependencies) of one update, which waits for the check that a noised
    result was drawn and recorded since the last update (plain gradients are refused); the
    update uses up every unused one. The counts are in no checkpoint, so a restore cannot lower
    them. Under XLA (which drops assertions) the gradients are multiplied by NaN."""
    def use():
      noised, used = self._noised_results.read_value(), self._used_results.read_value()
      ok = tf.greater(noised, used)
      # one Assert op (tf.debugging.Assert adds a tf.cond)
      check = tf.raw_ops.Assert(condition=ok, data=[
          "apply_private_gradients applies the gradients of a charged private step "
          "(compute_private_gradients), one noised and recorded result per update: none "
          "was drawn since the last update. Plain gradients go to a non-DP optimizer. "
          "Received: noised results", noised, "used by updates", used])
      with tf.control_dependencies([check]):
        return ok, self._used_results.assign(noised)

    ctx = tf.distribute.get_replica_context()
    if ctx is not None and tf.distribute.get_strategy().num_replicas_in_sync > 1:
      ok, done = ctx.merge_call(lambda strategy: use())
    else:
      ok, done = use()
    if summation.in_xla_context():
      factor = tf.where(ok, 1.0, float("nan"))
      grads = [g if g is None else g * tf.cast(factor, g.dtype) for g in grads]
    if self._noised.eager:   # eager: the pending results are used up with the count
      self._noised.used()
    return grads, [done]

  # ---- the model's random layers ----------------------------------------------------------

  @contextlib.contextmanager
  def keyed_layer_draws(self, generators):
    """Within the block, the keras.random.SeedGenerators of a model's layers
    (`keras_internals.seed_generators`) are keyed from this step's own secret generator:
    fresh keys at each entry, the generators' states as before on exit.

    Under Poisson-type sampling (add/remove one example) a row's position in the batch
    depends on which records were sampled. A Dropout (GaussianNoise, RandomFlip, ...) draws
    per row from its SeedGenerator's state, a function of the user's seed (`seed=`,
    `keras.utils.set_random_seed`) and of the calls so far: known draws by position, so
    removing one record changes the draws of every later record and the clipped sum moves
    by more than the clip norm C. Keyed from a secret that is fresh at each step (Philox,
    Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", Section 3: the words of
    distinct keys and counters pass for independent uniform words), the rows' draws are
    i.i.d. and independent of the data (on the vectorized path tf.vectorized_map gives every
    record the same draws: one secret draw, shared, as independent of the data), so the sum
    is distributed as if each record carried its own draw and one record moves it by at
    most C (Abadi et al., "Deep Learning with Differential Privacy", Section 3.1). Each
    record's norm and its summed gradient come from one forward pass over it (fast path:
    norms and sum of one forward per physical chunk; vectorized: one per record), which
    reads the states as Keras advances them within the block.

    The key source (`_layer_key_source`) is OS entropy, never saved (no restore can make it
    draw a key twice), os.urandom under secure_mode; the states are put back on exit, so no
    saved model holds a key a step used. Keras draws a layer's seed as state mod (2^31 - 2)
    (`_cast_seed`): 62 secret bits per generator and step.

    Args:
      generators: the model's keras.random.SeedGenerators (a list; empty: nothing drawn).

    Yields:
      None. Inside a tf.function the keys are drawn when the block is entered and the states
      restored when it is left (the variables' reads and writes run in program order).
    """
    if not generators:
      yield
      return
    words = randomness.int64_words(self._layer_key_source(), 2 * len(generators))
    saved = [tf.identity(g.state.value) for g in generators]
    for i, g in enumerate(generators):
      g.state.assign(tf.cast(words[2 * i:2 * i + 2], g.state.dtype))
    outer, self.draws_keyed = self.draws_keyed, True
    try:
      yield
    finally:   # also when the block raises (eagerly: no state left holding a key)
      self.draws_keyed = outer
      for g, value in zip(generators, saved):
        g.state.assign(value)

  def refuse_grouped_draws(self, per_chunk, shared):
    """Refuses physical chunks (`per_chunk`, the chunk layout) under Poisson-type sampling when
    keyed random layers draw once for several records of a chunk (`shared`: layer names, or
    the vectorized pass): records sharing a draw would be grouped by position, and one removed
    record regroups the others (a move of up to k C). Draws of one per record are i.i.d.
    across chunks: not refused.

    Raises:
      PrivacyConfigError: such draws, keyed, in more than one chunk of a private-size batch.
    """
    if not (self.draws_keyed and shared and per_chunk is not None
            and self.private_batch_size):
      return
    raise PrivacyConfigError(
        "physical chunks of a Poisson-type batch with random layers whose draws are shared "
        f"by several records ({', '.join(shared)}): each chunk draws anew, so which records "
        "share a draw would follow their position, and removing one record regroups the "
        "others (the clipped sum moves by more than the clip norm). Process the batch in one "
        "chunk (a max_physical_batch_size of at least the batch's examples: without one, the "
        "fast path chunks a batch whose kept tensors exceed its memory budget), draw per "
        "record (Dropout's noise_shape=None, clipping='fast'), or sample with "
        "sampling='shuffle'. Received: "
        f"max_physical_batch_size={self.flags.max_physical_batch_size}")

  def _layer_key_source(self):
    """The secret generator of `keyed_layer_draws`: Philox from OS entropy, os.urandom under
    secure_mode; with a `seed` (tests only) a stream split apart from the noise's."""
    if self._layer_keys is None:
      with tf.init_scope():
        if self.secure_mode:
          self._layer_keys = randomness.SecureRandom()
        elif self.seed is None:
          self._layer_keys = randomness.make_generator()
        else:
          self._layer_keys = tf.random.Generator.from_seed(
              int(self.seed), alg="philox").split(1)[0]
    return self._layer_keys

  def _require_one_noise(self):
    """Refuses a draw under several workers whose generators were not synchronized: each
    worker would add its own noise to the all-reduced sum, and the mean of W draws has
    std z C / sqrt(W) where the ledger charges z C."""
    workers = (runtime.num_workers(tf.distribute.get_strategy()) if tf.distribute.has_strategy()
               else 1)
    if workers > 1 and getattr(self, "_noise_workers", 1) != workers:
      raise PrivacyConfigError(
          f"the private step runs on {workers} workers whose noise generators were not "
          "synchronized: each would add its own noise (released std z C / sqrt(W), the "
          "ledger charges z C). Call optimizer.synchronize_noise(strategy) once on every "
          "worker before training (outside strategy.scope() and any tf.function; model.fit "
          f"does it). Received: {workers} workers, generators not synchronized")

  @property
  def clips_by_factors(self):
    """True if the query can clip norms computed elsewhere (the fast path needs it)."""
    if self.base_query is None:
      return True
    return self._facts_of_query()[1]

  def _facts_of_query(self):
    """(base query, `dp_query.gives_clip_factors`, `gaussian_query.adds_scaled_noise`), read
    once per query."""
    query = self.base_query
    if self._query_facts is None or self._query_facts[0] is not query:
      self._query_facts = (query, dp_query_lib.gives_clip_factors(query),
                           gaussian_query.adds_scaled_noise(query))
    return self._query_facts

  def noise_state(self):
    """The correlated query's global state as numpy values (a namedtuple: step, noise history /
    tree nodes / BLT buffers, clip, stddev); None for "iid" or before the build."""
    if not self.mechanism.correlated or self._global_vars is None:
      return None
    return tf.nest.pack_sequence_as(self._global_struct, [v.numpy() for v in self._global_vars])

  def global_state_values(self):
    """The query's global state as nested lists (for the config), else the restored one."""
    if self._global_vars is not None:
      return [v.numpy().tolist() for v in self._global_vars]
    return self._restored_global_state

  def _make_global_state(self, initial):
    """The query's global state variables, from `initial` or the state from_config saved.

    Raises:
      ParameterValueError: the saved state does not match the query's (count or shapes).
    """
    init = tf.nest.map_structure(tf.convert_to_tensor, initial)
    flat, saved = tf.nest.flatten(init), self._restored_global_state
    if saved is not None:   # the config's "dp_global_state" (nested lists), e.g. an adaptive clip
      if not isinstance(saved, (list, tuple)) or len(saved) != len(flat) or any(
          tuple(np.shape(s)) != tuple(t.shape) for s, t in zip(saved, flat)):
        raise ParameterValueError(
            "the saved dp_global_state does not match the query's state (expected "
            f"{len(flat)} values of shapes {[tuple(t.shape) for t in flat]}). "
            f"Received: dp_global_state={saved!r}")
      flat = [tf.constant(np.asarray(s), dtype=t.dtype) for s, t in zip(saved, flat)]
    self._restored_global_state = None
    self._set_global_state(init, [tf.Variable(t, trainable=False, name="dp_global_state")
                                  for t in flat])

  def _set_global_state(self, struct, variables):
    """Adopts `variables` (flattened like `struct`) as the query's global state: tracked for
    public parameters (IID, a custom dp_query); a correlated mechanism's state is the noise,
    kept out of every file, with an untracked draw counter (`require_noise_state`)."""
    self._global_struct = struct
    self._global_vars = list(variables)
    if self.mechanism.correlated:
      with tf.init_scope():
        self._noise_draws = tf.Variable(0, dtype=tf.int64, trainable=False,
                                        name="dp_noise_draws")
        self._noise_runs_ok = tf.Variable(True, trainable=False, name="dp_noise_runs_ok")
      return
    for i, v in enumerate(self._global_vars):
      self._track(f"_dp_global_state_{i}", v)

  def require_noise_state(self):
    """Refuses a correlated mechanism's step unless its ledger holds exactly the samples its
    in-memory noise state drew: a run restored from a file or handed a ledger would
    otherwise continue the correlated noise from a fresh state or another point of the run,
    which its accounting (one sequence of steps, one noise state) does not cover. Read
    eagerly; the step asserts the same in its graph.

    Raises:
      PrivacyConfigError: ledger samples != draws of the in-memory noise state, or a noise
        state restored from a file of another run (`restore_noise_state`).
    """
    if not self.mechanism.correlated or self._noise_draws is None or self._ledger is None:
      return
    with tf.init_scope():
      samples = int(self._ledger.sample_count.numpy())
      draws = int(self._noise_draws.numpy())
    if samples != draws:
      raise PrivacyConfigError(self._missing_noise_state_message(samples, draws))
    if self._noise_runs_pending is not None:
      self._check_noise_runs(self._noise_runs_pending)
      self._noise_runs_pending = None
      with tf.init_scope():
        self._noise_runs_ok.assign(True)

  def save_noise_state(self, path):
    """`DPOptimizerBase.save_noise_state` (THE FILE IS AS SECRET AS THE TRAINING DATA: it holds
    the noise of the released weights).

    Raises:
      PrivacyConfigError: the mechanism is not correlated or not built yet.
    """
    self._require_built_noise_state("save_noise_state")
    with tf.init_scope():
      arrays = {f"state_{i}": v.numpy() for i, v in enumerate(self._global_vars)}
      arrays["draws"] = np.asarray(self._noise_draws.numpy(), np.int64)
      runs = [] if self._ledger is None else [list(t) for t in self._ledger.run_table()]
    arrays["mechanism"] = np.asarray(repr(self.mechanism))
    arrays["runs"] = np.asarray(json.dumps(runs))
    np.savez(path, **arrays)

  def restore_noise_state(self, path):
    """`DPOptimizerBase.restore_noise_state`; the run table is checked now when the ledger holds
    the state's draws, else at the next step (`require_noise_state`).

    Raises:
      PrivacyConfigError: the mechanism is not correlated or not built, or the file is of
        another mechanism, of other variables' shapes, or of another run.
    """
    self._require_built_noise_state("restore_noise_state")
    with np.load(path, allow_pickle=False) as f:
      arrays = {k: f[k] for k in f.files}
    mechanism = str(arrays.pop("mechanism", ""))
    draws = arrays.pop("draws", None)
    runs = arrays.pop("runs", None)
    shapes = [tuple(v.shape) for v in self._global_vars]
    saved = [arrays.get(f"state_{i}") for i in range(len(self._global_vars))]
    if (mechanism != repr(self.mechanism) or draws is None or runs is None
        or len(arrays) != len(shapes)
        or any(a is None or tuple(a.shape) != sh for a, sh in zip(saved, shapes))):
      raise PrivacyConfigError(validation.message(
          "path", f"a noise state of {self.mechanism!r} on variables of the state shapes "
          f"{shapes} with its run table (written by save_noise_state)", str(path)))
    runs = tuple(tuple(t) for t in json.loads(str(runs)))
    with tf.init_scope():
      ready = (self._ledger is not None
               and int(self._ledger.sample_count.numpy()) == int(draws))
    if ready:
      self._check_noise_runs(runs, str(path))   # before anything is assigned
    with tf.init_scope():
      for v, a in zip(self._global_vars, saved):
        v.assign(tf.constant(a, dtype=v.dtype))
      self._noise_draws.assign(int(draws))
      self._noise_runs_ok.assign(ready or self._ledger is None)
    self._noise_runs_pending = None if ready or self._ledger is None else runs

  def _check_noise_runs(self, runs, path="the restored noise state"):
    """Refuses a noise state whose run table is not the ledger's now: another run's state with
    as many samples would continue this run's correlated noise from that run's."""
    with tf.init_scope():
      held = tuple(tuple(t) for t in self._ledger.run_table())
    if held != runs:
      raise PrivacyConfigError(validation.message(
          "path", f"the noise state of this ledger's run (run table {list(held)}; "
          "save_noise_state writes it with the state): a state of another run, even with "
          "as many samples, does not continue this run's correlated noise. Restore the model "
          "or checkpoint of the run that wrote it, then its noise state, or start a new run "
          f"(the file's run table: {list(runs)})", path))

  def _require_built_noise_state(self, name):
    """Refuses `name` (save/restore_noise_state) without a built correlated noise state."""
    if not self.mechanism.correlated or self._noise_draws is None:
      raise PrivacyConfigError(
          f"{name} applies to a correlated noise mechanism once the optimizer is built "
          "(optimizer.build(model.trainable_variables); model.fit and load_model do it). "
          f"Received: noise={self.noise!r}, "
          f"{'built' if self._noise_draws is not None else 'not built'}")

  def _missing_noise_state_message(self, samples=None, draws=None):
    """The refusal of `require_noise_state` (the counts None: the graph assertion's)."""
    counts = ("other samples than its noise state drew" if samples is None else
              f"{samples} samples but its noise state drew {draws}")
    return (
        f"noise={self.noise!r}: a correlated-noise run cannot resume from a saved model or "
        "checkpoint: its noise state is not saved (it is the noise itself: a file holding "
        "it would release the noise-free weights). This optimizer's ledger holds "
        f"{counts} (a restored model, "
        "load_weights, a tf.train.Checkpoint, BackupAndRestore in a new process, or a "
        "carried, journal or restore_ledger ledger). Start a new model, optimizer and ledger "
        "for a new run, or continue the run in the process that holds its noise state, or "
        "resume it with optimizer.restore_noise_state(path) from a file "
        "optimizer.save_noise_state(path) wrote at the same step (that file is as secret as "
        "the data)")

  # ---- sampling -----------------------------------------------------------------------

  def set_sampling(self, population_size, selection_probability, policy="poisson",
                   sample_size=0, steps_per_pass=None):
    """`DPOptimizerBase.set_sampling`; a correlated mechanism's sampling declared before the
    optimizer is built waits for `build_mechanism`. Returns True when the step must be
    retraced.

    Raises:
      PrivacyConfigError: microbatches under add/remove, a sampling the mechanism is not
        accounted under or the plan does not name, a record unit other than the ledger's
        rows' (`step_sampling.check_unit`), or a bad argument.
    """
    if self._plan.sampling is not None and policy != self._plan.sampling:
      raise PrivacyConfigError(validation.message(
          "policy", f"{self._plan.sampling!r}, the plan's sampling (DPConfig(sampling=...); "
          f"e.g. model.fit(..., sampling={self._plan.sampling!r}))", policy))
    step_sampling.check(self, population_size, policy, sample_size, steps_per_pass)
    step_sampling.check_unit(self, policy)
    self.sampling_source = "user"   # fit overrides it (mark_sampling_from_fit)
    if self.mechanism.needs_variables and not self.optimizer.built:
      self._pending_sampling = (population_size, selection_probability, policy, sample_size)
      changed = True
    else:
      changed = step_sampling.declare(self, population_size, selection_probability, policy,
                                      sample_size)
    self._declared(changed)
    return changed

  def _declared(self, changed):
    """Moves the declarations' epoch on when `changed` (a retrace is needed) and writes the
    epoch a traced user step may run under: the current one, or -1 once fit declared."""
    if changed:
      self._sampling_epoch += 1
    with tf.init_scope():
      if self._user_epoch is None:   # untracked: no file carries or restores it
        self._user_epoch = tf.Variable(-1, dtype=tf.int64, trainable=False,
                                       name="dp_user_sampling_epoch")
      self._user_epoch.assign(self._sampling_epoch if self.sampling_source == "user" else -1)

  def adopt_sampling(self, sampling, expected_records):
    """Makes `sampling` (a ledger.LedgerSampling on this step's ledger) the declared sampling, the
    query's global state variables (once) and the public expected batch size (a Python float).
    Call under tf.init_scope, after make_state."""
    self.sampling = sampling
    self.expected_size_denominator = ledger_policies.get(
        sampling.policy).expected_size_denominator
    if self._global_vars is None:
      self._make_global_state(self.base_query.initial_global_state())
    self._expected_records.assign(expected_records)

  @property
  def query(self):
    """`base_query` in a ledger.QueryWithLedger sharing `sampling` (cached); None while
    undeclared."""
    if self.sampling is None:
      return None
    wrapped = self._wrapped
    if wrapped is None or wrapped[0] is not self.base_query or wrapped[1] is not self.sampling:
      wrapped = (self.base_query, self.sampling,
                 ledger_lib.QueryWithLedger.sharing(self.base_query, self.sampling))
      self._wrapped = wrapped
    return wrapped[2]

  def adopt_record_microbatches(self, num_microbatches):
    """Sets how the train step cuts a batch into records (M, or None: one example per record);
    True when the cut changed (the step must be retraced)."""
    changed = self.record_microbatches != num_microbatches
    self.record_microbatches = num_microbatches
    return changed

  def mark_sampling_from_fit(self):
    """Records that DPModel.fit, not the user, declared the current sampling; a user step
    traced before then fails when it runs (`require_user_sampling`)."""
    self.sampling_source = "fit"
    self._declared(False)

  def pending_query(self):
    """A placeholder raising on use while a declared sampling waits for the build, else None."""
    return None if self._pending_sampling is None else noise_mechanisms.Unbuilt(self.noise)

  def require_user_sampling(self, what):
    """Refuses a step whose batch the user gives (`train_on_batch`, a custom loop) unless the
    user declared how it is sampled (`set_sampling`): fit's declaration describes fit's own
    batches, not the batch given. Checked when called; a traced step also asserts at run
    time that its declaration is still current (`user_sampling_check`), since fit
    re-declares on the same LedgerSampling, whose n and q the traced step reads.

    Args:
      what: names the caller in the message.

    Raises:
      PrivacyConfigError: the sampling was declared by fit, or not at all.
    """
    declared = self.sampling is not None or self._pending_sampling is not None
    if declared and self.sampling_source == "user":
      if not tf.executing_eagerly():
        self._traced_user_epochs[tf.compat.v1.get_default_graph()] = self._sampling_epoch
      return
    if not declared:
      self.require_sampling()   # its message: the sampling policy is unknown
    raise PrivacyConfigError(
        f"{what} takes the sampling you declared with optimizer.set_sampling("
        "population_size, selection_probability, policy, sample_size): the current one was "
        "declared by model.fit for the batches its own sampler drew, not for the batch "
        "given here. Call set_sampling with how you sample these batches (or train with "
        f"model.fit). Received: sampling declared by {self.sampling_source!r}")

  def user_sampling_check(self):
    """The run-time Assert op of a traced user step that its user declaration is still current;
    None eagerly or when the graph has no user step."""
    if tf.executing_eagerly():
      return None
    epoch = self._traced_user_epochs.get(tf.compat.v1.get_default_graph())
    if epoch is None:
      return None
    with tf.init_scope():
      if self._user_epoch is None:   # a declaration that failed half-way: refused at run time
        self._declared(False)
    current = self._user_epoch.read_value()
    return tf.debugging.Assert(tf.equal(current, epoch), [
        "compute_private_gradients: the sampling was declared again since this step was "
        "traced (by model.fit for its own batches, or by a set_sampling that changed the "
        "policy, the record cut or the batch size bound): this step's batch would be charged "
        "under it, not under the sampling you declared. Call optimizer.set_sampling("
        "population_size, selection_probability, policy, sample_size) with how you sample "
        "these batches, and trace the step again (a new tf.function). Received: "
        "declaration epoch", current, "traced under", epoch, "(-1: declared by fit)"])

  def require_sampling(self):
    """The ledger.LedgerSampling of the declared sampling (the step records with it).

    Raises:
      PrivacyConfigError: the sampling is undeclared, or declared but the correlated
        mechanism is not built yet.
    """
    if self._pending_sampling is not None:
      raise PrivacyConfigError(
          f"noise={self.noise!r}: the sampling is declared but the mechanism is not built "
          "yet (it needs the trainable variables' shapes): call optimizer.build(model."
          "trainable_variables) before a custom loop or train_on_batch (model.fit does it)")
    if self.sampling is None:
      raise PrivacyConfigError(
          "the sampling policy is unknown, so the ledger cannot record this step: train with "
          "model.fit on arrays or on dp.data.poisson_batches/shuffled_batches, or call "
          "optimizer.set_sampling(population_size, selection_probability, policy, "
          "sample_size) first")
    return self.sampling

  def require_query(self):
    """`query` (the QueryWithLedger), for code that drives the query itself.

    Raises:
      PrivacyConfigError: as `require_sampling`.
    """
    self.require_sampling()
    return self.query

  # ---- the correlated mechanism -------------------------------------------------------

  def build_mechanism(self, variables):
    """Makes a correlated mechanism's query on `variables`; its global state (the noise) becomes
    variables no file saves. The generator's state is saved only with a `seed` (tests), so no
    resumed run draws a released noise again. Applies a pending sampling."""
    if not self.mechanism.needs_variables or self.custom_query:
      return
    self.make_state()
    query, init, state_vars = noise_mechanisms.make_query_with_state(
        self.mechanism, self.l2_norm_clip, self.noise_multiplier, variables, seed=self.seed)
    # a seeded (test) generator's state is saved: its seed is public anyway
    seeded = [query.noise_generator.state] if self.seed is not None else []
    for v in seeded:
      self.optimizer._track_variable(v)  # pylint: disable=protected-access
    self.base_query = query
    self._set_global_state(init, state_vars)
    if self._pending_sampling is not None:
      pending, self._pending_sampling = self._pending_sampling, None
      source = self.sampling_source
      step_sampling.declare(self, *pending)
      self.sampling_source = source
      self._declared(True)

  def prepare_mechanism(self, variables):
    """Builds the optimizer on `variables` now when a correlated mechanism waits for their
    shapes; else a no-op."""
    if self.mechanism.needs_variables and not self.optimizer.built:
      self.optimizer.build(list(variables))

  # ---- sample params ------------------------------------------------------------------

  def sample_params(self):
    """The query's sample params (`DPQuery.derive_sample_params`), read from its global state
    once per step.

    Raises:
      PrivacyConfigError: the sampling is not declared.
    """
    self.require_sampling()
    return self.base_query.derive_sample_params(self.global_state())

  # ---- clipping ---------------------------------------------------------------------

  def resolve_clipping(self, model=None, input_specs=None, checked_by_the_step=False,
                       probe=True):
    """'vectorized' or 'fast': which per-example clipping this step uses for `model`.

    "auto" takes the fast (ghost-norm) path only when `routing.fast_path_obstacle` finds
    nothing in the way; else the vectorized path, exact for any model. Kept per `_route_key`.

    Args:
      model: the keras.Model the step trains.
      input_specs: optional nest of tensors/specs shaped like a batch (for the probe).
      checked_by_the_step: True from the Keras train step (its fast pass checks the
        unrecorded variable uses).
      probe: False: no probe here, and "fast" is not kept until `route_probed`.

    Returns:
      "vectorized" or "fast".

    Raises:
      PrivacyConfigError: clipping="fast" and the fast path cannot clip this model exactly.
    """
    clipping = self.flags.clipping
    if clipping == "vectorized":
      return "vectorized"
    key = self._route_key(model, input_specs)
    cached = self._route
    if key is not None and cached is not None and cached[0] == key:
      return cached[1]
    reason = routing.fast_path_obstacle(self, model, fast_clipping, input_specs,
                                        checked_by_the_step, probe)
    return self._routed(key, reason, keep=probe or reason is not None)

  def route_probed(self, model, input_specs):
    """The path of a traced step that called `resolve_clipping(probe=False)`, once its fast pass
    checked the call: "fast" when the batch-independence probe sees no mixing, else
    "vectorized" under clipping="auto"; kept as the route.

    Raises:
      PrivacyConfigError: clipping="fast" and the probe sees mixing.
    """
    reason = routing.mixing_obstacle(self, model, input_specs)
    return self._routed(self._route_key(model, input_specs), reason)

  def _routed(self, key, reason, keep=True):
    """The path for the obstacle `reason` (None: "fast"), kept under `key` when `keep`;
    clipping="fast" refuses an obstacle."""
    if reason is not None and self.flags.clipping == "fast":
      raise routing.fast_refusal(reason)
    path = "fast" if reason is None else "vectorized"
    if keep:
      self._route = None if key is None else (key, path)
    return path

  def route_unrecorded(self, model, input_specs, uses):
    """"vectorized", kept as the path of a traced step whose fast clipped sum found `uses`
    (variables read outside their layer's recorded calls; routing.route_unrecorded).

    Raises:
      PrivacyConfigError: clipping="fast".
    """
    path = routing.route_unrecorded(self, fast_clipping, uses)
    key = self._route_key(model, input_specs)
    self._route = None if key is None else (key, path)
    return path

  def _route_key(self, model, input_specs):
    """What `resolve_clipping`'s answer follows from (compared by identity), or None."""
    train_function = getattr(model, "train_function", None)
    if model is None or train_function is None:
      return None
    shapes = tuple(tuple(getattr(t, "shape", ())) for t in tf.nest.flatten(input_specs))
    return (model, train_function, shapes, self.flags, self.base_query, model.compute_dtype,
            tuple(id(v) for v in model.trainable_variables), len(model.losses),
            getattr(model, "_functional", None))

  def clipped_sum(self, record_loss_fn, variables, records, record_mask, examples_per_record=1,
                  vectorize=True, loss_scale=1.0, params=None, sum_scale=None, xla=None):
    """Sample state (clipped sum) over records, vectorized, in physical chunks.

    Per-record gradients are cast to float32 (float64 for float64 variables); with loss_scale
    s != 1 they are divided by s and a record that overflowed adds zero.

    Args:
      record_loss_fn: record -> (scalar loss, aux nest).
      variables: the trainable variables.
      records: nest of [M, ...] tensors.
      record_mask: [M], 0 for padding records.
      examples_per_record: k (int, or a scalar tensor).
      vectorize: False for a sequential loop over records (routing.use_vectorized_map).
      loss_scale: the static loss scale s.
      params: the query's sample params (None: `sample_params()`).
      sum_scale: None, or `sum_scale(num_records)`: each clipped gradient is added times it
        (pass `scaled=True` to `noised_average`).
      xla: whether this is traced for XLA, when the caller decided it (None: asks the graph,
        `routing.in_xla_context`); it chooses the chunk layout (`chunking.chunk_layout`).

    Each clipped gradient is also added times `summation.public_shrink` of the sum's plan
    (under add/remove the plan of `chunking.public_row_bound` rows, independent of the rows
    present), so the float32 sum moves by at most the ledger's S for one record.

    Returns:
      (sample_state, sum of record losses over real records, aux stacked [M, ...], or None
      with a dynamic number of chunks).

    Raises:
      PrivacyConfigError: the sampling is not declared.
    """
    if params is None:
      params = self.sample_params()   # raises while the sampling is undeclared
    query = self.base_query         # the step's own query
    loss_scale = float(loss_scale)
    variables = list(variables)

    record_mask = tf.cast(record_mask, tf.float32)
    m_static = tf.TensorShape(record_mask.shape)[0]
    if xla is None:
      xla = routing.in_xla_context()
    per_chunk = chunking.chunk_layout(self, examples_per_record, m_static, xla=xla)
    # a vectorized pass draws once a chunk
    if per_chunk is not None and self.draws_keyed:
      self.refuse_grouped_draws(per_chunk,
                                ["the vectorized per-record pass"] if vectorize else [])
    with chunking.public_rows(self, examples_per_record, xla=xla):   # add/remove: public plan
      scale = summation.public_shrink(chunking.batch_rows(record_mask),
                                      *chunking.sum_plan(per_chunk, record_mask))
    if sum_scale is not None:
      scale = scale * sum_scale

    def chunk_fn(state, rec, mask):
      grads, losses, aux = grads_lib.per_record_gradients(record_loss_fn, variables, rec,
                                                          vectorize)
      grads, finite = chunking.unscale_records(grads, loss_scale)
      with tf.control_dependencies(self.count_overflowed(finite, mask)):
        weights = mask * scale
        state = query.accumulate_records(params, state, grads, mask=weights)
      # an unreduced loss's logged value is the record's mean, as Keras reduces it
      rec_losses = tf.reduce_mean(tf.reshape(losses, [tf.shape(mask)[0], -1]), axis=1)
      return state, tf.reduce_sum(rec_losses / loss_scale * tf.cast(mask, rec_losses.dtype)), aux

    state = query.initial_sample_state(chunking.wide_template(variables))
    state, loss_sum, aux = chunking.sum_over_chunks(chunk_fn, state, records, record_mask,
                                                    per_chunk)
    if aux is not None and per_chunk is not None:
      aux = tf.nest.map_structure(lambda t: t[:m_static], aux)
    return state, loss_sum, aux

  # ---- noise drawn inside the compiled program --------------------------------------

  @property
  def compiles_noise(self):
    """True when the noise is drawn inside the XLA program of a `jit_compile=True` step.

    Only the default Gaussian query (no custom dp_query, correlated mechanism or secure_mode),
    by default on an accelerator only (slower on CPU: benchmarks/xla_step_breakdown.py);
    `set_flags(compiled_noise=...)` forces it. The query's own generator draws either way.
    """
    if (not isinstance(self.mechanism, noise_mechanisms.IID) or self.custom_query
        or self.secure_mode):
      return False
    if self.noise_in_compiled_program is not None:
      return bool(self.noise_in_compiled_program)
    return bool(tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))

  @tf.autograph.experimental.do_not_convert   # plain Python: no AutoGraph conversion
  def compiled_noised_average(self, sample_state, num_records, global_state, scaled=False):
    """Noised sum / denominator inside the compiled program; the caller records the events
    with `record_compiled_sample` right after the program.

    Args:
      sample_state: the clipped sum (times `sum_scale(num_records)` when `scaled`).
      num_records: records in the batch.
      global_state: the query's global state, read outside the program (`global_state()`).
      scaled: the sum was formed already divided (`folds_denominator`).

    Returns:
      (the list of noised average gradients, the events of the noised result).
    """
    self.require_sampling()
    num_records = tf.cast(num_records, tf.float32)
    if scaled:
      result, _, events = self.base_query.get_scaled_noised_result(
          sample_state, global_state, self.sum_scale(num_records))
      return list(tf.nest.flatten(result)), events
    result, _, events = self.base_query.get_noised_result(sample_state, global_state)
    denom = self.denominator(num_records)
    return [tf.cast(r / tf.cast(denom, r.dtype), r.dtype) for r in tf.nest.flatten(result)], events

  def global_state(self):
    """The query's global state, read from its variables (inside a step)."""
    return tf.nest.pack_sequence_as(self._global_struct,
                                    [v.read_value() for v in self._global_vars])

  def record_compiled_sample(self, grads, events):
    """Records the sample of a draw made in the compiled program (`events`, as
    `compiled_noised_average` returned them); returns `grads` after the ledger write."""
    count = self.require_sampling().record(events, after=grads)   # waits for the batch
    with tf.control_dependencies([count]):
      count = self._noised_results.assign_add(1)   # `charged_gradients`' count
    with tf.control_dependencies([count]):
      return [tf.identity(g) for g in grads]

  # ---- noise and ledger -------------------------------------------------------------

  def _noise_and_record(self, sample_state, scale=None):
    """One noise draw (scaled by `scale` if given) and one ledger sample of its events. A
    correlated mechanism fails the step when the ledger holds more samples than the
    iterations (a rolled-back run) or than its noise state drew (`require_noise_state`)."""
    sampling = self.require_sampling()
    checks = []
    if self.mechanism.correlated:
      self.require_noise_state()   # eager, when traced or run eagerly
      checks.append(tf.debugging.assert_equal(
          self._ledger.sample_count, self._noise_draws,
          message=self._missing_noise_state_message()))
      checks.append(tf.debugging.assert_equal(
          self._noise_runs_ok, True,
          message=f"noise={self.noise!r}: a noise state restored by restore_noise_state "
                  "before the ledger held its samples is checked against the ledger's run "
                  "table when the step is traced or run eagerly; this traced step cannot. "
                  "Restore the model or checkpoint first, then the noise state"))
      checks.append(tf.debugging.assert_less_equal(
          self._ledger.sample_count, tf.cast(self.optimizer.iterations, tf.int64),
          message=f"noise={self.noise!r}: the optimizer's iterations went back below the "
                  "steps already released and charged (ledger sample_count): a correlated-"
                  "noise mechanism cannot continue a rolled-back run (checkpoint restore, "
                  "load_weights, iterations.assign or a retry with BackupAndRestore), since "
                  "its accounting covers one sequence of steps. Start a new optimizer, and "
                  "a new ledger, for a new run."))
    # a correlated draw waits for the clipped sum: a batch that never came leaves its state
    # unmoved (independent noise drawn early and discarded is never released)
    waits = ([t for t in tf.nest.flatten(sample_state) if isinstance(t, tf.Tensor)]
             if self.mechanism.correlated else [])
    with tf.control_dependencies(checks + waits):
      if scale is None:
        result, new_state, events = self.base_query.get_noised_result(
            sample_state, self.global_state())
      else:
        result, new_state, events = self.base_query.get_scaled_noised_result(
            sample_state, self.global_state(), scale)
    count = sampling.record(events, after=sample_state)   # runs iff the sum was formed
    with tf.control_dependencies([count]):
      count = self._noised_results.assign_add(1)
    assigns = [v.assign(t) for v, t in zip(self._global_vars, tf.nest.flatten(new_state))]
    if self._noise_draws is not None:   # with the state's writes: no batch, no draw counted
      with tf.control_dependencies(assigns):
        assigns.append(self._noise_draws.assign_add(1))
    with tf.control_dependencies(assigns + [count]):
      return tf.nest.map_structure(tf.identity, result)

  def denominator(self, num_records):
    """The public denominator: 1 when not normalized, the declared expected batch size under
    an add/remove policy (the realized size is not protected), else max(num_records, 1) with
    num_records the records the rows form whatever their weights (a record's weight is
    private: a count of positive weights would show it in the noise's scale).

    Args:
      num_records: the records the batch's rows form (float32 scalar).

    Returns:
      a float32 scalar tensor.
    """
    if not self.normalize:
      return tf.constant(1.0)
    self.require_sampling()
    if self.expected_size_denominator:
      return self._expected_records.read_value()
    return tf.maximum(num_records, 1.0)

  @property
  def folds_denominator(self):
    """True when the step forms the clipped sum already divided by the denominator d.

    (sum + N(0, sigma^2 I)) / d = a sum + N(0, (a sigma)^2 I) with a = 1 / d (`sum_scale`),
    saving a division pass. Taken when normalized, the query adds scaled noise and one
    replica trains. The ledger records (S, sigma) either way.
    """
    return bool(self.normalize and self._facts_of_query()[2]
                and tf.distribute.get_strategy().num_replicas_in_sync == 1)

  def sum_scale(self, num_records):
    """a = 1 / `denominator(num_records)` (a float32 scalar), public as d is."""
    return 1.0 / self.denominator(tf.cast(num_records, tf.float32))

  @tf.autograph.experimental.do_not_convert   # plain Python: no AutoGraph conversion
  def noised_average(self, sample_state, num_records, scaled=False):
    """Noised sum / denominator: one noise draw and one ledger sample per logical batch.

    Under a tf.distribute strategy the replicas' sums and counts are all-reduced and the noise
    drawn once in cross-replica context; the result is pre-divided by the replica count (Keras
    sums gradients over replicas in apply()).

    Args:
      sample_state: this replica's clipped sum (times `sum_scale(num_records)` if `scaled`).
      num_records: records in this replica's batch.
      scaled: the sum was formed already divided (`folds_denominator`): noise of stddev
        sigma / d, no division.

    Returns:
      the list of noised average gradients (flattened result).

    Raises:
      PrivacyConfigError: the sampling is undeclared, `scaled` under several replicas, or
        several workers whose noise generators were not synchronized.
    """
    self.require_sampling()
    self._require_one_noise()
    check = self.user_sampling_check() if self._traced_user_epochs else None
    if check is not None:
      with tf.control_dependencies([check]):
        sample_state = tf.nest.map_structure(tf.identity, sample_state)
    num_records = tf.cast(num_records, tf.float32)
    ctx = tf.distribute.get_replica_context()
    n_rep = tf.distribute.get_strategy().num_replicas_in_sync
    if scaled:
      if n_rep != 1:
        raise PrivacyConfigError(validation.message(
            "scaled", "False under more than one replica (the denominator follows from the "
            "all-reduced record count: form the plain sum)", scaled))
      result = self._noise_and_record(sample_state, self.sum_scale(num_records))
      gate_sums_on_noise(sample_state, result)
      result = list(tf.nest.flatten(result))
      if not getattr(self.optimizer, "_dp_own_step", False):
        result = self._noised.add(result)   # a custom loop's: its update is bound to it
      return result
    if ctx is None or n_rep == 1:
      result = self._noise_and_record(sample_state)
      gate_sums_on_noise(sample_state, result)
    else:   # the replicas' sums and counts all-reduced, one draw in cross-replica context
      sample_state = ctx.all_reduce(tf.distribute.ReduceOp.SUM, sample_state)
      num_records = ctx.all_reduce(tf.distribute.ReduceOp.SUM, num_records)

      def merge_fn(strategy, state):
        local = tf.nest.map_structure(lambda t: strategy.experimental_local_results(t)[0],
                                      state)
        return self._noise_and_record(local)

      result = ctx.merge_call(merge_fn, args=(sample_state,))
    denom = self.denominator(num_records) * float(n_rep)
    result = [tf.cast(r / tf.cast(denom, r.dtype), r.dtype) for r in tf.nest.flatten(result)]
    if not getattr(self.optimizer, "_dp_own_step", False):   # bound: update_binding
      result = self._noised.add(result)
    return result

  @tf.autograph.experimental.do_not_convert   # plain Python over the graph
  def note_traced_update(self, variables):
    """A custom loop's update of `variables` traced now: its whole step is walked at the next
    statement (update_binding.NoisedResults.refuse_late_writes)."""
    self._noised.note_traced_update(list(variables) + list(self.optimizer.variables))

  def refuse_late_writes(self, what, also=()):
    """Refuses the run when a traced custom-loop step wrote an updated variable, one of the
    optimizer's or one of `also` from the batch anywhere in the step (`what` names it in the
    message; update_binding.NoisedResults.refuse_late_writes).

    Raises:
      PrivacyConfigError: such a write.
    """
    self._noised.refuse_late_writes(what, also)

  def require_bound_update(self, grads, what="apply_private_gradients", variables=()):
    """Refuses gradients that are not a noised result this step returned or (traced) a function of
    one, of the updated `variables`, of the optimizer's own variables and of scalar constants
    (update_binding.NoisedResults.require_bound; `what` names the caller).

    Raises:
      PrivacyConfigError: a gradient not bound to a noised result.
    """
    self._noised.require_bound(grads, what,
                               list(variables) + list(self.optimizer.variables))


# ---- per-variable pipelining of the step: sum -> noise -> divide -> apply ---------------
#
# Bu et al., "Differentially private optimization on large model at small cost" (book-keeping,
# Section 3): the DP step should hold no more than the non-private step. In a traced step all
# clipped sums become ready together (each needs the clip factors) and TF runs every ready op,
# so all weight-sized sums (418 MiB for BERT-base) existed before the noise chain reached them.
# `gate_sums_on_noise` adds a control edge from noised leaf j to the op forming sum j + 1: the
# same ops and noise draws in the same order, only an execution order added, and only where the
# edge cannot close a cycle (the producer is not an ancestor of the earlier noised leaves).

# Ops that pass a buffer on (SplitV: a [W; b] product is gated at the product).
_FORWARDING_OPS = frozenset(["Identity", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
                             "EnsureShape", "SplitV"])


def _producer(tensor):
  """The op that allocates `tensor`'s buffer: its op, or, through buffer-forwarding ops (their
  data input is the first), the first op that is not one."""
  op = tensor.op
  while op.type in _FORWARDING_OPS and op.inputs:
    op = op.inputs[0].op
  return op


def _add_ancestors(ops, seen):
  """Adds to `seen` every op that `ops` depend on (data or control), them included."""
  stack = [op for op in ops if op not in seen]
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    stack.extend(t.op for t in op.inputs if t.op not in seen)
    stack.extend(c for c in op.control_inputs if c not in seen)


def gate_sums_on_noise(sums, noised):
  """Makes the sum of leaf j + 1 wait for the noised leaf j, leaves in `tf.nest.flatten`
  order (the Gaussian query's draw order); a traced graph only (comment above).

  Args:
    sums: the clipped sums (the query's sample state, a nest of tensors).
    noised: the noised result of the same structure.

  Returns:
    the number of control edges added (0 in eager mode, for differing structures, or when
    every edge could close a cycle).
  """
  sums = tf.nest.flatten(sums)
  noised = tf.nest.flatten(noised)
  if (tf.executing_eagerly() or len(sums) != len(noised) or len(sums) < 2
      or not all(tf.is_tensor(t) and hasattr(t, "op") for t in sums + noised)):
    return 0
  graph = noised[0].graph
  seen = set()   # ancestors of the noised leaves so far (the edges added included)
  added = 0
  for j in range(len(sums) - 1):
    _add_ancestors([noised[j].op], seen)
    producer = _producer(sums[j + 1])
    if (producer.graph is not graph or noised[j].op.graph is not graph or producer in seen
        or producer.type == "Placeholder"):
      continue
    producer._add_control_input(noised[j].op)  # pylint: disable=protected-access
    added += 1
  return added
