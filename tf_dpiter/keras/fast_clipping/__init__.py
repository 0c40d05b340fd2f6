"""Fast per-example clipping with ghost norms.

Public API:
  clipped_grad_sum(model, inputs, targets, per_example_loss_fn, l2_norm_clip,
                   mask=None) -> (grads, per_example_norms)
  supports(model) -> bool
  unrecorded_variable_uses(model, inputs) -> variables read outside their layer's calls
  register_layer(layer_class, norm_fn)
  unregistered_layers(model) -> list of layer names on the vectorized path

Layout: registry.py (the norm-function contract and the registry), rules/ (one
module per built-in layer rule), algebra.py (their shared algebra), plan.py
(which layer gets which path), clipping.py (the clipped sum: its recorded forward
pass, the norms, the clip factors and the sum).
"""

from tf_dpiter.keras.fast_clipping import rules  # registers the built-in rules
from tf_dpiter.keras.fast_clipping.clipping import clipped_grad_sum
from tf_dpiter.keras.fast_clipping.clipping import describe_unrecorded
from tf_dpiter.keras.fast_clipping.clipping import unrecorded_variable_uses
from tf_dpiter.keras.fast_clipping.clipping import warn_unrecorded
from tf_dpiter.keras.fast_clipping.plan import supports
from tf_dpiter.keras.fast_clipping.plan import unregistered_layers
from tf_dpiter.keras.fast_clipping.registry import register_layer

__all__ = [
    "clipped_grad_sum", "supports", "register_layer", "unregistered_layers",
    "unrecorded_variable_uses", "describe_unrecorded", "warn_unrecorded"
]
