"""Fast per-example clipping with ghost norms (issue #6).

Public API:
  clipped_grad_sum(model, inputs, targets, per_example_loss_fn, l2_norm_clip,
                   mask=None) -> (grads, per_example_norms)
  supports(model) -> bool
  register_layer(layer_class, norm_fn)
  unregistered_layers(model) -> list of layer names on the vectorized path
"""

from tf_dpiter.keras.fast_clipping.clipping import clipped_grad_sum
from tf_dpiter.keras.fast_clipping.clipping import supports
from tf_dpiter.keras.fast_clipping.clipping import unregistered_layers
from tf_dpiter.keras.fast_clipping.registry import register_layer

__all__ = [
    "clipped_grad_sum", "supports", "register_layer", "unregistered_layers"
]
