"""Review R12 (session 43) of session 42's accounting caches (tf_dpiter.accounting.accountants:
the "rdp" accountant's per-process cache of each leaf event's RDP curve, `_leaf_rdp`, and the
"pld" accountant's cache of a Poisson subsampled Gaussian's PLD, `_subsampled_gaussian_pld`).

The claim under review: the registry's accountants state the same epsilon as dp-accounting's
RdpAccountant / PLDAccountant composed by hand on the same events, bit for bit, whatever was
composed before in the process. The caches are keyed by the event (or its noise multiplier
and sampling probability) under ==, and NumPy's float32 scalars compare equal to the Python
floats of the same value (np.float32(1.25) == 1.25), although dp-accounting computes a
float32-valued event partly in float32 (NumPy 2's promotion keeps a float32 scalar's
arithmetic with Python numbers in float32), so the two events' curves differ in their last
digits, in either direction.

Relation and unit: add or remove one example, Poisson sampling (PoissonSampledDpEvent of a
GaussianDpEvent), 1000 steps ("rdp") or 10 ("pld"), delta 1e-5; the reference is dp-accounting's own accountant on
the same (float64) event, composed by hand.
"""

import dp_accounting as dpa
import numpy as np
import pytest

from tf_dpiter.accounting import accountants

_RELATION = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE

# (sigma, q) where the float32-valued event's epsilon is BELOW the float64 one's (measured)
# and the steps: (sigma, q, steps)
_CASES = {"rdp": (1.25, 1 / 32, 1000), "pld": (2.0, 1 / 64, 10)}


def _event(sigma, q, steps):
  return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)


def _by_hand(name, event):
  acc = (dpa.rdp.RdpAccountant(neighboring_relation=_RELATION) if name == "rdp"
         else dpa.pld.PLDAccountant(_RELATION))
  return acc.compose(event).get_epsilon(1e-5)


@pytest.mark.parametrize("name", ["rdp", "pld"])
def test_a_float32_valued_event_does_not_set_the_float64_events_epsilon(name):
  """An event whose sigma and q are NumPy float32 scalars (a noise multiplier read from a TF
  variable's .numpy(), a float32 config) composed first in the process fills the cache under
  the key of the equal Python-float event; the registry's accountant then states the float64
  event at the float32 event's curve. Measured (delta 1e-5): "rdp" sigma 1.25, q 1/32, 1000
  steps: 4.704011419059053 stated against 4.704015229756545 by RdpAccountant by hand (3.8e-6
  lower); "pld" sigma 2, q 1/64, 10 steps: 0.10797932066136211 against 0.10797932066748493
  by PLDAccountant (6e-12 lower; sigma 0.5, q 0.125, 1000 steps: 162.55713203488904 against
  162.5571320428358). Tiny, but an epsilon below dp-accounting's on the same event,
  which the caches claim never to state, and its size is the float32 rounding of whatever the
  curve is. Fix: key the caches on the fields' types as well as their values (e.g.
  `_leaf_rdp(orders, relation, event, repr(event))`, NumPy 2's repr naming np.float32;
  `_subsampled_gaussian_pld(type(sigma), sigma, type(q), q, ...)`), or convert the fields to
  Python floats before keying only where dp-accounting would compute the same (it does not:
  the float32 event's own epsilon differs); patch /tmp/brief43/patches/R12-fix-1.patch."""
  accountants._leaf_rdp.cache_clear()   # pylint: disable=protected-access
  accountants._subsampled_gaussian_pld.cache_clear()   # pylint: disable=protected-access
  sigma, q, steps = _CASES[name]
  accountants.make(name, _RELATION).compose(_event(np.float32(sigma), np.float32(q), steps))
  stated = accountants.make(name, _RELATION).compose(_event(sigma, q, steps)).get_epsilon(1e-5)
  assert stated == _by_hand(name, _event(sigma, q, steps))
