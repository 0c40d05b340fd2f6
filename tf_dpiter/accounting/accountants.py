"""The accountant registry: a name -> a factory of dp-accounting accountants.

"rdp" (`RdpAccountant`) and "pld" (`PLDAccountant`) are registered at import. A registered
accountant's epsilon is an upper bound (Mironov, "Renyi Differential Privacy", Proposition 3;
PLD's pessimistic discretization); the GDP approximation is not registered.

The "rdp" accountant computes each elementary event's RDP curve once per process
(`rdp_accountant_class`): RDP composes additively (Mironov, "Renyi Differential Privacy",
Proposition 1), so dp-accounting's RdpAccountant charges a leaf event composed `count` times
as count times its curve; the curve of the same event at the same orders and relation is the
same numbers, whatever it is composed with. A budget search or an epsilon per epoch then
pays the curve once, not once per candidate step count. The "pld" accountant likewise builds
the privacy loss distribution of a Poisson subsampled Gaussian once per (sigma, q, relation,
discretization) (`pld_accountant_class`): the k-fold composition of a mechanism is the
k-fold self-convolution of its PLD (Koskela, Jalko and Honkela, "Computing Tight Differential
Privacy Guarantees Using FFT"), which dp-accounting computes from that one PLD.
"""

import dataclasses
import functools
from typing import Callable

from tf_dpiter import validation
from tf_dpiter.accounting.lazy_module import LazyModule
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import PrivacyConfigError

dpa = LazyModule("dp_accounting")

# The dp-accounting event families a registered accountant reads: the ledger's events are
# built for one of them (e.g. truncated Poisson sampling has a PLD event only; a private
# selection an RDP one).
EVENT_FAMILIES = ("rdp", "pld")


@dataclasses.dataclass(frozen=True)
class RegisteredAccountant:
  """One registered accountant (final).

  Attributes:
    name: the name callers pass as `accountant=`.
    factory: neighboring_relation -> a fresh dp-accounting PrivacyAccountant.
    events: the event family ("rdp" or "pld") the ledger's events are built for.
    description: one line for the report's assumptions (what it is, its parameters).
  """
  name: str
  factory: Callable
  events: str
  description: str


_REGISTRY = {}
_BUILT_IN = ("rdp", "pld")


def register_accountant(name, factory, events="rdp", description=None):
  """Registers an accountant under `name`.

  Args:
    name: a new name (str, not "gdp" or "prv", which `privacy_report` reserves).
    factory: a callable taking one argument, the dp-accounting NeighboringRelation, and
      returning a fresh dp-accounting PrivacyAccountant (e.g.
      `lambda r: dp_accounting.rdp.RdpAccountant(orders, neighboring_relation=r)`).
    events: "rdp" or "pld": the event family it reads (as dp-accounting's RdpAccountant or
      PLDAccountant).
    description: one line stating the accountant for the report (default: its name).

  Returns:
    the RegisteredAccountant.

  Raises:
    ParameterTypeError: a name that is not a str, or a factory that is not callable.
    PrivacyConfigError: a name already registered or reserved, or an unknown event family.
  """
  if not isinstance(name, str) or not name:
    raise ParameterTypeError(f"`name` must be a non-empty str. Received: name={name!r}")
  if name in _REGISTRY or name in ("gdp", "prv"):
    raise PrivacyConfigError(f"`name` must not be registered or reserved yet ({accountant_names()}"
                             f", 'gdp', 'prv'); `unregister_accountant` a registered one first. "
                             f"Received: name={name!r}")
  validation.check_params({"factory": validation.Callable()}, {"factory": factory})
  if events not in EVENT_FAMILIES:
    raise PrivacyConfigError(f"`events` must be one of {EVENT_FAMILIES}. Received: "
                             f"events={events!r}")
  entry = RegisteredAccountant(name, factory, events, description or f"{name} accountant")
  _REGISTRY[name] = entry
  return entry


def unregister_accountant(name):
  """Removes a registered accountant (the built-in "rdp" and "pld" stay).

  Args:
    name: a registered name other than "rdp" and "pld".

  Returns:
    the RegisteredAccountant removed.

  Raises:
    PrivacyConfigError: an unknown or built-in name.
  """
  get_accountant(name)
  if name in _BUILT_IN:
    raise PrivacyConfigError(f"`name` must not be a built-in accountant {_BUILT_IN}. Received: "
                             f"name={name!r}")
  return _REGISTRY.pop(name)


def accountant_names():
  """The registered accountant names, built-in first (a tuple of str)."""
  return tuple(_REGISTRY)


def get_accountant(name):
  """The RegisteredAccountant of a registered name.

  Raises:
    PrivacyConfigError: an unknown name.
  """
  if not isinstance(name, str) or name not in _REGISTRY:
    raise PrivacyConfigError(f"`accountant` must be one of {accountant_names()}. Received: "
                             f"accountant={name!r}")
  return _REGISTRY[name]


def event_family(name):
  """The event family ("rdp" or "pld") the ledger's events are built for under a registered
  accountant `name`; any other name unchanged (e.g. "gdp")."""
  entry = _REGISTRY.get(name) if isinstance(name, str) else None
  return entry.events if entry is not None else name


def _composition(event):
  """Whether dp-accounting's RdpAccountant walks `event` (a composition, NoOp or NonPrivate)
  instead of charging it as count times one RDP curve of its own."""
  return isinstance(event, (dpa.ComposedDpEvent, dpa.SelfComposedDpEvent, dpa.NoOpDpEvent,
                            dpa.NonPrivateDpEvent))


def _hashable(event):
  """Whether `event` can key the curve cache (dp-accounting's events are frozen attrs classes;
  one holding a list, e.g. a tree aggregation's step counts, is not hashable)."""
  try:
    hash(event)
  except TypeError:
    return False
  return True


@functools.lru_cache(maxsize=4096)
def _leaf_rdp(orders, relation, event, spelled):
  """The RDP curve of one `event` composed once, by dp-accounting's RdpAccountant at `orders`
  (a tuple) under `relation`: a read-only float64 array. `spelled` is repr(event), which names
  its fields' types (NumPy 2 spells np.float32(1.25)): an event of float32 fields equals one
  of the same Python floats under ==, but dp-accounting computes it partly in float32."""
  curve = dpa.rdp.RdpAccountant(orders, neighboring_relation=relation).compose(event).rdp
  curve.setflags(write=False)
  return curve


@functools.lru_cache(maxsize=None)
def rdp_accountant_class():
  """dp-accounting's RdpAccountant with each leaf event's RDP curve cached (module docstring).

  The same numbers as RdpAccountant, bit for bit: a leaf composed `count` times adds
  `count * curve` to the accountant's curve, as RdpAccountant's own `_maybe_compose` does;
  the compositions, unsupported events (its error, unchanged) and events that cannot key a
  cache go through RdpAccountant itself.

  Returns:
    the class (a subclass of `dp_accounting.rdp.RdpAccountant`, made on first use so that
    dp-accounting is imported lazily).
  """

  class CachedRdpAccountant(dpa.rdp.RdpAccountant):
    """RdpAccountant whose leaf events' RDP curves come from a per-process cache."""

    def _maybe_compose(self, event, count, do_compose):
      if not do_compose or _composition(event) or not _hashable(event):
        return super()._maybe_compose(event, count, do_compose)
      error = super()._maybe_compose(event, count, False)
      if error is None:
        self._rdp += count * _leaf_rdp(tuple(self.orders.tolist()),
                                       self.neighboring_relation, event, repr(event))
      return error

  return CachedRdpAccountant


@functools.lru_cache(maxsize=256)
def _subsampled_gaussian_pld(noise_multiplier, sampling_probability, relation, interval,
                             types=None):
  """dp-accounting's PLD of one Poisson subsampled Gaussian step, as PLDAccountant builds it
  (its pessimistic estimate at `interval`); dp-accounting's PLDs are not changed by their
  compositions (each returns a new one). `types`: the two parameters' types, part of the key
  (np.float32(2.0) == 2.0, but dp-accounting computes a float32 parameter partly in
  float32)."""
  return dpa.pld.privacy_loss_distribution.from_gaussian_mechanism(
      standard_deviation=noise_multiplier, value_discretization_interval=interval,
      sampling_prob=sampling_probability, neighboring_relation=relation)


@functools.lru_cache(maxsize=None)
def pld_accountant_class():
  """dp-accounting's PLDAccountant with the PLD of a Poisson subsampled Gaussian cached
  (module docstring): the same numbers, its `count`-fold self-composition composed into the
  accountant's PLD as PLDAccountant does; every other event goes through PLDAccountant.

  Returns:
    the class (a subclass of `dp_accounting.pld.PLDAccountant`, made on first use).
  """

  class CachedPldAccountant(dpa.pld.PLDAccountant):
    """PLDAccountant whose subsampled Gaussian PLDs come from a per-process cache."""

    def _maybe_compose(self, event, count, do_compose):
      if not (do_compose and isinstance(event, dpa.PoissonSampledDpEvent)
              and isinstance(event.event, dpa.GaussianDpEvent)
              and event.sampling_probability != 0 and event.event.noise_multiplier != 0
              and _hashable(event)):
        return super()._maybe_compose(event, count, do_compose)
      sigma, q = event.event.noise_multiplier, event.sampling_probability
      leaf = _subsampled_gaussian_pld(sigma, q, self.neighboring_relation,
                                      self._value_discretization_interval,
                                      (type(sigma), type(q)))
      self._pld = self._pld.compose(leaf.self_compose(count))
      return None

  return CachedPldAccountant


def make(name, neighboring_relation):
  """A fresh dp-accounting PrivacyAccountant of a registered name, from its factory, for the
  ledger's dp-accounting NeighboringRelation.

  Raises:
    PrivacyConfigError: an unknown name, or a factory that returned no PrivacyAccountant.
  """
  acc = get_accountant(name).factory(neighboring_relation)
  if not isinstance(acc, dpa.PrivacyAccountant):
    raise PrivacyConfigError(f"the factory of accountant {name!r} must return a dp-accounting "
                             f"PrivacyAccountant. Received: {type(acc).__name__}")
  return acc


register_accountant("rdp", lambda r: rdp_accountant_class()(neighboring_relation=r), "rdp",
                    "RDP accountant (dp-accounting RdpAccountant, default orders)")
register_accountant("pld", lambda r: pld_accountant_class()(neighboring_relation=r), "pld",
                    "PLD accountant (dp-accounting PLDAccountant, default discretization)")
