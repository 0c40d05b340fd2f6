"""Flower deployment on loopback: real gRPC clients, aggregation through the DPQuery ledger."""

import math
import warnings

import dp_accounting as dpa
import numpy as np
import pytest

from tf_dpiter import accounting
from tf_dpiter import dp_query as dpq
from tf_dpiter import federated as F

# flwr comes with the `test` extra: a missing or broken install must fail, not skip.
from tf_dpiter.federated import flower as FL

from .fed_helpers import plain_fedavg


def _setup(tiny, k):
  model, x, y = tiny
  fd = F.partition_iid(x, y, k, examples_per_client=20, seed=0)
  clients = [FL.DPFlowerClient(model, *fd.client_examples(i), epochs=1, batch_size=20,
                               learning_rate=0.2, seed=i) for i in range(k)]
  return model, fd, clients


def test_flower_noise_free_full_participation_is_plain_fedavg(tiny):
  model, fd, clients = _setup(tiny, 3)
  w0 = model.init_params(seed=1)
  q = dpq.GaussianSumQuery(math.inf, 0.0, seed=0)
  strat = FL.DPFedAvgStrategy(model, q, w0, num_clients=3, clients_per_round=3,
                              fit_config=dict(epochs=1, batch_size=20, lr=0.2), seed=0)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    FL.run_loopback(strat, clients, num_rounds=2)
  assert [r["returned"] for r in strat.rounds] == [3, 3]
  w = plain_fedavg(model, fd, w0, rounds=2, clients=range(3), denominator=3)
  got = [p.numpy() for p in model.unflatten(strat.server.weights)]
  for a, b in zip(got, w):
    np.testing.assert_allclose(a, b.numpy(), rtol=1e-4, atol=1e-6)


def test_flower_epsilon_from_ledger_equals_dp_accounting(tiny):
  model, _, clients = _setup(tiny, 4)
  k, m, z, rounds, delta = 4, 2, 1.3, 2, 1e-5
  q = dpq.GaussianSumQuery(0.5, z * 0.5, seed=0)
  strat = FL.DPFedAvgStrategy(model, q, model.init_params(seed=0), num_clients=k,
                              clients_per_round=m, fixed_delta=delta, seed=0,
                              fit_config=dict(epochs=1, batch_size=10, lr=0.1))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    FL.run_loopback(strat, clients, num_rounds=rounds)
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  acc.compose(dpa.SelfComposedDpEvent(
      dpa.SampledWithoutReplacementDpEvent(k, m, dpa.GaussianDpEvent(z / 2)), rounds))  # replace one client: 2S
  expected = acc.get_epsilon(delta)
  assert int(strat.ledger.sample_count) == rounds
  assert strat.rounds[-1]["epsilon"] == pytest.approx(expected, rel=1e-6)
  assert accounting.epsilon(strat.ledger, delta) == pytest.approx(expected, rel=1e-6)
  samples, _ = strat.ledger.get_arrays()
  np.testing.assert_allclose(samples[:, 0], k)     # population = connected Flower clients
  np.testing.assert_allclose(samples[:, 2], m)     # sample size = clients per round


def test_flower_client_without_data_is_an_error(tiny):
  with pytest.raises(ValueError, match="x:"):
    FL.DPFlowerClient(tiny[0], np.zeros((0, 12)), np.zeros((0,)))


def test_flower_rejects_bad_update_shape(tiny):
  model, _, _ = _setup(tiny, 2)
  strat = FL.DPFedAvgStrategy(model, dpq.GaussianSumQuery(1.0, 0.0, seed=0),
                              model.init_params(seed=0), num_clients=2, clients_per_round=2)
  assert strat._dp.record([np.zeros((3, 3))]) is None                     # wrong shapes
  good = [np.zeros(s, np.float32) for s in model.shapes]
  assert strat._dp.record(good).shape == (model.num_params,)


def test_flower_failures_and_nonfinite_updates_rejected_and_counted(tiny):
  from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
  model, _, _ = _setup(tiny, 3)
  w0 = model.init_params(seed=0)
  strat = FL.DPFedAvgStrategy(model, dpq.GaussianSumQuery(math.inf, 0.0, seed=0), w0,
                              num_clients=3, clients_per_round=3)
  assert sorted(strat._dp.sample(1, ["a", "b", "c"])) == ["a", "b", "c"]   # m = K = 3
  ok = [np.full(s, 0.5, np.float32) for s in model.shapes]
  nan = [np.full(s, np.nan, np.float32) for s in model.shapes]
  res = lambda arrs: FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrs), 20, {})
  proxy = lambda cid: type("Proxy", (), {"cid": cid})()
  _, metrics = strat.aggregate_fit(1, [(proxy("a"), res(ok)), (proxy("b"), res(nan))],
                                   [RuntimeError()])
  assert metrics["rejected"] == 2 and metrics["returned"] == 2
  got = [p.numpy() for p in model.unflatten(strat.server.weights)]
  for g, p in zip(got, w0):                      # only the good update, divided by m = 3
    np.testing.assert_allclose(g, p + 0.5 / 3, rtol=1e-5)
