"""One DP optimizer per trainable variable.

Rule: a DP optimizer's ledger charges the steps it takes, and the epsilon of its model's
weights is that ledger's only when no other DP optimizer updates them (McMahan et al., "A
General Approach to Adding Differential Privacy to Iterative Training Procedures",
Section 6: every noised step that touched the released weights is charged). Two DP models
sharing a layer, each with its own DP optimizer, would leave the shared weights with the
steps of both ledgers while each ledger reports only its own. So a DP optimizer claims the
variables it updates before its first update (`apply_private_gradients`, eagerly or when
traced) and refuses one that another live DP optimizer updated. A DP optimizer only built on
them (Keras' copy of the compiled optimizer in `clone_model`, a loaded model's) claims
nothing. A plain Keras optimizer (a GAN's non-DP generator optimizer) is not concerned; a
recompile with a new DP optimizer releases the outgoing one's claims (its ledger is carried
into the new one). One DP optimizer on two models is refused by Keras itself (it updates only
the variables it was built with). An internal probe whose updates are never released
(auditing.check_sensitivity's noise-free optimizer, which puts the weights back) sets the
class attribute named `UNCLAIMED`: it neither claims nor is refused.
"""

import gc
import weakref

from tf_dpiter.errors import PrivacyConfigError

# id(variable) -> (weakref to the variable, weakref to the DP optimizer that claimed it)
_OWNERS = {}
# The class attribute of a probe optimizer whose updates are never released.
UNCLAIMED = "_dp_unclaimed_variables"


def _name(variable):
  return getattr(variable, "path", None) or getattr(variable, "name", repr(variable))


def claim(optimizer, variables):
  """Records `optimizer` as the DP optimizer updating `variables`.

  Args:
    optimizer: the DP optimizer about to update `variables`.
    variables: the trainable variables it updates.

  Raises:
    PrivacyConfigError: one of `variables` is updated by another live DP optimizer (the
      message names the variable and says what to do).
  """
  if getattr(optimizer, UNCLAIMED, False):
    return
  variables = list(variables)
  if all(_owner(v) is optimizer for v in variables):   # claimed before: every eager step
    return
  check(optimizer, variables)
  for v in variables:
    _OWNERS[id(v)] = (weakref.ref(v), weakref.ref(optimizer))


def check(optimizer, variables):
  """Refuses `variables` when another live DP optimizer claimed one of them (`claim`), e.g.
  at the start of a fit whose train function was traced before another optimizer took the
  variables over.

  Args:
    optimizer: the DP optimizer about to update `variables`.
    variables: the trainable variables it updates.

  Raises:
    PrivacyConfigError: as `claim`.
  """
  if getattr(optimizer, UNCLAIMED, False):
    return
  variables = list(variables)
  for key, (var_ref, opt_ref) in list(_OWNERS.items()):   # forget the dead
    if var_ref() is None or opt_ref() is None:
      del _OWNERS[key]
  others = [_other(v, optimizer) for v in variables]
  if any(o is not None for o in others):   # an unreachable one (a reference cycle) is dead
    gc.collect()
    others = [_other(v, optimizer) for v in variables]
  for v, other in zip(variables, others):
    if other is not None:
      raise PrivacyConfigError(
          f"the trainable variable {_name(v)!r} is already updated by another DP optimizer "
          f"({type(other).__name__} {other.name!r}), whose ledger does not charge this "
          "optimizer's steps, nor this one's its steps: the shared weights would carry the "
          "privacy cost of both while each ledger reports one. Train one DP model holding both "
          "(e.g. one model with both outputs), give each model its own copy of the layer, or, "
          "to fine-tune a DP-trained model inside another, nest it in the new DP model and "
          "compile that one: it takes the nested model's ledger and its variables over"
          " (training the nested model on its own is then refused)")


def _owner(variable):
  """The live DP optimizer that claimed `variable`, else None."""
  entry = _OWNERS.get(id(variable))
  return None if entry is None or entry[0]() is not variable else entry[1]()


def _other(variable, optimizer):
  """The live DP optimizer other than `optimizer` that claimed `variable`, else None."""
  other = _owner(variable)
  return None if other is optimizer else other


def release(optimizer):
  """Forgets the claims of `optimizer` (a recompile replaced it, or a DP model it trained was
  nested in another DP model, whose optimizer took its ledger over).

  Args:
    optimizer: a DP optimizer.
  """
  for key, (_, opt_ref) in list(_OWNERS.items()):
    if opt_ref() is optimizer:
      del _OWNERS[key]
