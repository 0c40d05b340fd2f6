"""Fingerprints of a DP model's weights: a change made outside the DP optimizer is refused.

Rule: the ledger's epsilon holds for weights that are a function of the noised steps it
charges (McMahan et al., "A General Approach to Adding Differential Privacy to Iterative
Training Procedures", Section 6; post-processing, Dwork and Roth, "The Algorithmic
Foundations of Differential Privacy", Proposition 2.1). A plain Keras optimizer updating a
layer the DP model shares (another model fit on the records), `set_weights` / `assign` of
other values, or a weights file without a ledger give weights no private step produced, and
the ledger would still state its epsilon for them. So a digest of each trainable variable is
recorded whenever its value is one the DP run released or accepted: at the start of a DP fit
or `train_on_batch`, before the user's callbacks run a hook in a fit (the private steps'
output) and at the end of the fit (after EarlyStopping(restore_best_weights=True) and weight
averaging: earlier iterates, functions of the noised steps), after an eager private step of
a custom loop, and after `load_weights` of a file that carries the ledger. The next DP fit,
`train_on_batch`, eager private step, the privacy statement and a save of the ledger refuse
weights whose digest is none of the ones recorded on them (`check`): any recorded state (an
earlier iterate, the initial weights) may be put back.

Inside a DP fit the user's callbacks are sandwiched (models.py, `_FitFingerprints`): the
weights the private steps left are recorded before the callbacks that implement a hook run,
and checked after them, so a callback's write (a plain fit of a shared layer at an epoch's
end) is refused there; a fit that a callback aborts records nothing more.

Every variable with digests recorded is checked (`checked_variables`), trainable or not now:
a DP-trained layer changed outside and then frozen is refused as well. The DP optimizer's
floating slots (SGD's momentums, Adam's moments: `optimizer_state`) are recorded and checked
with the weights it updates (Keras' update reads them: a slot written from the batch's plain
gradient would reach the weights un-noised), in every record, check, `hold` and traced
update; not `iterations` (moved by every update) nor the learning rate (a public schedule
may set it; update_binding refuses a write of it from the data in the traced step). A
recorded variable that no traced update wrote is compared with its records even when its
optimizer's traced steps updated others.

Private updates are counted by the DP optimizer's private step (its count of noised results
used by updates, kept out of every checkpoint: no restore moves it). A count that moved since
the optimizer's last record means private updates the host did not see: a custom loop's
`apply_private_gradients` traced in a tf.function. Such an update records itself in the graph
(`traced_update`): before the update it reads the digest h (below) of each variable it updates,
after it writes the digest of the values it left into the variable's in-graph record
(`_InGraph`: the host's recorded digests, a ring of the last TRACED_KEPT digests traced updates
left, the private-update count, and the count of the first traced update that started from
values in neither, i.e. a change made between traced steps). That record is made outside the
trace (eagerly, when a step is traced) and held by this module only, in no checkpoint: no
restore can set it. Static shapes, no host round trip, the same h bit for bit (64-bit
wrapping integer arithmetic, the same multipliers), XLA-compiled. A check that finds
the count moved compares each variable's digest with that record: a recorded state passes (a
traced step that starts from one starts the run again from it), a state a traced update left
passes unless a traced update of that variable started from values no private step produced,
anything else is refused (set_weights after a traced step, or between traced steps). Under a
tf.distribute strategy (`strategy.run` of the step) each replica digests its own copies of the
variables before and after the update, and the record is written once per update, in
cross-replica context (`merge_call`): a start is a state of the run only if every replica's
copy held one (a write to one replica's copy is refused after the next step), and the digests
of the primary copies, which the host's checks read, are written. A tf.train.Checkpoint restore or `iterations.assign` moves no such count: the
check stays on, and a restored state the run recorded (an earlier iterate) passes, as does,
after traced steps, one of the last TRACED_KEPT traced states. A loop of any number of
traced steps with no check in between is stated (its weights are the last traced state); a
traced state older than the last TRACED_KEPT that no check saw, put back (a
tf.train.Checkpoint saved more than TRACED_KEPT traced steps before its restore), is refused,
and the refusal names the fix: a check when such a checkpoint is saved (the privacy
statement, or a DP model's save_weights) records its state among the recorded ones.

Copies by value carry the charge: each state a run's private updates produced keeps its digest
with a weak reference to the run's ledger and its run table then (`_RELEASED`), and a variable
a DP run starts from (its first record, or a custom loop's first claim: `adopt_released`) that
holds such values adopts that ledger as it was then (`ledger.run_ids.earlier`: the steps the
source run took after the copy did not touch it) (`set_weights(dp_model.get_weights())`,
`clone_model` + `set_weights` into a new DP model or custom loop; review R17: 1 of 5 released
steps was charged). The states a custom loop's traced private updates left are found in their
in-graph rings (`_InGraph`: the last TRACED_KEPT), with the run's whole ledger at the copy's
start (the step that left them is not kept: the safe side), and registered as released at the
next check that reads them (review R21: a copy of a traced loop's weights charged 1 of 5
steps). The values a DP model loads from a file that carries a ledger (`keras.models.
load_model`, `load_weights`, also in another process) are registered as released by the
ledger that adopted the file's (`note_loaded`; review R21: its backbone copied into a new
model charged 1 of 5 steps). Neither registers a state recorded on the variable (its start:
public values, zero biases alike in every model; a traced update at learning rate 0 leaves
it in the ring; a frozen layer a load writes again): review R24 measured an unrelated run
adopting another's ledger by a zero bias, 4 samples for 1 and 6 for 1. A run whose
ledger is gone (its optimizer deleted) is no longer found, nor a copy made in another process,
nor a run with a seeded noise or noise_multiplier = 0 (two runs of one recipe make the same
values: a digest would name both), nor values changed on the way by arithmetic other than a
cast or a permutation (below), nor a state
a DP fit left at a user callback's train-batch hook read other than by the model's
`get_weights` (held there, not digested: the fit's records, the states its epoch hooks and end
leave and the values a DP model's `get_weights` hands out are registered; `layer.get_weights()`
or a variable's `numpy()` there is not) (review R21, strict xfail in
tests/keras/test_keras_review_r21.py), nor a cast or permuted copy of a state a custom loop's
traced steps left that no host check has read yet (the rings hold exact digests only).

Copies in another layout or dtype: h names the bits in their order, so a copy transposed (tied
weights), or cast by set_weights into a float16, bfloat16 or float64 layer (or cast and back)
names no state (review R28: 1 sample charged for 4 each). So each released state of floating
values is also kept under two order- and dtype-invariant keys (`_RELEASED_KEYS`,
`_digests_and_keys`), looked up only when the exact digest of a run's start names no run.
For N values read as float32 (a float64 one rounded to float32: exact for a copy of a float32
state; a float16 or bfloat16 one exactly), c_i the bits of value i rounded to bfloat16 (round
to nearest, ties to even, on its float32 bit pattern u: (u + 0x7FFF + bit 16 of u) >> 16), a
key is (N, s) with
  s = sum_i F(c_i)  (mod 2^64),
F a fixed 32-bit mixing function (multiply by an odd constant, xor-shift, multiply,
xor-shift): a sum, so the order does not enter, of a function of the rounding, so of the
value in any dtype at least as precise as bfloat16. A float16 copy is rounded twice (to
float16's 10 fraction bits, then to bfloat16's 7), which differs from one rounding where the
float16 value falls on a bfloat16 tie: 6.2% of the elements of N(0, 0.05) or N(0, 1) values.
So a state is kept under two keys, that of its bfloat16 rounding and that of its
float16-then-bfloat16 rounding (IEEE float16: its subnormals, overflow to infinity), and a
start is looked up under its first (a float16 copy's first is its source's second; a
bfloat16, float64 or permuted copy's is its source's first). Not registered: a key whose
elements all round to one value (s = N F(c_1): zero biases, ones, alike in unrelated models),
nor a key of the values the variable started from (`_Record.public_keys`: a run whose weights
barely moved, every rounding still its start's, made every model of its seed adopt it: 4
samples for 1 measured without this rule). Unrelated states share a key with probability
about 2^-32 (F's outputs are 32 bits; the sum of N of them spreads over more), but a state and
any permutation of it share one by design: two unrelated states of few distinct values with
one multiset of roundings (two 0/1 masks of one count) name each other. The sums are
exact integer arithmetic (on the host uint64 sums; compiled, each row's sum of at most
ROW_VALUES values below 2^32 as a float64 matrix-vector product, exact below 2^53, then the
rows' as int64), so the host and a compiled program give one key for one N. Cost: the keys
are computed only where a state may be registered (a record of a run whose values name it,
`register_read`, a load, a traced state a check registers) or a run's first record (its
lookup and start keys), in the pass that computes h: on the host for the small values, all
in one batch, and in the program that computes h for the large ones (`_fused_digest_keys`).
Measured (benchmarks/fingerprint_registration_cost.py: a DP MLP Input(784) -> Dense(512) ->
Dense(10), 407,050 weights, batch 32, 2-core host): in one process, blocks of 20 calls with
and without the keys alternated over 10 rounds (three runs, load 1.0-1.7), a registration (a
record after a private step) 1.91-1.95 -> 2.20-2.25 ms (+0.29 to +0.32), train_on_batch
7.48-7.74 -> 7.88-8.13 ms (+0.39 to +0.40, +5.1 to +5.4%); the library before and after in
processes alternated over 8 rounds (load 1.5-2.2; between processes train_on_batch varies
more): a registration 1.85 -> 2.22 ms, the DP model's get_weights after a private step 2.20
-> 2.61 ms, a run's first record 1.09 -> 1.37 ms; a fit's steps are not affected (it records
at its hooks and end).
BERT-base's shapes, CPU ms of h alone against h and the keys (one process, load 2.8): word
embeddings [30522, 768] 14.0 -> 52.9, [768, 3072] 1.3 -> 3.6, [3072, 768] 1.3 -> 3.3,
[768, 768] 0.9 -> 1.5: about 90 -> 210 ms a registration of all its weights (a LoRA model's
frozen backbone is not digested again: its kept buffers).

The digest of a variable whose values, as unsigned integers of their bit patterns (a 64-bit
value as its two 32-bit words), form the matrix X [R, C] (read in memory order, C the largest
divisor of the N words at most ROW_VALUES, so a function of N alone: a reshape keeps h; a
scalar is [1, 1]) is
  h(X) = sum_i a_i sum_j b_j X_ij  (mod 2^64),
with fixed pseudorandom odd multipliers a [R], b [C] (uint64, wrapping arithmetic: exact, so
the same on every device and in every summation order). A change of one value always changes
h (an odd multiplier times a nonzero difference below 2^32: no bit of it is lost mod 2^64);
other changes not made to collide leave h unchanged with probability about 2^-33 or less (a
change of bit 31 of many words, a float32 sign flip, enters as 2^31 times their multipliers'
signed sum, 0 mod 2^64 with probability 2^-33). It detects accidents, not a
deliberate collision.

Cost: a variable of at most HOST_ELEMENTS real values is digested on the host (NumPy's
uint64 arithmetic wraps mod 2^64: the same h, no dispatch, no program to compile); a larger
one by one compiled program per distinct [R, C], cached across models (`_fused_digest`): so
per distinct N where ROW_VALUES divides it (BERT-base: 4 programs, not 6: its query, key and
value kernels [768, 12, 64] share the [768, 768] ones', its intermediate kernels [768, 3072]
the output ones' [3072, 768]; each compiles in about 0.1 CPU s). And a
variable's digest is not computed again while the buffer it was computed from is still the
variable's: a record keeps the tensor it read (a read of a resource variable shares the
variable's buffer), and TensorFlow writes a variable whose buffer another tensor holds into a
new buffer (copy-on-write: assign, the dense updates and the training kernels copy a buffer
not solely owned before writing it; a sparse update first switches the variable to
copy-on-read, whose reads then return copies). So a read that returns the kept buffer (the
same address, the kept tensor alive so no other buffer can be there) holds the values
digested, and the kept digest is their h exactly; after any write the read returns another
buffer and h is computed. The kept tensors of the variables a DP update writes (trainable
ones, the optimizer's slots) are let go before it (`changed` with record_with), so that the
update writes in place; a frozen variable's stays kept. A DP model's `train_on_batch` thus
makes one pass over the weights its update writes (the record after the update): the next
call's check reads the kept digests unless something wrote the weights in between, and a
frozen layer (a LoRA model's backbone, 98% of BERT-base's weights) is not digested again
while nothing writes it. A custom loop's traced private step
reads the variables it updates twice more (`traced_update`: the digests before and after the
update, two compiled programs): measured CPU time per step, alternated in one process on a
loaded 2-core host (three runs each), 1.08-1.20x on a 0.1M-parameter MLP (about 1 ms on 7 ms)
and 1.026-1.036x on a 4.2M-parameter Dense stack (about 6-8 ms on 210-230 ms), batch 16.
Under MirroredStrategy (each replica digests its copies; one merge_call writes), against no
record there, alternated in one process (load 9.7-11): 1 logical CPU 1.19x on a 85K MLP (6.5
-> 7.7 ms) and 1.05x on a 3.2M Dense stack (169 -> 178 ms); 2 logical CPUs 1.13x (8.1 -> 9.1
ms) and 1.07x (197 -> 210 ms), batch 16.
Around a DP fit's user train-batch hooks (models.py `_FitFingerprints`) each checked variable
is read twice a step and digested only if its buffer moved (`hold`, `changed_since`); every
read here is ReadVariableOp run on the variable's handle (`_read_all`), not the variable's own
read with its bookkeeping: on the tutorial CNN (8 variables) that guard costs 0.42-0.45 ms
of CPU a step against 0.86-0.87 ms before, alternated in one run (3 processes each, load 7-8
on 2 cores). Its floor is one op dispatch a read (about 12 us).
"""

import threading
import weakref

import numpy as np
import tensorflow as tf

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.ledger import run_ids

# How many digests a variable keeps (its first one, the weights the run started from, is
# always kept): the states that may be put back.
HISTORY = 256

# id(variable) -> _Record
_RECORDS = {}
# (R, C) -> (a, b): the multipliers, made once per shape (NumPy; TF constants)
_MULTIPLIERS = {}
_TF_MULTIPLIERS = {}
_UNSIGNED = {1: tf.uint8, 2: tf.uint16, 4: tf.uint32}
# fixed entropy of the multipliers (any constant: they only need to be unrelated to updates)
_ENTROPY = 0x5EED_F1A9_E2B1_7A11
# How many digests of the values a custom loop's traced private updates left a variable keeps
# in its in-graph record (`_InGraph`): the traced states that may be put back.
TRACED_KEPT = 64
# id(variable) -> _InGraph
_IN_GRAPH = {}
# digest h -> [(weak ref of a DP run's ledger, its run table then)] of the runs whose private
# updates left a variable at h (`record`): a new model's weights copied BY VALUE from such a
# run (get_weights and set_weights, clone_model) carry its charge as it was then
# (`_adopt_released`), as a weights file does
_RELEASED = {}
_RELEASED_PRUNE = 4096
# invariant key (N, s) -> the same entries: the released states kept under their order- and
# dtype-invariant digests (`_digests_and_keys`), looked up only when the exact digest names no
# run (a copy transposed, or cast to float16 / bfloat16 / float64)
_RELEASED_KEYS = {}
# id(model) -> (weak ref of a DP model whose weights were loaded from a file carrying a
# ledger, function giving its optimizer): its values are registered as released by that
# ledger at the next adoption pass (`_register_loaded`)
_LOADED = {}
# held while a traced step's first record adopts released values (`traced_update`): under a
# tf.distribute strategy each replica's trace may run in a thread of its own
_ADOPTING = threading.Lock()


class _Record:
  """The digests recorded on one variable, the optimizer and step count of the last, the
  tensor the last digest was computed from (`_Held`, or None), and `public`: the digest of
  the values the variable started from when they named no run (no DP run had released them:
  initial values, alike in many models), else None; `public_keys` their invariant keys then
  (`_digests_and_keys`: a released state whose rounding is the start's is not registered)."""

  __slots__ = ("var_ref", "history", "opt_ref", "iterations", "held", "public", "public_keys")

  def __init__(self, variable):
    self.var_ref = weakref.ref(variable)
    self.history = []
    self.opt_ref = None
    self.iterations = None
    self.held = None
    self.public = None
    self.public_keys = ()


class _Held:
  """A tensor read from a variable, its host buffer's address and its digest h: while a later
  read returns a buffer at the same address (this tensor alive, so no other buffer can be
  there), the variable holds these values (copy-on-write, module docstring)."""

  __slots__ = ("tensor", "array", "address", "digest")

  def __init__(self, tensor, array, h):
    self.tensor = tensor
    self.array = array
    self.address = _address(array)
    self.digest = h


def _kept(tensor, array, h):
  """A `_Held` when the tensor's buffer can be told by its address (a host tensor), else None."""
  return _Held(tensor, array, h) if _address(array) is not None else None


class _InGraph:
  """The in-graph record of one variable a custom loop's traced private step updates (module
  docstring): variables made outside every trace and kept out of every checkpoint (held here
  only, in no Keras or TF object graph), so no restore can set them.

  recorded: uint64 [HISTORY], the digests the host recorded on the variable (`_Record.history`,
    padded with its first); written by the host at each record.
  traced: uint64 [TRACED_KEPT], a ring of the digests of the values the traced private updates
    left; written in the traced step after its update.
  meta: int64 [3], (traced digests written, the private-update count of the last, the count of
    the first traced update that started from values in neither `recorded` nor `traced`: a
    change made between traced steps, 0 for none).
  """

  __slots__ = ("var_ref", "recorded", "traced", "meta")

  def __init__(self, variable, history):
    self.var_ref = weakref.ref(variable)
    self.recorded = _state_variable(_padded(history), "dp_recorded_digests")
    self.traced = _state_variable(np.zeros([TRACED_KEPT], np.uint64), "dp_traced_digests")
    self.meta = _state_variable(np.zeros([3], np.int64), "dp_traced_updates")


def _state_variable(value, name):
  """A resource variable made eagerly, also while any tf.function is being traced, and a
  plain one under a distribution strategy's scope (`keras_internals.plain_resource_variable`:
  not tf.Variable, whose creator scopes a tf.function sets refuse a variable made on any trace
  but the first, a step traced again after its first trace raised or another subset of the
  variables)."""
  return keras_internals.plain_resource_variable(value, name)


def _padded(history):
  """The host's digests as uint64 [HISTORY], padded with the first (no other value)."""
  out = np.full([HISTORY], history[0] if history else 0, np.uint64)
  out[:len(history)] = np.array(history[-HISTORY:], np.uint64)
  return out


def _in_graph(variable, make_from=None):
  """The `_InGraph` of `variable`, or None; made from the record `make_from` when missing."""
  state = _IN_GRAPH.get(id(variable))
  if state is not None and state.var_ref() is not variable:   # an id reused by a new variable
    del _IN_GRAPH[id(variable)]
    state = None
  if state is None and make_from is not None:
    state = _IN_GRAPH[id(variable)] = _InGraph(variable, make_from.history)
  return state


# The attribute of a DP optimizer that is True while the library checks and records its weights
# itself, so its updates check nothing: set by a DP model's fit and train_on_batch while they
# run it (their own steps; they record at the callbacks' hooks and at their end), and a class
# attribute of an internal probe whose updates are never released (auditing's noise-free
# optimizer, which puts the weights back). optimizers.fingerprints_deferred and `_deferred`
# read this one attribute.
DEFERRED = "_dp_fingerprints_deferred"

# The attribute of a DP optimizer holding its count of private updates (`private_updates`)
# at its last record: a count that moved since means updates the library did not see.
_SEEN_UPDATES = "_dp_fingerprint_updates"


def private_updates(optimizer):
  """The private updates `optimizer` applied: its private step's count of noised results used
  by updates (`PrivateStep.charged_gradients`), which no checkpoint holds, so no restore or
  `iterations.assign` moves it.

  Args:
    optimizer: a DP optimizer.

  Returns:
    int (0 before the first private step).
  """
  used = getattr(getattr(optimizer, "private_step", None), "_used_results", None)
  if used is None:
    return 0
  return int(_read(used).numpy())


def progress(optimizer):
  """The optimizer's progress: (its `iterations`, `private_updates`), read as two host
  integers (one eager read each).

  Args:
    optimizer: a DP optimizer.

  Returns:
    (int, int).
  """
  return _iterations(optimizer), private_updates(optimizer)


def checked_variables(model):
  """The variables of `model` the checks read: its trainable variables, and every other
  variable of it with digests recorded (a DP-trained layer frozen since: the released model
  still holds it).

  Args:
    model: a keras.Model.

  Returns:
    list of variables (each once).
  """
  out = list(model.trainable_variables)
  seen = {id(v) for v in out}
  for v in model.non_trainable_variables:
    if id(v) not in seen and _record_of(v) is not None:
      seen.add(id(v))
      out.append(v)
  return out


def optimizer_state(optimizer):
  """The DP optimizer's own variables its update reads besides the weights and that only its
  update may write: its floating slots (SGD's momentums, Adam's moments), not `iterations`
  (Keras' update moves it), the learning rate (a public schedule or callback may set it;
  a write of it from the data in the traced step is refused by update_binding) nor an integer
  state (a seeded noise generator's, advanced by the private step). A slot written outside
  the update (from the batch's plain gradient: it reaches the weights un-noised) is refused as
  a weight is.

  Args:
    optimizer: a DP optimizer, or None.

  Returns:
    list of variables ([] for None).
  """
  if optimizer is None:
    return []
  skip = {id(optimizer.iterations), id(getattr(optimizer, "_learning_rate", None))}
  return [v for v in getattr(optimizer, "variables", ())
          if id(v) not in skip and tf.as_dtype(v.dtype).is_floating]


def _with_state(variables, optimizers=()):
  """`variables`, then the `optimizer_state` of `optimizers` and of the optimizers of their
  records (each variable once)."""
  out = list(variables)
  seen = {id(v) for v in out}
  owners = {id(o): o for o in optimizers if o is not None}
  for v in out:
    rec = _record_of(v)
    opt = rec.opt_ref() if rec is not None and rec.opt_ref is not None else None
    if opt is not None:
      owners.setdefault(id(opt), opt)
  for opt in owners.values():
    for v in optimizer_state(opt):
      if id(v) not in seen:
        seen.add(id(v))
        out.append(v)
  return out


def _multipliers(rows, cols):
  """The odd multipliers a [R] and b [1, C] of a shape, as NumPy arrays (made once)."""
  key = (rows, cols)
  if key not in _MULTIPLIERS:
    rng = np.random.default_rng([_ENTROPY, rows, cols])
    a = rng.integers(0, 2**63, size=rows, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 2**63, size=(1, cols), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    _MULTIPLIERS[key] = (a, b)
  return _MULTIPLIERS[key]


def _tf_multipliers(rows, cols):
  """`_multipliers` as TF constants (made once)."""
  key = (rows, cols)
  if key not in _TF_MULTIPLIERS:
    with tf.init_scope():
      _TF_MULTIPLIERS[key] = tuple(tf.constant(m) for m in _multipliers(rows, cols))
  return _TF_MULTIPLIERS[key]


def _read(variable):
  """The variable's current value as an eager tensor (a resource variable's read shares its
  buffer)."""
  return _read_all([variable])[0]


def _read_all(variables):
  """The current values of `variables` as eager tensors, one per variable: a plain resource
  variable's (a Keras variable's backend variable, or a tf.Variable) read by the one op its
  own read runs, ReadVariableOp on its handle, called directly (about 8 us on a CPU host
  against about 35 us through the variable's read: no tape or sharding bookkeeping, which an
  eager read outside any tape does not need), so the result is the same tensor: the
  variable's buffer, or a copy in copy-on-read mode (module docstring). Any other value
  (a distributed or cached variable, an autocast value, a tensor) is read as
  tf.convert_to_tensor reads it."""
  out = []
  with tf.init_scope():
    for variable in variables:
      target = getattr(variable, "value", variable)
      if callable(target):   # a tf.Variable: `value` is its read method
        target = variable
      plain = _PLAIN_TYPES.get(type(target))
      if plain is None:
        plain = _PLAIN_TYPES[type(target)] = issubclass(type(target), tf.Variable) and not (
            issubclass(type(target), tf.distribute.DistributedValues))
      handle = (target.handle if plain and getattr(target, "_cached_value", None) is None
                else None)
      if handle is not None and handle.dtype == tf.resource and (
          not tf.is_symbolic_tensor(handle)):
        out.append(tf.raw_ops.ReadVariableOp(resource=handle, dtype=target.dtype))
      else:
        out.append(tf.convert_to_tensor(target))
  return out


# type -> True for a tf.Variable class that is not a distributed one (`_read_all`)
_PLAIN_TYPES = {}


# tensor.backing_device -> True when it is the host's memory (parsed once per device name)
_HOST_DEVICES = {}
# tf.DType -> True when NumPy's own dtype holds it (not an extension type such as bfloat16,
# whose scalar tensors np.asarray cannot view)
_NATIVE_DTYPES = {}


def _host_array(tensor):
  """A NumPy view of a host tensor's buffer (np.asarray of an eager CPU tensor shares it), or
  None on another device (not copied to the host: its digest is computed at each check). A
  scalar's is a copy, whose address no later read can share while it is kept."""
  device = tensor.backing_device
  on_host = _HOST_DEVICES.get(device)
  if on_host is None:
    on_host = _HOST_DEVICES[device] = tf.DeviceSpec.from_string(
        device).device_type in (None, "CPU")
  if not on_host:
    return None
  native = _NATIVE_DTYPES.get(tensor.dtype)
  if native is None:
    native = _NATIVE_DTYPES[tensor.dtype] = np.dtype(tensor.dtype.as_numpy_dtype).isbuiltin == 1
  if native:   # its rank read from the view (a fresh tensor's shape costs more than the read)
    array = np.asarray(tensor)
    return array.copy() if array.ndim == 0 else array
  if tensor.shape.rank == 0:   # tensor.numpy() is a NumPy scalar then (bfloat16's: no array)
    return np.array(tensor.numpy())
  return np.asarray(tensor)


def _address(array):
  if array is None or not array.size:
    return None
  return array.__array_interface__["data"][0]


def _unsigned(value):
  """The value's bit patterns as unsigned integers of at most 32 bits (tf.bitcast; a complex
  value gets a last axis of 2: its real and imaginary parts; a 64-bit value or part a last
  axis of 2 more, its two 32-bit words, `_words`)."""
  if value.dtype == tf.bool:
    return tf.cast(value, tf.uint8)
  if value.dtype.is_complex or value.dtype.is_floating or value.dtype.is_integer:
    width = value.dtype.size if not value.dtype.is_complex else value.dtype.size // 2
    return tf.bitcast(value, _UNSIGNED[_words(width)[0]])
  return value


def _words(width):
  """(bytes, count) of the words a value of `width` bytes is read as: a 64-bit value as two
  32-bit words, so that each bit enters h times an odd multiplier (module docstring: read as
  one uint64, bit 63 entered as 2^63 times an odd number, so flipping the signs of any even
  number of float64 values, w -> -w, left h unchanged)."""
  return (4, width // 4) if width == 8 else (width, 1)


# The row length C of a value whose number of values it divides (module docstring): values of
# one size share one [R, C], so one compiled program, whatever their shapes.
ROW_VALUES = 1024


def _rows_cols(shape):
  """(R, C) of the module docstring for a value of this shape: C the largest divisor of the
  number of values N that is at most ROW_VALUES (ROW_VALUES when it divides N), a function of
  N alone: a value reshaped (the same bits in the same order: a Dense kernel [4, 6] given to
  an EinsumDense [4, 2, 3]) has the same digest (review R24: such a copy adopted nothing)."""
  size = int(shape.num_elements())
  cols = _COLS.get(size)
  if cols is None:
    cols = next((c for c in range(min(ROW_VALUES, size), 0, -1) if size % c == 0), 1)
    _COLS[size] = cols
  return size // cols, cols


# N -> C of `_rows_cols` (found once per size)
_COLS = {}


def _numpy_digest(array, dtype):
  """h of a real or boolean value of at most HOST_ELEMENTS values, on the host (no dispatch,
  no compiled program): its bit patterns as uint64, the same products and sums mod 2^64 as
  `_fused_digest` (NumPy's uint64 arithmetic wraps), so the same digest."""
  width, words = _words(1 if dtype == tf.bool else dtype.size)
  rows, cols = _rows_cols(tf.TensorShape(array.shape + ((words,) if words > 1 else ())))
  a, b = _multipliers(rows, cols)
  bits = np.ascontiguousarray(array).reshape(-1).view(np.dtype(f"u{width}"))
  x = bits.reshape(rows, cols).astype(np.uint64)
  with np.errstate(over="ignore"):
    return int(np.sum(a * np.sum(x * b, axis=1, dtype=np.uint64), dtype=np.uint64))


# Values with at most this many elements (real or boolean) are digested on the host
# (`_numpy_digest`): a compiled program's call costs more than their arithmetic, and each
# distinct shape would be one more program to compile (BERT-base: 123 of its 197 variables,
# 4 of its 10 shapes).
HOST_ELEMENTS = 1 << 15


def _on_host(value):
  return (value.shape.num_elements() <= HOST_ELEMENTS
          and (value.dtype == tf.bool or value.dtype.is_integer
               or (value.dtype.is_floating and value.dtype.size in (2, 4, 8))))


def _digests(values, arrays=None):
  """h of each tensor of `values` (module docstring): the small real ones on the host, the
  others by the compiled program of their shape (`_fused_digest`), their results read once.

  Args:
    values: eager tensors of any dtypes and shapes.
    arrays: `_host_array` of each of `values` (None: made here).

  Returns:
    list of int in [0, 2^64), one per tensor.
  """
  return _digests_and_keys(values, arrays)[0]


def _digests_and_keys(values, arrays=None, want=None):
  """h of each tensor of `values` (`_digests`) and, where `want` says so, its invariant keys
  (module docstring, "Copies in another layout or dtype"), computed in the same pass: on the
  host for the small ones (`_host_sums`, all of them in one batch), in the program that
  computes h for the others (`_fused_digest_keys`).

  Args:
    values: eager tensors of any dtypes and shapes.
    arrays: `_host_array` of each of `values` (None: made here).
    want: list of bool, one per value: whether its keys are computed (only for a floating
      value of at least 2 elements); None: for none.

  Returns:
    (list of int h, list of keys): keys is (key of the value's bfloat16 rounding, key of its
    float16-then-bfloat16 rounding), a key being (N, s) or None when every element rounds to
    one value (`_keys`); None where not computed.
  """
  out, keys, compiled, keyed, host = [], [], [], [], []
  with tf.init_scope():
    for i, value in enumerate(values):
      wanted = (want is not None and want[i] and value.dtype.is_floating
                and value.dtype.size in (2, 4, 8) and value.shape.num_elements() >= 2)
      keys.append(None)
      array = None if arrays is None else arrays[i]
      if _on_host(value):
        if array is None:   # not given, or on another device: a small copy
          array = np.array(value.numpy())
        out.append(_numpy_digest(array, value.dtype))
        if wanted:
          host.append((i, array))
      elif wanted:   # h and the two sums in one pass (one compiled program per [R, C] too)
        size = value.shape.num_elements()
        a, b = _tf_multipliers(*_rows_cols(tf.TensorShape([size * _words(value.dtype.size)[1]])))
        out.append(None)
        keyed.append((i, _fused_digest_keys(tf.reshape(value, _rows_cols(value.shape)), a, b),
                      array))
      else:
        unsigned = _unsigned(value)
        rows, cols = _rows_cols(unsigned.shape)
        a, b = _tf_multipliers(rows, cols)
        out.append(None)
        # as [R, C] (a reshape shares the buffer): one program per [R, C], not per shape
        compiled.append((i, _fused_digest(tf.reshape(unsigned, [rows, cols]), a, b)))
    if compiled:
      for (i, _), h in zip(compiled, tf.stack([h for _, h in compiled]).numpy()):
        out[i] = int(h)
    if keyed:
      results = (keyed[0][1].numpy()[None] if len(keyed) == 1
                 else tf.stack([r for _, r, _ in keyed]).numpy())
      for (i, _, array), (h, s1, s2) in zip(keyed, results.tolist()):
        out[i] = h % 2**64
        first = array if array is not None else tf.reshape(values[i], [-1])[:1].numpy()
        keys[i] = _keys(values[i].shape.num_elements(), s1, s2, first)
    if host:
      for (i, array), (s1, s2) in zip(host, _host_sums([a for _, a in host])):
        keys[i] = _keys(array.size, s1, s2, array)
  return out, keys


# The invariant digest's mixing multipliers (odd; any fixed ones: a 32-bit finalizer)
_MIX = (0x9E3779B1, 0x85EBCA77)


def _np_rounded(x32):
  """c of float32 values: the bits of their bfloat16 rounding (round to nearest, ties to even,
  on the float32 bit pattern u: (u + 0x7FFF + bit 16 of u) >> 16), as uint32."""
  u = x32.view(np.uint32)
  return (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)


def _np_mix(c):
  """F(c) of uint32 values (`_MIX`; uint32 products wrap)."""
  with np.errstate(over="ignore"):
    y = c * np.uint32(_MIX[0])
    y ^= y >> np.uint32(15)
    y *= np.uint32(_MIX[1])
    y ^= y >> np.uint32(13)
  return y


def _np_half(x32):
  """float32 values rounded to float16 and back (IEEE: ties to even, subnormals, overflow to
  infinity), as set_weights into a float16 variable rounds them."""
  with np.errstate(over="ignore", invalid="ignore"):
    return x32.astype(np.float16).astype(np.float32)


def _host_sums(arrays):
  """[(s1, s2)] of floating host arrays (`_digests_and_keys`): s1 = sum of F(c) over the
  bfloat16 roundings c of each array's values as float32, s2 the same of their float16
  roundings (mod 2^64); all the arrays in one pass (concatenated, summed per segment)."""
  flat = [np.asarray(a).reshape(-1).astype(np.float32, copy=False) for a in arrays]
  x = np.concatenate(flat) if len(flat) > 1 else flat[0]
  starts = np.cumsum([0] + [f.size for f in flat[:-1]])
  out = []
  for v in (x, _np_half(x)):
    out.append(np.add.reduceat(_np_mix(_np_rounded(v)).astype(np.uint64), starts))
  return [(int(s1), int(s2)) for s1, s2 in zip(*out)]


def _keys(n, s1, s2, first):
  """The keys (N, s) of the sums s1, s2 of N values whose first is first's (`_digests_and_keys`);
  None for a sum that is N F(c) of that first value's rounding c: every element rounds to c
  (a zero bias, ones: alike in unrelated models, never registered nor looked up)."""
  x = np.asarray(first).reshape(-1)[:1].astype(np.float32)
  out = []
  for s, v in ((s1, x), (s2, _np_half(x))):
    out.append(None if (s - n * int(_np_mix(_np_rounded(v))[0])) % 2**64 == 0
               else (n, s % 2**64))
  return tuple(out)


def _tf_rounded(x):
  """`_np_rounded` of float32 values, in a compiled program: their conversion to bfloat16
  (IEEE round to nearest, ties to even: the same bits as the integer formula for every
  non-NaN value; one convert instruction, not five integer operations), as uint32."""
  return tf.cast(tf.bitcast(tf.cast(x, tf.bfloat16), tf.uint16), tf.uint32)


def _tf_mix(c):
  """`_np_mix` in a compiled program (uint32 products wrap)."""
  y = c * tf.constant(_MIX[0], tf.uint32)
  y = tf.bitwise.bitwise_xor(y, tf.bitwise.right_shift(y, tf.constant(15, tf.uint32)))
  y = y * tf.constant(_MIX[1], tf.uint32)
  return tf.bitwise.bitwise_xor(y, tf.bitwise.right_shift(y, tf.constant(13, tf.uint32)))


def _compiled_sums(value):
  """(s1, s2) of `_host_sums` for one floating value [R, C] (C at most ROW_VALUES), in a
  compiled program: each row's sum of F(c) (values below 2^32) as a float64 matrix-vector
  product, exact (a row's sum is below 2^42 < 2^53, so no rounding in any order, and faster
  than an integer reduction on a CPU host), then the rows' sums as int64 (wrapping as the
  host's uint64 sums do)."""
  x = value if value.dtype == tf.float32 else tf.cast(value, tf.float32)
  ones = tf.ones(tf.shape(value)[1:], tf.float64)
  out = []
  for v in (x, tf.cast(tf.cast(x, tf.float16), tf.float32)):
    y = _tf_mix(_tf_rounded(v))
    out.append(tf.reduce_sum(tf.cast(tf.linalg.matvec(tf.cast(y, tf.float64), ones),
                                     tf.int64)))
  return tf.stack(out)


@tf.function(jit_compile=True, autograph=False, reduce_retracing=True)
def _fused_digest_keys(value, a, b):
  """[h, s1, s2] (int64, h's bits) of one floating value [R', C'] (`_rows_cols` of its
  elements) in one compiled program: h of its words with the multipliers a, b of their [R, C]
  (`_compiled_h`, bit for bit `_fused_digest`'s), and `_compiled_sums`."""
  h = _compiled_h(_unsigned(value), a, b)
  return tf.concat([tf.bitcast(h, tf.int64)[None], _compiled_sums(value)], 0)


def digest(variable):
  """h(X) of the module docstring: the 64-bit digest of a variable's values.

  Args:
    variable: a Keras or TF variable (or a tensor), of any dtype and shape.

  Returns:
    int in [0, 2^64).
  """
  return _digests([_read(variable)])[0]


def _compiled_h(unsigned, a, b):
  """h of an unsigned value (`_unsigned`) with the multipliers a [R], b [1, C] of its [R, C],
  for a compiled program (XLA): the row sums sum_j b_j X_ij as one int64 matrix-vector
  product, then sum_i a_i of them. Two's-complement int64 products and sums wrap mod 2^64
  exactly as uint64 ones do (XLA emits integer adds and multiplies with no overflow
  assumption: they wrap), and the widening zero-extends a narrower value (a 64-bit one is
  bitcast), so this is h bit for bit, as `_numpy_digest` and any summation order give it.
  Measured on a CPU host (load 9-12, one process each, 2026-12-01): BERT-base's word
  embeddings [30522, 768] 3.7 against 15.2 CPU ms for the widened elementwise products and
  two reductions, their program compiled in 0.12 against 0.19 CPU s; all of BERT-base's
  weights 62-74 against 117-118 CPU ms a pass, the first pass (6 programs compiled) 0.59
  against 0.78-0.85 CPU s."""
  x = tf.reshape(unsigned, [tf.shape(a)[0], tf.shape(b)[1]])
  x = tf.cast(x, tf.int64)   # zero-extended: `_unsigned`'s words are of at most 32 bits
  rows = tf.linalg.matvec(x, tf.bitcast(b[0], tf.int64))
  return tf.bitcast(tf.reduce_sum(tf.bitcast(a, tf.int64) * rows), tf.uint64)


@tf.function(jit_compile=True, autograph=False, reduce_retracing=True)
def _fused_digest(value, a, b):
  """h of one value ([R, C], unsigned) in one compiled program (`_compiled_h`): the widening
  fused into the product (no weight-sized 64-bit copy held; BERT-base's word embeddings would
  need one of 187 MB, op by op)."""
  return _compiled_h(value, a, b)


def _current(pairs, want=None):
  """The digests of the variables' current values: [(record or None, tensor, array, h, keys)]
  for (record, variable) pairs; a record's kept digest when the read returns the kept buffer
  (keys None: a recorded state, registered when it was recorded), the others computed in one
  call, with their invariant keys where `want(record)` (`_digests_and_keys`; else None)."""
  out, todo = [], []
  for (rec, _), tensor in zip(pairs, _read_all([v for _, v in pairs])):
    array = _host_array(tensor)
    held = rec.held if rec is not None else None
    if held is not None and held.address is not None and _address(array) == held.address:
      out.append([rec, tensor, array, held.digest, None])
    else:
      out.append([rec, tensor, array, None, None])
      todo.append(len(out) - 1)
  digests, keys = _digests_and_keys(
      [out[i][1] for i in todo], [out[i][2] for i in todo],
      None if want is None else [want(out[i][0]) for i in todo])
  for i, h, k in zip(todo, digests, keys):
    out[i][3], out[i][4] = h, k
  return out


def hold(variables):
  """The variables' current values, kept without a digest: `changed_since` later tells
  whether they moved (a read at the same buffer address while these are kept: unchanged,
  copy-on-write, module docstring), digesting only the ones that did. The weights a fit's
  steps left, around the user's batch callbacks: no pass when no callback wrote them.

  Args:
    variables: the variables.

  Returns:
    an opaque list for `changed_since` (release it before the next update: while kept, an
    update copies the buffers instead of writing in place).
  """
  variables = _with_state(variables)   # the optimizers' slots too (`optimizer_state`)
  return [(v, tensor, _host_array(tensor))
          for v, tensor in zip(variables, _read_all(variables))]


def changed_since(held):
  """The variables of `held` (`hold`) whose values are neither the held ones nor a state
  recorded on them.

  Args:
    held: what `hold` returned.

  Returns:
    list of (variable, the step count of its last record, or None).
  """
  moved = []
  for (v, tensor, array), now in zip(held, _read_all([v for v, _, _ in held])):
    now_array = _host_array(now)
    if _address(array) is None or _address(now_array) != _address(array):
      moved.append((v, tensor, array, now, now_array))
  if not moved:
    return []
  before = _digests([m[1] for m in moved], [m[2] for m in moved])
  after = _digests([m[3] for m in moved], [m[4] for m in moved])
  out = []
  for (v, *_), h0, h1 in zip(moved, before, after):
    rec = _record_of(v)
    if h1 != h0 and not (rec is not None and h1 in rec.history):
      out.append((v, None if rec is None else rec.iterations))
  return out


def moved(held):
  """The ids of the variables of `held` (`hold`) a write reached since (a read at another
  buffer address; a buffer not on the host counts as not moved).

  Args:
    held: what `hold` returned.

  Returns:
    set of id(variable).
  """
  out = set()
  for (v, _, array), now in zip(held, _read_all([v for v, _, _ in held])):
    before = _address(array)
    if before is not None and _address(_host_array(now)) != before:
      out.add(id(v))
  return out


def mark_seen(optimizer):
  """Makes the private updates `optimizer` applied so far seen (`_untracked` is then False for
  its records): the weights they left are no recorded state, so every later check refuses
  them until the next record (a fit refused after a callback moved the weights held by
  `hold`: nothing the run released may be stated for them).

  Args:
    optimizer: a DP optimizer.
  """
  setattr(optimizer, _SEEN_UPDATES, private_updates(optimizer))


def _forget_dead():
  for table in (_RECORDS, _IN_GRAPH):
    for key, rec in list(table.items()):
      if rec.var_ref() is None:
        del table[key]
  for table in (_RELEASED, _RELEASED_KEYS):
    if len(table) > _RELEASED_PRUNE:   # the digests of dead runs' ledgers, now and then
      for h, refs in list(table.items()):
        if all(ref() is None for ref, _ in refs):
          del table[h]


def _record_of(variable, make=False):
  rec = _RECORDS.get(id(variable))
  if rec is not None and rec.var_ref() is not variable:   # an id reused by a new variable
    del _RECORDS[id(variable)]
    rec = None
  if rec is None and make:
    rec = _RECORDS[id(variable)] = _Record(variable)
  return rec


def _iterations(optimizer):
  return int(_read(optimizer.iterations).numpy())


def _append(rec, h, optimizer, count, updates=None, memo=None, keys=None):
  """Appends digest h to the record `rec` (of a run of `optimizer`, or None); returns whether
  h is a state the run's private updates produced (for `_register_released`). `memo`: a dict
  kept for one pass over the variables (`_adopt_released`). `keys`: the values' invariant
  keys (`_digests_and_keys`), or None."""
  released = False
  if not rec.history:   # the state a run starts from: values a run released, copied?
    named = (_adopt_released(optimizer, h, memo, keys) if optimizer is not None
             else _names_a_run(h, memo, keys))
    rec.public = None if named else h   # else public values: never registered as released
    # nor a state whose rounding is theirs (a variable barely moved from same-seed values)
    rec.public_keys = () if named or keys is None else tuple(k for k in keys if k)
  elif optimizer is not None and h not in rec.history and (
      private_updates(optimizer) if updates is None else updates):
    released = True   # a state the run's private updates produced
  if h in rec.history:
    rec.history.remove(h)
  rec.history.append(h)
  if len(rec.history) > HISTORY:
    del rec.history[1]
  state = _in_graph(rec.var_ref())
  if state is not None:   # a traced step's start may be any recorded state
    with tf.init_scope():
      state.recorded.assign(_padded(rec.history))
  if optimizer is not None:
    rec.opt_ref = weakref.ref(optimizer)
    rec.iterations = count
    setattr(optimizer, _SEEN_UPDATES,
            private_updates(optimizer) if updates is None else updates)
  return released


def record(optimizer, variables, only_recorded=False, only_new=False):
  """Records the current values of `variables` as released or accepted by the DP run of
  `optimizer` (its `iterations` kept with them).

  Args:
    optimizer: the DP optimizer of the run, or None (the records keep their optimizer and
      step count; only variables recorded before are recorded).
    variables: the trainable variables.
    only_recorded: record only variables with digests recorded before.
    only_new: record only variables without digests (made since the last record).
  """
  _forget_dead()
  _register_loaded({})   # (a load_weights just done: its values, before anything moves them)
  count = None if optimizer is None else _iterations(optimizer)
  updates = None if optimizer is None else private_updates(optimizer)
  pairs = []
  for v in _with_state(variables, [optimizer]):   # and its slots (`optimizer_state`)
    if only_new and _record_of(v) is not None:
      continue
    rec = _record_of(v, make=not only_recorded and optimizer is not None)
    if rec is not None:
      pairs.append((rec, v))
  released, keyed, memo = [], [], {}
  naming = _naming_ledger(optimizer) is not None
  for rec, tensor, array, h, keys in _current(pairs, lambda r: naming or not r.history):
    if _append(rec, h, optimizer, count, updates, memo, keys):
      released.append(h)
      keyed.extend(_registrable(rec, keys))
    _restart(_in_graph(rec.var_ref()))
    # only_new: the state a fit starts from, which its steps write next: nothing kept
    rec.held = None if only_new else _kept(tensor, array, h)
  _register_released(optimizer, released, keyed)


def _naming_ledger(optimizer):
  """The ledger of `optimizer`'s run when the values its private updates produce name that run
  (`_register_released`), else None (no ledger yet, a seeded or noiseless run, a stand-in)."""
  step = getattr(optimizer, "private_step", None)
  if step is None or step.seed is not None or step.noise_multiplier == 0:
    return None
  return step.existing_ledger


def _registrable(rec, keys):
  """The invariant keys of a released state to register (`_digests_and_keys`): not None (a
  rounding to one value) and not a key of the values the variable started from
  (`_Record.public_keys`: unrelated runs of one seed start alike)."""
  return [k for k in keys or () if k is not None and k not in rec.public_keys]


def _register_released(optimizer, digests, keys=()):
  """Keeps `optimizer`'s ledger, with its run table now (read once), as the one that charges
  the values of each digest in `digests` (`_RELEASED`): states its private updates produced;
  and of each invariant key in `keys` (`_RELEASED_KEYS`, `_registrable` ones of those states).

  Only for a run whose values no other run makes: its noise is drawn from OS entropy, so a
  digest names one run. Not for a seeded (test) noise, nor for noise_multiplier = 0: two runs
  of one recipe then make the same values without copying them (a resumed run compared with
  an uninterrupted one; tests of one Keras seed), and a copy would adopt every such run's
  ledger, each a run of its own identity, so charged again (`ledger.run_ids`: 12 samples for
  3 measured); neither run is private anyway."""
  ledger = _naming_ledger(optimizer)
  if ledger is None or not (digests or keys):
    return
  with tf.init_scope():
    entry = (weakref.ref(ledger), ledger.run_table())
  for table, names in ((_RELEASED, digests), (_RELEASED_KEYS, keys)):
    for h in names:
      refs = [e for e in table.get(h, ()) if e[0]() is not None]
      if not any(ref() is ledger for ref, _ in refs):   # (a run reaching h again: the first)
        refs.append(entry)
      table[h] = refs


def register_read(optimizer, variables):
  """Registers the current values of `variables` as released by `optimizer`'s DP run
  (`_register_released`, when that run names its values: `_naming_ledger`), those its private
  updates left since its last record (not a recorded state: a run's initial values, seeded
  alike in many models, name no run): a DP model's
  `get_weights` hands them out, possibly between the fit's records (a callback's copy at a
  train-batch hook, where the weights are held, not digested), and a copy by value of them
  then adopts the run's ledger as it is now (review R21: 1 of 3 steps was charged).

  Args:
    optimizer: the model's compiled optimizer, or None.
    variables: the variables whose values are handed out.
  """
  if _naming_ledger(optimizer) is None:
    return
  updates = private_updates(optimizer)
  if updates == getattr(optimizer, _SEEN_UPDATES, updates):   # no private step since a record
    return
  recs = [(_record_of(v), v) for v in variables]
  recs = [(rec, v) for rec, v in recs if rec is not None and rec.history]
  # values no record holds, left by the private steps since the last record (values a
  # callback wrote instead would be charged to this run too: the safe side); never a state
  # a record holds (the values the run started from, which other runs may share). A kept
  # buffer's digest is read, not computed (a frozen layer: a recorded state)
  new = [(rec, h, k) for rec, _, _, h, k in _current(recs, lambda _: True)
         if h not in rec.history]
  _register_released(optimizer, [h for _, h, _ in new],
                     [key for rec, _, k in new for key in _registrable(rec, k)])


def _adopt_released(optimizer, h, memo=None, keys=None):
  """Merges into `optimizer`'s ledger the live ledgers of the runs whose private updates left
  a variable at digest h (`_RELEASED`): a new variable a fit starts from holds values a DP run
  released, copied by value, and every step they took is charged, as the run's ledger was
  when it released them (`run_ids.earlier`; the whole ledger when that is not found: the
  safe side) (McMahan et al., "A General
  Approach to Adding Differential Privacy to Iterative Training Procedures", Section 6;
  `PrivacyLedger.merge_arrays`: a run already held is not added again, so a model loaded
  with that run's ledger, which also holds these values, keeps one copy of it).

  Also the live runs whose custom loop's traced private updates left a variable at h
  (`_traced_ledgers`: values no host record saw, e.g. get_weights right after the loop; review
  R21: 1 of 5 steps was charged), each with its whole ledger now (the step that left h is not
  kept: the safe side). `memo`: a dict kept for one pass over the variables (the rings are
  read once in it). When h names no run, the live runs that released a state of the values'
  invariant key (`keys`, `_digests_and_keys`: its first, the bfloat16 rounding; a copy
  transposed, or cast to float16 / bfloat16 / float64 and back). Returns whether any run
  released h or that key (its ledger adopted, or held already).
  """
  memo = {} if memo is None else memo
  _register_loaded(memo)
  refs = _RELEASED.get(h, ())
  traced = _traced_ledgers(memo).get(h, ())
  if not refs and not traced:
    refs = _released_by_key(keys)
  if not refs and not traced:
    return False
  step = optimizer.private_step
  found = []
  for ref, then in refs:
    ledger = ref()
    if ledger is not None and ledger is not step.existing_ledger:
      found.append(ledger)
      with tf.init_scope():
        state = ledger.state()
        earlier = run_ids.earlier((*state[:3], state[4]), then)
        step.adopt_ledger(*(state if earlier is None else (*earlier[:3], state[3],
                                                               earlier[3])))
  for ledger in traced:
    if ledger is not step.existing_ledger and not any(ledger is f for f in found):
      with tf.init_scope():
        step.adopt_ledger(*ledger.state())
  return True


def _released_by_key(keys):
  """The live entries of `_RELEASED_KEYS` of the first of `keys` (the bfloat16 rounding's: a
  float16 copy's is its source's second, `_digests_and_keys`), or []."""
  if not keys or keys[0] is None:
    return []
  return [e for e in _RELEASED_KEYS.get(keys[0], ()) if e[0]() is not None]


def _names_a_run(h, memo=None, keys=None):
  """Whether digest h (or, when it names none, the invariant `keys`) is a state a live DP run
  released (`_RELEASED`, a pending load's, a traced one in a ring; `_RELEASED_KEYS`):
  `_adopt_released` would adopt a ledger for it."""
  memo = {} if memo is None else memo
  _register_loaded(memo)
  return (any(ref() is not None for ref, _ in _RELEASED.get(h, ()))
          or h in _traced_ledgers(memo) or bool(_released_by_key(keys)))


def note_loaded(model, optimizer_of):
  """Notes a DP model whose weights a file carrying a ledger is loading (`keras.models.
  load_model`, `load_weights`): its values, loaded after this call, are the file's run's
  released state, registered as released by the ledger that adopted the file's
  (`_register_loaded`), so a copy by value of them (transfer learning: its backbone given to
  a new model) adopts it (review R21: 1 of 5 steps was charged).

  Args:
    model: the DP model.
    optimizer_of: function of the model giving its DP optimizer (or None: not compiled yet).
  """
  _LOADED[id(model)] = (weakref.ref(model), optimizer_of)


def _register_loaded(memo):
  """Registers the current values of each model `note_loaded` noted, once its optimizer holds
  a ledger (`_naming_ledger`), as released by that ledger (with its run table now), and
  forgets the model; once per pass (`memo`)."""
  if not _LOADED or "loaded" in memo:
    return
  memo["loaded"] = True
  for key, (ref, optimizer_of) in list(_LOADED.items()):
    model = ref()
    if model is None:
      del _LOADED[key]
      continue
    optimizer = optimizer_of(model)
    if _naming_ledger(optimizer) is None:   # not compiled with a ledger yet: later
      continue
    del _LOADED[key]
    variables = checked_variables(model)
    with tf.init_scope():
      digests, keys = _digests_and_keys(_read_all(variables), want=[True] * len(variables))
    # not the public values a variable started from (review R24): a frozen layer the load
    # writes again, zero biases alike in every model, name no run
    new = [(_record_of(v) or _NoRecord, h, k) for v, h, k in zip(variables, digests, keys)
           if not _public(v, h)]
    _register_released(optimizer, [h for _, h, _ in new],
                       [key for rec, _, k in new for key in _registrable(rec, k)])


def _public(variable, h):
  """Whether digest h is the public start of `variable` (`_Record.public`)."""
  rec = _record_of(variable)
  return rec is not None and h == rec.public


class _NoRecord:
  """The `_Record` fields `_registrable` reads, of a variable with no record."""
  public_keys = ()


def _traced_ledgers(memo):
  """{digest: [ledger]} of the live runs (`_naming_ledger`, each once per digest) whose custom
  loop's traced private updates left a variable at that digest: the digests written into its
  in-graph ring (`_InGraph.traced`; its unwritten slots, zeros, are not read). Read once per
  pass (`memo`)."""
  if "traced" in memo:
    return memo["traced"]
  out = memo["traced"] = {}
  with tf.init_scope():
    for key, state in list(_IN_GRAPH.items()):
      rec = _RECORDS.get(key)
      if (state.var_ref() is None or rec is None or rec.var_ref() is not state.var_ref()
          or rec.opt_ref is None):
        continue
      ledger = _naming_ledger(rec.opt_ref())
      if ledger is None:
        continue
      written = int(state.meta.numpy()[0])
      for t in state.traced.numpy()[:min(written, TRACED_KEPT)]:
        if int(t) == rec.public:
          # public start values (review R24), left unchanged by a traced update (a learning
          # rate warming up from 0), name no run: zero biases are alike in every model
          continue
        held = out.setdefault(int(t), [])
        if not any(ledger is o for o in held):
          held.append(ledger)
  return out


def adopt_released(optimizer, variables):
  """Merges into `optimizer`'s ledger the ledgers of the runs that released the values the
  never-recorded ones of `variables` hold (`_adopt_released`): a custom loop's step traced
  before any record starts from them. Eager (also while a step is traced); digests only the
  variables without a record, and only once a DP run released a state in this process.

  Args:
    optimizer: the DP optimizer about to update `variables`.
    variables: its trainable variables.
  """
  if not (_RELEASED or _IN_GRAPH or _LOADED) or tf.distribute.has_strategy():   # (at record)
    return
  fresh = [v for v in variables if _record_of(v) is None]
  if not fresh:
    return
  memo = {}
  with tf.init_scope():
    for h, keys in zip(*_digests_and_keys(_read_all(fresh), want=[True] * len(fresh))):
      _adopt_released(optimizer, h, memo, keys)


def _restart(state):
  """Forgets a refused start of an in-graph record (a traced step that started from values no
  private step produced) and the traced states (some came after it): the values just recorded
  or put back are a state of the run, where the next traced step starts."""
  if state is None:
    return
  with tf.init_scope():
    meta = state.meta.numpy()
    if meta[2]:
      state.meta.assign([0, meta[1], 0])


def _traced_verdict(state, rec, h):
  """Whether the digest h of a variable the custom loop's traced private steps updated is a
  state of the run (module docstring): a recorded one (the traced states and any refused start
  are then forgotten: the run goes on from it), else one a traced update left, unless a
  traced step started from values that were neither (a change between traced steps)."""
  if h in rec.history:
    _restart(state)
    return True
  with tf.init_scope():
    written, _, refused = (int(m) for m in state.meta.numpy())
    traced = state.traced.numpy()[:min(written, TRACED_KEPT)]
  return not refused and h in {int(t) for t in traced}


def _untracked(rec, memo=None):
  """True when the optimizer of the last record applied private updates the library did not
  see since its last record (a custom loop's traced steps): the record no longer describes
  the weights. A restore of the optimizer moves no count (`private_updates`). `memo`: a dict
  keeping each optimizer's count for one pass over the variables (read once)."""
  opt = rec.opt_ref() if rec.opt_ref is not None else None
  if opt is None:
    return False
  memo = {} if memo is None else memo
  if id(opt) not in memo:
    memo[id(opt)] = private_updates(opt)
  return memo[id(opt)] != getattr(opt, _SEEN_UPDATES, None)


def rebind(optimizer, variables):
  """Makes `optimizer` the owner of the records of `variables` without checking them (a DP
  optimizer claiming them while its step is traced: the traced updates' in-graph records,
  `traced_update`, are checked from then on).

  Args:
    optimizer: the DP optimizer claiming `variables`.
    variables: its trainable variables.
  """
  count, memo = _iterations(optimizer), {}
  for v in variables:
    rec = _record_of(v)
    if rec is not None:
      rec.held = None   # its traced steps write in place
      if not _untracked(rec, memo):
        rec.opt_ref = weakref.ref(optimizer)
        rec.iterations = count
  if getattr(optimizer, _SEEN_UPDATES, None) is None:   # its first claim: nothing unseen yet
    mark_seen(optimizer)


def _graph_value(variable):
  """The variable's value read in the traced step (a Keras variable's, or a TF variable's)."""
  value = getattr(variable, "value", variable)
  return tf.convert_to_tensor(variable if callable(value) else value)


def _graph_digests(values):
  """h of each of `values` (module docstring) as uint64 [len(values)], in a compiled program
  (`_fused_digests`: `_compiled_h`, the host's values bit for bit)."""
  out = []
  for value in values:
    unsigned = _unsigned(value)
    out.append(_compiled_h(unsigned, *_tf_multipliers(*_rows_cols(unsigned.shape))))
  return tf.stack(out)


# `_graph_digests` in one compiled program (XLA: `_compiled_h`'s integer arithmetic wraps)
_fused_digests = tf.function(_graph_digests, jit_compile=True, autograph=False)


def _write_traced(starts, now, states, update):
  """The in-graph write after a traced update (`traced_update`): for each variable i, the
  digest `now[i]` of the values it left into its ring of traced digests, and into its counts
  (written, this update's count `update`, and `update` as the first refused start when a
  digest it started from, `starts[r, i]` on replica r, is none of its recorded or traced
  digests). `starts` is [R, len(states)]: R = 1 without a strategy, else one row per replica
  (each replica's copy of a mirrored variable)."""
  slots = tf.range(TRACED_KEPT, dtype=tf.int64)
  zero = tf.constant(0, tf.int64)
  for i, (recorded, traced, meta_var) in enumerate(states):
    meta = meta_var.read_value()
    ring = traced.read_value()
    start = starts[:, i:i + 1]   # [R, 1]
    in_recorded = tf.reduce_any(tf.equal(recorded.read_value()[None, :], start), axis=1)
    in_traced = tf.reduce_any(tf.logical_and(tf.equal(ring[None, :], start),
                                             (slots < meta[0])[None, :]), axis=1)
    # a start from a recorded state (one put back) starts the run again from it (`_restart`)
    restart = tf.reduce_all(in_recorded)
    was_state = tf.reduce_all(tf.logical_or(in_recorded, in_traced))
    refused = tf.where(restart, zero, tf.where(
        tf.logical_or(meta[2] > 0, was_state), meta[2], update))
    written = tf.where(tf.logical_and(restart, meta[2] > 0), zero, meta[0])
    traced.assign(tf.where(tf.equal(slots, written % TRACED_KEPT), now[i], ring))
    meta_var.assign(tf.stack([written + 1, update, refused]))
  return now


def _deferred(rec):
  """True while the optimizer of the record defers its checks (`DEFERRED`: a DP fit's or
  train_on_batch's own steps, which record the weights themselves, or an internal probe)."""
  opt = rec.opt_ref() if rec.opt_ref is not None else None
  return opt is not None and bool(getattr(opt, DEFERRED, False))


def traced_update(optimizer, variables):
  """The in-graph record of a custom loop's private update traced in a tf.function (module
  docstring): called in the traced step before the update, it reads the digests of the values
  the update starts from; the function it returns, called after the update, writes the digests
  of the values it left, with the private-update count, into each variable's `_InGraph` (made
  here, outside the trace), and the count of this update when it started from values that are
  neither a recorded state nor one a traced update left. No host round trip, static shapes.

  Under a tf.distribute strategy (in a replica's context: `strategy.run`) each replica reads
  the digests of its own copies of the variables, before and after the update, and the write
  is made once, in cross-replica context (`merge_call`): a start is a state of the run only
  if every replica's copy held one, and the values the first replica's copies (the primary
  ones, which the host reads) were left are written.

  Args:
    optimizer: the DP optimizer applying the update.
    variables: the variables it updates.

  Returns:
    a function of no arguments to call after the update (it returns the digests written), or
    None (eagerly, or for no variable).
  """
  variables = list(variables)
  if not variables or tf.executing_eagerly():
    return None
  _forget_dead()
  count = _iterations(optimizer)
  # the optimizer's slots too (`optimizer_state`): a write of them in the step before the
  # update, or between traced steps, is a start from values no private step produced
  if not getattr(optimizer, "built", True):   # its slots now, as its apply would make them
    optimizer.build(variables)
  variables = _with_state(variables, [optimizer])
  states, memo = {}, {}
  for v in variables:
    if id(v) in states:
      continue
    rec = _record_of(v, make=True)
    if not rec.history:   # where the traced run starts (as a DP fit's first record)
      with tf.init_scope():
        (h,), (keys,) = _digests_and_keys([_read(v)], want=[True])
        _append(rec, h, None, None, memo=memo, keys=keys)
      if rec.public is None and tf.distribute.has_strategy():
        # values a DP run released, copied by value: under a strategy `adopt_released`
        # leaves them to the first record, this one (review R24: a custom loop under
        # MirroredStrategy given them charged 1 of 4 steps); once, whichever replica's
        # trace gets here first (a run held already is not added again)
        with _ADOPTING, tf.init_scope():
          _adopt_released(optimizer, h, memo, keys)
    if rec.opt_ref is None or rec.opt_ref() is None:
      rec.opt_ref, rec.iterations = weakref.ref(optimizer), count
    rec.held = None   # the traced steps write in place
    states[id(v)] = _in_graph(v, make_from=rec)
  states = [states[id(v)] for v in variables]
  before = _fused_digests([_graph_value(v) for v in variables])
  used = optimizer.private_step._used_results  # pylint: disable=protected-access

  # one compiled program, made per trace: it captures these states (a module-level function
  # given them as arguments would keep a trace of earlier, deleted ones)
  state_vars = [(s.recorded, s.traced, s.meta) for s in states]
  replica = tf.distribute.get_replica_context() if tf.distribute.has_strategy() else None
  if replica is None:   # no strategy (or its cross-replica context: the primary copies read)
    write = tf.function(
        lambda b, values, update: _write_traced(b[None], _graph_digests(values), state_vars,
                                                update),
        jit_compile=True, autograph=False)

    def after():
      return write(before, [_graph_value(v) for v in variables], used.read_value())

    return after

  write = tf.function(lambda starts, now, update: _write_traced(starts, now, state_vars, update),
                      jit_compile=True, autograph=False)

  def merged(strategy, starts, now):
    """Cross-replica context: every replica's starts [R, V], the primary copies' digests."""
    starts = tf.stack(strategy.experimental_local_results(starts))
    return write(starts, strategy.experimental_local_results(now)[0], used.read_value())

  def after_replicas():
    now = _fused_digests([_graph_value(v) for v in variables])   # this replica's copies
    return replica.merge_call(merged, args=(before, now))

  return after_replicas


def changed(variables, optimizer=None, record_with=None):
  """The variables whose values are none of the states recorded on them.

  Args:
    variables: the variables to check, or None: every variable recorded by `optimizer`.
    optimizer: with variables=None, the DP optimizer whose records are checked.
    record_with: a DP optimizer: when no variable changed, the current values are recorded
      for it (`record`, each digest computed once).

  Returns:
    list of (variable, the step count of its last record).
  """
  _forget_dead()
  if variables is None:
    variables = [rec.var_ref() for rec in _RECORDS.values()
                 if rec.opt_ref is not None and rec.opt_ref() is optimizer]
  pairs = []
  for v in _with_state(variables, [record_with]):   # and the slots (`optimizer_state`)
    rec = _record_of(v, make=record_with is not None)
    if rec is not None:
      pairs.append((rec, v))
  out, seen, memo, traced = [], [], {}, {}
  naming = record_with is not None and _naming_ledger(record_with) is not None

  def want(rec):   # invariant keys: a first record's, a state to register's
    return ((record_with is not None and (naming or not rec.history))
            or (bool(rec.history) and _untracked(rec, memo)
                and _in_graph(rec.var_ref()) is not None))

  for rec, tensor, array, h, keys in _current(pairs, want):
    seen.append((rec, h, keys))
    if not rec.history:
      continue
    state = _in_graph(rec.var_ref()) if _untracked(rec, memo) else None
    if state is not None:   # traced private updates since the last record: their digests
      if not _traced_verdict(state, rec, h):
        out.append((rec.var_ref(), rec.iterations))
      elif h not in rec.history:
        _append(rec, h, None, None)   # a state the run produced, from now on recorded
        opt = rec.opt_ref()   # and released by its run (a copy by value adopts its ledger)
        entry = traced.setdefault(id(opt), (opt, [], []))
        entry[1].append(h)
        entry[2].extend(_registrable(rec, keys))
    elif h not in rec.history and not (_untracked(rec, memo) and _deferred(rec)):
      # no traced update wrote it since its last record (tracked, or outside the subset a
      # custom loop's traced steps updated): compared with its records. Unchecked while a
      # DP fit's own steps (which record at its hooks and end) run
      out.append((rec.var_ref(), rec.iterations))
    if record_with is None and h in rec.history:
      rec.held = _kept(tensor, array, h)   # a recorded state: its digest kept
  for opt, digests, keys in traced.values():
    _register_released(opt, digests, keys)
  if record_with is not None:
    written = {id(v) for v in optimizer_state(record_with)}
    for rec, _, _ in seen:   # what the DP update writes, it writes in place: no buffer kept
      if _updated(rec.var_ref(), written):
        rec.held = None
    if not out:
      count, updates = _iterations(record_with), private_updates(record_with)
      released = [(rec, h, keys) for rec, h, keys in seen
                  if _append(rec, h, record_with, count, updates, memo, keys)]
      _register_released(record_with, [h for _, h, _ in released],
                         [k for rec, _, keys in released for k in _registrable(rec, keys)])
  return out


def _updated(variable, slots):
  """Whether a DP update may write `variable`: a trainable variable, or one of the ids
  `slots` (the optimizer's `optimizer_state`). A frozen one (a LoRA model's backbone) keeps
  its kept buffer through the update: a write there would copy it (copy-on-write, module
  docstring), so the record after the update reads its digest unless something wrote it."""
  return variable is None or id(variable) in slots or bool(getattr(variable, "trainable", True))


def _name(variable):
  return getattr(variable, "path", None) or getattr(variable, "name", repr(variable))


def check(variables, what, optimizer=None, record_with=None):
  """Refuses weights changed outside the DP optimizer since their last record (`changed`).

  Args:
    variables: the variables of the DP model (`checked_variables`; None: those `optimizer`
      recorded).
    what: what is refused, for the message ("fit", "privacy_statement", ...).
    optimizer: with variables=None, the DP optimizer whose records are checked.
    record_with: a DP optimizer about to update the variables: their values are recorded
      for it when the check passes.

  Raises:
    PrivacyConfigError: a variable holds values that no private step of the run produced
      (the message names the variables and says what to do).
  """
  refuse(changed(variables, optimizer, record_with), what)


def refuse(bad, what):
  """Raises `check`'s refusal for the changed variables `bad` (none: returns).

  Args:
    bad: list of (variable, the step count of its last record), as `changed` returns.
    what: what is refused, for the message.

  Raises:
    PrivacyConfigError: `bad` is not empty.
  """
  if not bad:
    return
  names = [_name(v) for v, _ in bad]
  step = max(s for _, s in bad)
  shown = ", ".join(repr(n) for n in names[:6]) + (
      f" and {len(names) - 6} more" if len(names) > 6 else "")
  traced = ""
  if any(_in_graph(v) is not None for v, _ in bad):   # updated by a custom loop's traced steps
    traced = (
        f". A custom loop's private steps traced in a tf.function keep, per variable, the "
        f"last {TRACED_KEPT} states they left: a state they left earlier and no check saw "
        f"(e.g. a tf.train.Checkpoint saved more than {TRACED_KEPT} traced steps before its "
        "restore) is refused too, and a traced step from refused values leaves refused "
        "values until a state the run recorded is put back. To restore checkpoints of a "
        "long traced loop, have each one's state checked when it is saved: call the DP "
        "model's model.privacy_statement(delta) (a plain Keras model's loop: "
        "tf_dpiter.keras.model.statement.run_statement(optimizer, delta)), or save through "
        "the DP model's "
        "model.save_weights / model.save (checked, and the file carries the ledger), right "
        "before saving it")
  raise PrivacyConfigError(
      f"{what} refused: the weights of this DP model changed outside its DP optimizer after "
      f"its last recorded private update (optimizer step {step}): {len(names)} "
      f"variable{'s' if len(names) > 1 else ''} ({shown}) hold values that no private step "
      "of the run produced, e.g. a plain Keras optimizer updated a layer this model shares "
      "(another model fit on the records), set_weights / assign wrote other values (also "
      "after or between a custom loop's private steps traced in a tf.function), or "
      "weights were loaded from a file that carries no privacy ledger. The ledger's epsilon "
      "charges noised steps only and does not hold for these weights. Train every model "
      "that touches the records with a DP optimizer (e.g. one DP model with both outputs), "
      "or put back weights the DP run released: an earlier state of this run, or a file a DP "
      "model saved, through model.load_weights / keras.models.load_model (they carry the "
      f"ledger){traced}")
