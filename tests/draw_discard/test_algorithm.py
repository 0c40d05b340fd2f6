"""Algorithm 1 (client), Algorithm 2 (server), GLMs, model spec, spam filter (Pihur et al. 2018)."""

import math

import numpy as np
import pytest

from tf_dpiter.draw_discard import client, glm, privacy, server, simulate
from tf_dpiter.draw_discard.cli import known_weights_spec, dense_spec


def _data(family, m=5, n=7, p=4, c=3, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.random((m, n, p))
  outputs = c if family == "multinomial" else 1
  w = rng.normal(size=(m, p * outputs))
  if family == "multinomial":
    y = rng.integers(0, c, size=(m, n))
  elif family == "poisson":
    y = rng.poisson(1.0, size=(m, n)).astype(float)
  else:
    y = rng.integers(0, 2, size=(m, n)).astype(float)
  return w, x, y, outputs


@pytest.mark.parametrize("family", glm.FAMILIES)
def test_gradient_matches_finite_differences(family):
  w, x, y, outputs = _data(family, m=1)
  p = x.shape[-1]
  g = glm.average_gradient(family, glm.weights_matrix(w, p, outputs), x, y)[0].reshape(-1)
  h = 1e-6
  num = np.zeros_like(w[0])
  for j in range(w.shape[1]):
    e = np.zeros_like(w[0]); e[j] = h
    lp = glm.mean_loss(family, glm.weights_matrix(w[0] + e, p, outputs), x[0], y[0])
    lm = glm.mean_loss(family, glm.weights_matrix(w[0] - e, p, outputs), x[0], y[0])
    num[j] = (lp - lm) / (2 * h)
  np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", glm.FAMILIES)
@pytest.mark.parametrize("clip", [0.05, 1.0])
def test_client_update_without_noise_is_clipped_sgd_step(family, clip):
  w, x, y, outputs = _data(family)
  new = client.client_update(w, x, y, family=family, gamma=0.1, epsilon=None, clip=clip,
                             outputs=outputs)
  step = (w - new) / 0.1
  assert np.all(np.abs(step) <= clip + 1e-12)
  g = glm.average_gradient(family, glm.weights_matrix(w, x.shape[-1], outputs), x, y)
  np.testing.assert_allclose(step, np.clip(g.reshape(w.shape), -clip, clip), atol=1e-12)


@pytest.mark.parametrize("noise,eps", [("laplace", 1.0), ("laplace", math.log(3)), ("gaussian", 2.0)])
def test_client_noise_has_calibrated_variance(noise, eps):
  # 200,000 noise draws: the sample variance has relative SE ~ sqrt((kurtosis-1)/n) <= sqrt(5/2e5)
  # = 0.005; tolerance 0.03 is > 5 SE.
  gamma, clip = 0.01, 0.5
  w = np.zeros((1000, 200))
  x = np.zeros((1000, 3, 200)); y = np.zeros((1000, 3))  # zero gradient for linear
  new = client.client_update(w, x, y, family="linear", gamma=gamma, epsilon=eps, clip=clip,
                             noise=noise, rng=np.random.default_rng(1))
  want = privacy.noise_std(noise, gamma, eps, clip) ** 2
  assert abs(new.var() / want - 1) < 0.03
  if noise == "laplace":
    assert want == pytest.approx(8 * gamma**2 * clip**2 / eps**2)


def test_tf_client_matches_numpy_without_noise():
  w, x, y, outputs = _data("multinomial", m=1)
  upd = client.make_tf_client_update("multinomial", 0.05, None, clip=0.3, outputs=outputs)
  got = upd(w[0], x[0], y[0]).numpy()
  want = client.client_update(w[0], x[0], y[0], family="multinomial", gamma=0.05, epsilon=None,
                              clip=0.3, outputs=outputs)
  np.testing.assert_allclose(got, want, atol=1e-12)


def test_tf_client_laplace_variance():
  # 100,000 Laplace draws: relative SE of the variance ~ sqrt(5/1e5) = 0.007; tolerance 0.04.
  upd = client.make_tf_client_update("linear", 0.01, 1.0, clip=1.0)
  out = upd(np.zeros(100_000), np.zeros((2, 100_000)), np.zeros(2)).numpy()
  assert abs(out.var() / privacy.laplace_variance(0.01, 1.0) - 1) < 0.04


@pytest.mark.parametrize("bad", [dict(gamma=0.0), dict(epsilon=-1.0), dict(clip=0.0)])
def test_client_update_rejects_bad_parameters(bad):
  w, x, y, _ = _data("logistic")
  kw = dict(family="logistic", gamma=0.1, epsilon=1.0, clip=1.0)
  kw.update(bad)
  with pytest.raises(ValueError, match=next(iter(bad))):
    client.client_update(w, x, y, **kw)


def test_known_weights_spec_has_33_weights_and_roundtrips():
  spec = known_weights_spec()
  assert spec.num_weights == 33
  again = glm.ModelSpec.from_json(spec.to_json())
  assert again == spec
  x = spec.featurize([{"B": 1, "E1": "C", "E2": "b", "D": 1.5, "I": 4},
                      {"B": 0, "E1": "A", "E2": "a", "D": 9.0, "I": 0}])
  assert x.shape == (2, 33) and x.min() >= 0 and x.max() <= 1
  cols = spec.column_names
  assert x[0, cols.index("E1=C*E2=b")] == 1 and x[0, cols.index("D*I")] == pytest.approx(0.5)
  assert x[1, cols.index("D")] == 1.0  # clipped to [0, 1]


@pytest.mark.parametrize("bad,match", [
    (dict(family="probit"), "family"),
    (dict(crosses=(("B", "Z"),)), "unknown feature"),
    (dict(gamma=-1.0), "gamma"),
])
def test_spec_rejects_bad_values(bad, match):
  with pytest.raises(ValueError, match=match):
    known_weights_spec(**bad)


def test_spec_rejects_unknown_level():
  with pytest.raises(ValueError, match="unknown level"):
    known_weights_spec().featurize({"B": [1], "E1": ["Q"], "E2": ["a"], "D": [1.0], "I": [1]})


def test_dense_spec_weights():
  assert dense_spec(387).num_weights == 387
  assert dense_spec(50_000).num_weights == 50_000


@pytest.mark.parametrize("strategy", server.STRATEGIES)
def test_server_strategies_store_what_they_should(strategy):
  rng = np.random.default_rng(0)
  srv = server.DrawDiscardServer(5, 3, strategy=strategy, init_std=1.0, batch_size=4, rng=rng)
  before = srv.instances.copy()
  idx, w = srv.draw(4)
  assert w.shape == (4, 3)
  ok = srv.submit(w + 10.0, idx)
  after = srv.instances
  if strategy == "server_batch":
    np.testing.assert_allclose(after[0], before[0] + 10.0)  # 4 updates of the same model, averaged
  elif strategy == "accept_1_over_k":
    assert ok.sum() == int((after != before).any())
  elif strategy.startswith("average"):
    assert np.all(np.abs(after - before) <= 5.0 + 20.0)
    assert (after != before).any()
  else:
    changed = np.flatnonzero((after != before).any(axis=1))
    assert 1 <= len(changed) <= 4
    if strategy == "same_instance":
      assert set(changed) <= set(idx.tolist())
  assert srv.metrics()["draws"] == 4


def test_draw_and_replace_are_uniform():
  # 50,000 draws/replaces over k=10: each count ~ Binomial(5e4, 0.1), SD 67; tolerance 5 SD.
  rng = np.random.default_rng(3)
  srv = server.DrawDiscardServer(10, 1, rng=rng, instances=np.arange(10.0)[:, None])
  idx, _ = srv.draw(50_000)
  assert np.all(np.abs(np.bincount(idx, minlength=10) - 5000) < 5 * 67)
  srv.instances[:] = 0
  marks = np.arange(1, 50_001, dtype=float)[:, None]
  srv.submit(marks)  # replace: each slot holds the last mark written to it
  assert np.count_nonzero(srv.instances) == 10


@pytest.mark.parametrize("t", [3.0, 6.0])
def test_spam_filter_counts_rejections(t):
  rng = np.random.default_rng(0)
  srv = server.DrawDiscardServer(20, 50, init_std=1.0, spam_t=t, rng=rng)
  idx, w = srv.draw(1)
  spam = w.copy(); spam[0, 7] += 100.0
  assert not srv.submit(spam)[0]
  assert srv.submit(srv.instances.mean(axis=0))[0]
  m = srv.metrics()
  assert m["rejected_spam"] == 1 and m["accepted"] == 1


def test_spam_filter_passes_honest_noisy_updates():
  # Honest updates: a drawn instance (SD sqrt(k/2) sigma around mu) plus Laplace noise (SD sigma)
  # deviates from mu with SD sqrt(k/2+1) sigma; with t=6 and 30 weights, false rejections are
  # rare (P(|z|>6*sqrt(10/11)) ~ 3e-8 per weight for Gaussian; Laplace tails are heavier but
  # the drawn part dominates). Check <= 1% of 2000 updates.
  rng = np.random.default_rng(5)
  sd = privacy.noise_std("laplace", 0.01, 1.0)
  srv = simulate.make_server(20, 30, gamma=0.01, epsilon=1.0, spam_t=6.0, rng=rng)
  x = np.zeros((1, 1, 30)); y = np.zeros((1, 1))  # zero gradient: the update is pure noise
  for _ in range(2000):
    i, w = srv.draw(1)
    srv.submit(client.client_update(w, x, y, family="linear", gamma=0.01, epsilon=1.0, rng=rng), i)
  m = srv.metrics()
  assert m["rejected_spam"] <= 20 and m["accepted"] + m["rejected_spam"] == 2000
  assert np.isclose(srv.instances.var(axis=0, ddof=1).mean(), 10 * sd**2, rtol=0.5)


def test_predict_by_weights_and_predictions_agree_for_linear():
  rng = np.random.default_rng(0)
  srv = server.DrawDiscardServer(7, 4, init_std=1.0, rng=rng)
  x = rng.random((9, 4))
  np.testing.assert_allclose(srv.predict_mean("linear", x, mode="weights"),
                             srv.predict_mean("linear", x, mode="predictions"))
  with pytest.raises(ValueError, match="mode"):
    srv.predict_mean("linear", x, mode="median")


def test_training_recovers_logistic_weights():
  rng = np.random.default_rng(0)
  true = np.array([0.5, -1.5, 2.0])
  x = np.c_[np.ones(20000), rng.random((20000, 2))]
  y = (rng.random(20000) < 1 / (1 + np.exp(-x @ true))).astype(float)
  clients = simulate.assign_clients(len(y), 10, rng)
  srv = simulate.make_server(5, 3, gamma=0.05, epsilon=None, rng=rng)
  simulate.train(srv, x, y, clients, family="logistic", gamma=0.05, epsilon=None, passes=30,
                 concurrency=5, rng=rng)
  # SGD noise on the average of 5 instances after 60,000 updates: measured error < 0.3.
  np.testing.assert_allclose(srv.average_weights(), true, atol=0.3)


@pytest.mark.parametrize("strategy,batch,conc", [("draw_discard", 1, 8), ("server_batch", 16, 1),
                                                 ("accept_1_over_k", 1, 1)])
def test_train_counts_samples_and_updates(strategy, batch, conc):
  rng = np.random.default_rng(2)
  x = np.c_[np.ones(640), rng.random((640, 3))]
  y = rng.integers(0, 3, 640)
  clients = simulate.assign_clients(640, 10, rng)
  srv = simulate.make_server(4, 12, strategy=strategy, gamma=0.01, epsilon=1.0, batch_size=batch,
                             rng=rng)
  hist = simulate.train(srv, x, y, clients, family="multinomial", gamma=0.01, epsilon=1.0,
                        outputs=3, passes=2, concurrency=conc, rng=rng,
                        eval_fn=lambda s: {"n": s.metrics()["draws"]}, eval_every=320)
  assert hist[-1]["samples"] == 1280 and hist[-1]["updates"] == 128 and hist[-1]["n"] == 128
  assert [h["samples"] for h in hist] == [0, 320, 640, 960, 1280]
  if strategy == "server_batch":
    assert srv.metrics()["batches"] == 8
