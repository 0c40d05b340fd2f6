"""Layer registry for ghost norms: per-example squared gradient norms of a
layer's trainable variables computed from the layer's inputs and the gradient
at a tensor produced inside the layer, without per-example gradients.

A norm function has the contract

    norm_fn(layer, *call_args, **call_kwargs) -> (outputs, watched, sqr_norm_fn)
        or None to decline (the layer then takes the vectorized path).

  outputs:      what ``layer.call(*call_args, **call_kwargs)`` returns.
  watched:      a tensor or a list of tensors with a leading batch axis,
                computed inside the layer from its trainable variables, such
                that the variables influence ``outputs`` only through
                ``watched`` (Goodfellow 2015, Sec. 2; Lee & Kifer 2021, Sec. 3).
  sqr_norm_fn:  ``sqr_norm_fn(watched_grads) -> [B]`` float32, the squared L2
                norm of the per-example gradient of the loss with respect to
                all of ``layer.trainable_variables`` (concatenated), given the
                gradients of the summed loss at ``watched`` (same structure).
                It may instead return ``PerExampleGrads(sqr_norms, grads)``
                (or ``PerExampleBlock(sqr_norms, blocks, unpack)``, the same
                gradients as [B, P] blocks in its own layout) when it has
                the per-example gradients at hand anyway.

The summed clipped gradient of such a layer is then obtained as a vector-Jacobian
product of ``watched`` with the clip-weighted ``watched_grads`` (book-keeping,
Bu et al. 2023, Sec. 3), so a norm function only provides the norm. When the
norm function returned ``PerExampleGrads``, the clipped sum is
``sum_i c_i g_i`` of those gradients and the vector-Jacobian product is skipped
(per layer, the choice of mixed ghost clipping, Bu et al. 2022, Sec. 3.2): for
a layer with T positions this costs B*T*K*N either way, but saves the second
weight-gradient computation, which is the whole DP overhead of a convolution.

A norm function whose watched tensors are not a function of the variables
through which the vector-Jacobian product could be taken (a recurrent layer:
the same kernels act at every step) returns ``GhostSums(sqr_norms, sum_fn)``:
``sum_fn(weighted_watched_grads)`` gives the clipped sum itself, one float32
tensor per trainable variable, from the watched gradients already multiplied
by each example's clip factor (zero rows for examples that add nothing).

Optional capabilities, declared by attributes of the norm function:
  supports_records (``@supports_records``): it honours ``examples_per_record``
      (per-record norms of records of k consecutive examples).
  float32_watched (``@float32_watched``): called again outside the layer's
      ``__call__`` with its floating inputs cast to float32, it returns
      ``watched`` computed in float32 from the float32 variables. Layers that
      compute in 16 bits (mixed_bfloat16, mixed_float16, ...) keep the ghost
      path only with such a function: their clipped sum is the vector-Jacobian
      product of that float32 recomputation (privacy arithmetic in
      float32 whatever the dtype policy). Others then take the vectorized path.
  float32_sums (``@float32_sums``): its results are always PerExampleGrads,
      GhostSums or FactorSums formed in float32, so it serves 16-bit layers as they are.
  watched_from_inputs (``@watched_from_inputs``): every watched tensor is computed
      from the call's floating inputs, so the first backward pass need not record the
      reads of the layer's variables (it then forms no gradient of them).
  lora_variants: ``(plain_fn, lora_fn)``, for a layer class with Keras' LoRA
      (``layer.lora_enabled``): the lookup gives each layer the one of the two its
      LoRA setting needs, once per plan (rules/lora.py).
A norm function may also return ``FactorSums(sqr_norms, sum_fn)``: ``sum_fn(example_factors)``
forms the clipped sum in float32 from the clip factors themselves (a Dense
layer weights whichever of its input and its output gradient is smaller).

The built-in norm functions live in ``fast_clipping/rules/`` (one module per
layer family) and are registered when ``tf_dpiter.keras.fast_clipping`` is
imported.
"""

import threading
from typing import Callable, NamedTuple, Sequence

import tensorflow as tf
import keras

from tf_dpiter.errors import ParameterValueError

_LOCK = threading.Lock()
_REGISTRY = {}  # layer class -> norm_fn
# register_layer calls so far: the registered rules are the same while it is (a plan kept
# across steps, plan.one_plan_per_step, is rebuilt when it changes).
RULES_VERSION = 0

# Test hook: force "gram" or "direct" in algebra.factored_sqr_norm, or "filter"
# / "depthwise" for convolutions (per-example filter gradients); None: chosen
# by cost.
_FORM_OVERRIDE = None

# Per-example gradients of a layer are kept (PerExampleGrads) when one example's
# gradient has at most this many entries: 64 KiB in float32, 64 MiB per layer at
# batch 1024. Larger ones are reduced to their norm and summed by book-keeping.
MAX_PER_EXAMPLE_ENTRIES = 1 << 14
# A per-example gradient that the direct norm form computes anyway (it was the cheaper form)
# is kept up to this many entries: its clipped sum is then sum_i c_i g_i, which saves the
# book-keeping matrix product (256 KiB per example in float32).
MAX_DIRECT_PER_EXAMPLE_ENTRIES = 1 << 16


class PerExampleGrads(NamedTuple):
  """A sqr_norm_fn result that also carries the per-example gradients.

  sqr_norms: [B] float32, ||g_i||^2 over the layer's trainable variables.
  grads:     one [B, *v.shape] tensor per v in layer.trainable_variables, in
             that order: g_i for each variable.
  """
  sqr_norms: tf.Tensor
  grads: Sequence[tf.Tensor]


class PerExampleBlock(NamedTuple):
  """A sqr_norm_fn result that carries the per-example gradients as blocks in a layout
  of the rule's choosing (e.g. the layout a batched matrix product leaves them in), so
  that neither the norms nor the clipped sum need them reordered per example.

  sqr_norms: [B] float32, ||g_i||^2 over the layer's trainable variables (the squared
             norm of row i of all blocks), or an `algebra.DeferredNorms` that the
             enclosing `algebra.batched_norms` block forms with its class.
  blocks:    [B, P_j] float32 tensors: row i of all blocks together holds every entry
             of g_i over the layer's trainable variables, each once.
  unpack:    one [P_j] tensor per block (a weighted sum of rows) -> one tensor per v
             in layer.trainable_variables, of v's shape.
  """
  sqr_norms: tf.Tensor
  blocks: Sequence[tf.Tensor]
  unpack: Callable[[Sequence[tf.Tensor]], Sequence[tf.Tensor]]


class GhostSums(NamedTuple):
  """A sqr_norm_fn result that forms the clipped sum itself.

  sqr_norms: [B] float32, ||g_i||^2 over the layer's trainable variables.
  sum_fn:    (weighted watched gradients, same structure as watched, each row
             i multiplied by c_i) -> one float32 tensor per v in
             layer.trainable_variables: sum_i c_i g_i.
  """
  sqr_norms: tf.Tensor
  sum_fn: Callable[..., Sequence[tf.Tensor]]


class FactorSums(NamedTuple):
  """A sqr_norm_fn result that forms the clipped sum itself from the clip factors (it
  chooses which operand to weight: the smaller one, Bu et al. 2023, Sec. 3).

  sqr_norms: [B] float32, ||g_i||^2 over the layer's trainable variables, or an
             `algebra.DeferredNorms` (see PerExampleBlock).
  sum_fn:    (example_factors [B] float32, c_i of each example's record, 0 for an example
             that adds nothing) -> one float32 tensor per v in layer.trainable_variables:
             sum_i c_i g_i. The rows with c_i = 0 must add exactly nothing even where they
             are not finite (algebra.weight_rows / drop_rows do it without a branch).
  """
  sqr_norms: tf.Tensor
  sum_fn: Callable[..., Sequence[tf.Tensor]]


def form_override():
  """The forced form (test hook) or None."""
  return _FORM_OVERRIDE


def keep_per_example(num_entries):
  """Whether a per-example gradient of `num_entries` entries is kept.

  Args:
    num_entries: entries of one per-example gradient.

  Returns:
    bool.
  """
  return num_entries is not None and num_entries <= MAX_PER_EXAMPLE_ENTRIES


def supports_records(fn):
  """Marks a norm function as honouring examples_per_record.

  Args:
    fn: a norm function.

  Returns:
    fn, marked.
  """
  fn.supports_records = True
  return fn


def float32_watched(fn):
  """Marks a norm function whose `watched` is float32 when it is called with
  float32 inputs outside the layer's __call__ (see module docstring)."""
  fn.float32_watched = True
  return fn


def watched_from_inputs(fn):
  """Marks a norm function whose watched tensors are all computed from the call's floating
  inputs (a Dense's x W): the first backward pass (the gradients at the watched tensors)
  then records no read of the layer's variables, so it forms no gradient of them, which
  nothing uses (clipping.install's `first_tape`; where a traced pass finds a watched tensor
  not so computed, e.g. from integer inputs cast in the call, it takes the full tape).

  Args:
    fn: a norm function.

  Returns:
    fn, marked.
  """
  fn.watched_from_inputs = True
  return fn


def float32_sums(fn):
  """Marks a norm function whose results are PerExampleGrads, GhostSums or
  FactorSums formed in float32 (see module docstring)."""
  fn.float32_sums = True
  return fn


def register_layer(layer_class, norm_fn):
  """Registers ``norm_fn`` (see module docstring) for ``layer_class``.

  The function is used for instances of exactly ``layer_class`` and for
  subclasses that do not override ``call``. Re-registering replaces the
  previous function (built-in ones included).

  Args:
    layer_class: a keras.layers.Layer subclass.
    norm_fn: the norm function.

  Raises:
    ParameterValueError: layer_class is not a Layer subclass or norm_fn not callable.
  """
  if not (isinstance(layer_class, type) and
          issubclass(layer_class, keras.layers.Layer)):
    raise ParameterValueError(
        f"layer_class must be a keras.layers.Layer subclass, got {layer_class!r}")
  if not callable(norm_fn):
    raise ParameterValueError(f"norm_fn must be callable, got {norm_fn!r}")
  global RULES_VERSION
  with _LOCK:
    _REGISTRY[layer_class] = norm_fn
    RULES_VERSION += 1


_LOOKUP_HOOKS = []


def add_lookup_hook(hook):
  """Runs `hook()` before every lookup: a rule module whose layer classes live in an optional
  package (rules/keras_hub.py) registers them once that package has been imported, without
  this module importing the rule module.

  Args:
    hook: a callable taking no argument; cheap when it has nothing to do.

  Raises:
    ParameterValueError: `hook` is not callable.
  """
  if not callable(hook):
    raise ParameterValueError(f"`hook` must be callable. Received: hook={hook!r}")
  with _LOCK:
    if hook not in _LOOKUP_HOOKS:
      _LOOKUP_HOOKS.append(hook)


def lookup(layer):
  """Returns the norm function for ``layer`` or None.

  Args:
    layer: a Keras layer.

  Returns:
    the registered norm function (of a class with ``lora_variants``, the one for the
    layer's LoRA setting), or None.
  """
  return lookup_all([layer])[id(layer)]


def lookup_all(layers):
  """The norm function of each of ``layers`` (``lookup``), the lookup hooks run once.

  Args:
    layers: Keras layers.

  Returns:
    {id(layer): its norm function or None}.
  """
  for hook in _LOOKUP_HOOKS:   # e.g. rules of keras_hub classes, once keras_hub is imported
    hook()
  rules = {}
  for layer in layers:
    fn = _rule_of(type(layer))
    variants = getattr(fn, "lora_variants", None)   # LoRA on or off: chosen here, not per call
    if variants is not None:
      fn = variants[1] if getattr(layer, "lora_enabled", False) else variants[0]
    rules[id(layer)] = fn
  return rules


def _rule_of(cls):
  """The norm function registered for layer class ``cls`` (or inherited: see lookup)."""
  with _LOCK:
    if cls in _REGISTRY:
      return _REGISTRY[cls]
    for base in cls.__mro__[1:]:
      fn = _REGISTRY.get(base)
      if fn is not None:
        # A subclass inherits the norm function only if its forward is the
        # registered class's forward; otherwise the norm could be wrong.
        if getattr(cls, "call", None) is getattr(base, "call", None):
          return fn
        return None
  return None
