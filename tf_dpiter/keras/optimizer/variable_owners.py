"""One DP optimizer per trainable variable.

Rule: a DP optimizer's ledger charges the steps it takes, and the epsilon of its model's
weights is that ledger's only when no other DP optimizer updates them (McMahan et al., "A
General Approach to Adding Differential Privacy to Iterative Training Procedures",
Section 6: every noised step that touched the released weights is charged). Two DP models
sharing a layer, each with its own DP optimizer, would leave the shared weights with the
steps of both ledgers while each ledger reports only its own. So a DP optimizer's `build`
claims its trainable variables, and refuses one another live DP optimizer claimed. A plain
Keras optimizer (a GAN's non-DP generator optimizer) is not concerned, nor is the same DP
optimizer building again; a recompile with a new DP optimizer releases the outgoing one's
claims (its ledger is carried into the new one). (One DP optimizer on two models is refused
by Keras itself: it updates only the variables it was built with.)
"""

import weakref

from tf_dpiter.errors import PrivacyConfigError

# id(variable) -> (weakref to the variable, weakref to the DP optimizer that claimed it)
_OWNERS = {}


def _name(variable):
  return getattr(variable, "path", None) or getattr(variable, "name", repr(variable))


def claim(optimizer, variables):
  """Records `optimizer` as the DP optimizer updating `variables`.

  Args:
    optimizer: the DP optimizer being built.
    variables: the trainable variables it will update.

  Raises:
    PrivacyConfigError: one of `variables` is updated by another live DP optimizer (the
      message names the variable and says what to do).
  """
  for key, (var_ref, opt_ref) in list(_OWNERS.items()):   # forget the dead
    if var_ref() is None or opt_ref() is None:
      del _OWNERS[key]
  for v in variables:
    entry = _OWNERS.get(id(v))
    other = None if entry is None or entry[0]() is not v else entry[1]()
    if other is not None and other is not optimizer:
      raise PrivacyConfigError(
          f"the trainable variable {_name(v)!r} is already updated by another DP optimizer "
          f"({type(other).__name__} {other.name!r}), whose ledger does not charge this "
          "optimizer's steps, nor this one's its steps: the shared weights would carry the "
          "privacy cost of both while each ledger reports one. Train one DP model holding both "
          "(e.g. one model with both outputs), freeze the shared layers in one of them "
          "(layer.trainable = False before compile), or give each model its own copy of the "
          "layer")
  for v in variables:
    _OWNERS[id(v)] = (weakref.ref(v), weakref.ref(optimizer))


def release(optimizer):
  """Forgets the claims of `optimizer` (a recompile replaced it).

  Args:
    optimizer: a DP optimizer.
  """
  for key, (_, opt_ref) in list(_OWNERS.items()):
    if opt_ref() is optimizer:
      del _OWNERS[key]
