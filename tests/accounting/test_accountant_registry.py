"""An accountant registered from a test file is used by the callbacks and the command line.

`register_accountant(name, factory)` is the one place an accountant is added: the fixture
below wraps dp-accounting's RDP accountant over a short list of orders (a coarser, still
valid upper bound: epsilon is the minimum over the orders of Mironov's conversion, "Renyi
Differential Privacy", Proposition 3, so fewer orders give an epsilon >= the default's) and
touches no package file. Relation: add or remove one example (Poisson sampling).
"""

import contextlib
import io
import json

import dp_accounting as dpa
import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import accounting
from tf_dpiter.accounting import accountants
from tf_dpiter.accounting import cli
from tf_dpiter.errors import PrivacyConfigError

NAME = "rdp_coarse_orders"
ORDERS = (2.0, 4.0, 8.0, 16.0, 32.0)
N, BATCH, Z, DELTA = 64, 16, 1.0, 1e-5


@pytest.fixture
def coarse_rdp():
  entry = accounting.register_accountant(
      NAME, lambda relation: dpa.rdp.RdpAccountant(ORDERS, neighboring_relation=relation),
      description=f"RDP accountant over the orders {ORDERS}")
  yield entry
  accounting.unregister_accountant(NAME)


def _hand_epsilon(q, z, steps, orders):
  event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
  return dpa.rdp.RdpAccountant(orders).compose(event).get_epsilon(DELTA)


def _ledger_dict(steps, q=BATCH / N):
  samples = np.array([[N, q, BATCH, 0, 1, 1]] * steps, np.float64)   # code 0: poisson
  queries = np.array([[i, 0, 1.0, Z, 1.0] for i in range(steps)], np.float64)
  return dp.ledger.ledger_file.arrays_to_dict(samples, queries)


def test_the_registry_resolves_the_name_everywhere_in_accounting(coarse_rdp):
  assert NAME in accounting.accountant_names() and coarse_rdp.events == "rdp"
  # the ledger's events are built for the accountant's family; "gdp" is not registered
  assert accountants.event_family(NAME) == "rdp" and accountants.event_family("pld") == "pld"
  assert accountants.event_family("gdp") == "gdp"
  d = _ledger_dict(8)
  got = accounting.privacy_report(d, delta=DELTA, accountant=NAME)
  want = _hand_epsilon(BATCH / N, Z, 8, ORDERS)
  assert got.epsilon == pytest.approx(want, rel=1e-9)
  assert f"RDP accountant over the orders {ORDERS}" in got.assumptions
  # coarser orders: a valid bound at least the default's
  assert got.epsilon >= accounting.epsilon(d, DELTA, accountant="rdp")
  # budgets and calibration take it (an upper bound), the GDP approximation stays refused
  z = accounting.calibrate_noise_multiplier(2.0, DELTA, BATCH / N, 8, accountant=NAME)
  assert _hand_epsilon(BATCH / N, z, 8, ORDERS) <= 2.0 + 1e-6
  assert accounting.accountant.check_bound_accountant(NAME, "a test") == NAME


def test_a_registered_accountant_is_a_command_line_choice(coarse_rdp, tmp_path):
  path = tmp_path / "ledger.json"
  path.write_text(json.dumps(_ledger_dict(8)))
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    status = cli.dp_ledger_main(["report", str(path), "--delta", str(DELTA), "--accountant", NAME])
  assert status == 0
  assert f"{_hand_epsilon(BATCH / N, Z, 8, ORDERS):.4g}" in out.getvalue()
  assert NAME in cli.cli_accountants()
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    status = cli.compute_dp_sgd_privacy_main([
        "--N", str(N), "--batch_size", str(BATCH), "--noise_multiplier", str(Z),
        "--epochs", "2", "--delta", str(DELTA), "--accountant", NAME])
  assert status == 0
  want = _hand_epsilon(BATCH / N, Z, 2 * N // BATCH, ORDERS)
  assert f"epsilon = {want:.6g}" in out.getvalue()


def test_an_unregistered_name_is_refused_by_the_command_line():
  err = io.StringIO()
  with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
    cli.dp_ledger_main(["report", "x.json", "--delta", "1e-5", "--accountant", NAME])
  assert "invalid choice" in err.getvalue()
  with pytest.raises(PrivacyConfigError, match=r"accountant`? must be one of"):
    accounting.epsilon(_ledger_dict(2), DELTA, accountant=NAME)


def test_a_registered_accountant_drives_the_privacy_meter(coarse_rdp):
  rng = np.random.RandomState(0)
  x, y = rng.randn(N, 6).astype("float32"), rng.randint(0, 3, N)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, Z, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  meter = dp.keras.PrivacyMeter(DELTA, accountant=NAME)
  history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[meter])
  steps = int(model.ledger.sample_count.numpy())
  assert steps == N // BATCH
  assert history.history["epsilon"] == [pytest.approx(_hand_epsilon(BATCH / N, Z, steps,
                                                                    ORDERS), rel=1e-9)]


def test_built_in_accountants_cannot_be_replaced_or_removed():
  with pytest.raises(PrivacyConfigError, match=r"`name` must not be registered or reserved"):
    accounting.register_accountant("rdp", lambda r: dpa.rdp.RdpAccountant(ORDERS))
  with pytest.raises(PrivacyConfigError, match=r"`name` must not be registered or reserved"):
    accounting.register_accountant("gdp", lambda r: dpa.rdp.RdpAccountant(ORDERS))
  with pytest.raises(PrivacyConfigError, match=r"built-in"):
    accounting.unregister_accountant("pld")
  with pytest.raises(PrivacyConfigError, match=r"`events` must be one of"):
    accounting.register_accountant("other", lambda r: None, events="prv")


def test_the_dp_plan_takes_a_registered_accountant(coarse_rdp):
  """`dp.keras.DPConfig(accountant=...)` accepts a registered name and its `epsilon` uses it;
  an unregistered name is refused by name and value."""
  plan = dp.keras.DPConfig(l2_norm_clip=1.0, noise_multiplier=Z, accountant=NAME)
  got = plan.epsilon(_ledger_dict(8), DELTA)
  assert got == pytest.approx(_hand_epsilon(BATCH / N, Z, 8, ORDERS), rel=1e-9)
  with pytest.raises(PrivacyConfigError, match="accountant='no_such_accountant'"):
    dp.keras.DPConfig(l2_norm_clip=1.0, noise_multiplier=Z, accountant="no_such_accountant")


def _events():
  """(relation, event) pairs covering each leaf kind the ledger builds, a mixed ledger, a
  selection over a sampled Gaussian and a tree aggregation (a list field: not cached)."""
  rel = dpa.NeighboringRelation
  poisson = lambda q, z: dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
  return [
      (rel.ADD_OR_REMOVE_ONE, poisson(0.01, 1.1)),
      (rel.ADD_OR_REMOVE_ONE, dpa.GaussianDpEvent(2.0)),
      (rel.ADD_OR_REMOVE_ONE, dpa.LaplaceDpEvent(1.5)),
      (rel.ADD_OR_REMOVE_ONE, dpa.ComposedDpEvent([
          dpa.SelfComposedDpEvent(poisson(0.02, 1.2), 5), poisson(0.05, 1.0),
          dpa.SelfComposedDpEvent(dpa.LaplaceDpEvent(3.0), 2)])),
      (rel.ADD_OR_REMOVE_ONE, dpa.dp_event.RepeatAndSelectDpEvent(poisson(0.1, 1.3), 4.0, 1)),
      (rel.REPLACE_ONE, dpa.SampledWithoutReplacementDpEvent(50, 10, dpa.GaussianDpEvent(1.0))),
      (rel.REPLACE_SPECIAL, dpa.SingleEpochTreeAggregationDpEvent(2.0, [4, 4])),
  ]


@pytest.mark.parametrize("orders", [None, ORDERS])
def test_the_rdp_accountant_caches_leaf_curves_bit_for_bit(orders):
  """The registry's "rdp" accountant (each leaf event's RDP curve computed once per process)
  gives dp-accounting's RdpAccountant's numbers exactly, for one step, a few and many, a
  mixed ledger, every relation, the default orders and others; a second composition of a
  leaf reads the cache."""
  cls = accountants.rdp_accountant_class()
  assert isinstance(accountants.make("rdp", dpa.NeighboringRelation.ADD_OR_REMOVE_ONE), cls)
  for relation, event in _events():
    for steps in (1, 7, 300):
      composed = dpa.SelfComposedDpEvent(event, steps)
      cached = cls(orders, neighboring_relation=relation).compose(composed)
      plain = dpa.rdp.RdpAccountant(orders, neighboring_relation=relation).compose(composed)
      assert np.array_equal(cached.rdp, plain.rdp), (event, steps)
      assert cached.get_epsilon(DELTA) == plain.get_epsilon(DELTA)
      assert cached.get_delta(2.0) == plain.get_delta(2.0)
  leaf = dpa.PoissonSampledDpEvent(0.03, dpa.GaussianDpEvent(0.9))
  cls(orders).compose(leaf, 3)
  before = accountants._leaf_rdp.cache_info()   # pylint: disable=protected-access
  cls(orders).compose(dpa.SelfComposedDpEvent(leaf, 11))
  after = accountants._leaf_rdp.cache_info()    # pylint: disable=protected-access
  assert (after.hits, after.misses) == (before.hits + 1, before.misses)
  # an event the relation does not support is refused as by RdpAccountant
  wrong = cls(orders, neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  assert not wrong.supports(leaf)
  assert not dpa.rdp.RdpAccountant(
      orders, neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE).supports(leaf)


def test_the_pld_accountant_caches_the_subsampled_gaussian_exactly():
  """The registry's "pld" accountant (a Poisson subsampled Gaussian's PLD built once per
  process) gives dp-accounting's PLDAccountant's epsilon and delta exactly, alone and in a
  mixed ledger, for one step, a few and many; a second composition reads the cache."""
  cls = accountants.pld_accountant_class()
  assert isinstance(accountants.make("pld", dpa.NeighboringRelation.ADD_OR_REMOVE_ONE), cls)
  step = dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.1))
  mixed = dpa.ComposedDpEvent([step, dpa.SelfComposedDpEvent(
      dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(1.3)), 4), dpa.LaplaceDpEvent(3.0)])
  for event in (step, mixed):
    for steps in (1, 7, 300):
      composed = dpa.SelfComposedDpEvent(event, steps)
      cached = cls(value_discretization_interval=1e-3).compose(composed)
      plain = dpa.pld.PLDAccountant(value_discretization_interval=1e-3).compose(composed)
      assert cached.get_epsilon(DELTA) == plain.get_epsilon(DELTA), (event, steps)
      assert cached.get_delta(1.0) == plain.get_delta(1.0), (event, steps)
  before = accountants._subsampled_gaussian_pld.cache_info()   # pylint: disable=protected-access
  cls(value_discretization_interval=1e-3).compose(step, 11)
  after = accountants._subsampled_gaussian_pld.cache_info()    # pylint: disable=protected-access
  assert (after.hits, after.misses) == (before.hits + 1, before.misses)
