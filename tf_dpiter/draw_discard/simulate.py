"""Vectorized Draw and Discard simulations (Sections III-D1, IV-D, V).

`train` streams clients through a DrawDiscardServer with the client step of Algorithm 1.
`variance_trajectory` and `survival_share` check Theorem 1 and Lemma 2 on pure noise.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from tf_dpiter import validation
from tf_dpiter.draw_discard import calibration
from tf_dpiter.draw_discard import client as client_lib
from tf_dpiter.draw_discard import server as server_lib


def assign_clients(num_records: int, records_per_client: int,
                   rng: np.random.Generator) -> np.ndarray:
  """Random partition of record indices into clients of N_c records: [num_clients, N_c].

  Args:
    num_records: N.
    records_per_client: N_c (>= 1); the remainder of N / N_c is left out.
    rng: the generator.

  Returns:
    [N // N_c, N_c] int indices.

  Raises:
    ParameterValueError: for records_per_client < 1.
  """
  validation.check_integer("records_per_client", records_per_client, 1)
  n_clients = num_records // records_per_client
  perm = rng.permutation(num_records)[: n_clients * records_per_client]
  return perm.reshape(n_clients, records_per_client)


def make_server(k: int, num_weights: int, *, strategy: str = "draw_discard", gamma: float,
                epsilon: float | None, clip: float = 1.0, noise: str = "laplace",
                init_epsilon: float = 1.0, batch_size: int = 1, spam_t=None,
                rng: np.random.Generator | None = None) -> server_lib.DrawDiscardServer:
  """Server with the Section V-A start: N(0, k/2 sigma^2); sigma from init_epsilon if no noise.

  Args:
    k: number of instances.
    num_weights: p.
    strategy: one of server.STRATEGIES.
    gamma: the learning rate.
    epsilon: per-update epsilon (nats), or None.
    clip: c.
    noise: "laplace", "gaussian" or "none".
    init_epsilon: epsilon of the initial spread when there is no noise.
    batch_size: N_s for "server_batch".
    spam_t: the spam filter's t, or None.
    rng: generator.

  Returns:
    A DrawDiscardServer.
  """
  eps0 = epsilon if (epsilon is not None and noise != "none") else init_epsilon
  var = calibration.noise_std(noise if noise != "none" else "laplace", gamma, eps0, clip) ** 2
  n_inst = 1 if strategy in ("accept_1_over_k", "server_batch") else k
  std = float(np.sqrt(calibration.init_variance(n_inst, var)))
  return server_lib.DrawDiscardServer(k, num_weights, strategy=strategy, init_std=std,
                                      batch_size=batch_size, spam_t=spam_t, rng=rng)


def train(server: server_lib.DrawDiscardServer, x: np.ndarray, y: np.ndarray,
          clients: np.ndarray, *, family: str, gamma: float, epsilon: float | None,
          clip: float = 1.0, outputs: int = 1, noise: str = "laplace", passes: int = 1,
          concurrency: int = 1, rng: np.random.Generator | None = None,
          eval_fn: Callable[[server_lib.DrawDiscardServer], dict] | None = None,
          eval_every: int = 0) -> list[dict]:
  """Stream every client `passes` times (shuffled per pass) through draw -> Algorithm 1 -> discard.

  Args:
    server: the DrawDiscardServer.
    x: [N, p] features in [0, 1].
    y: [N] responses.
    clients: [num_clients, N_c] record indices.
    family: Algorithm 1's (client.client_update).
    gamma: Algorithm 1's (client.client_update).
    epsilon: Algorithm 1's (client.client_update).
    clip: Algorithm 1's (client.client_update).
    outputs: Algorithm 1's (client.client_update).
    noise: Algorithm 1's (client.client_update).
    passes: passes over the clients.
    concurrency: clients in flight at once (they all draw before any returns; 1 = the
      paper's sequential simulation). For "server_batch" a wave is the batch N_s.
    rng: generator.
    eval_fn: server -> dict of metrics, or None.
    eval_every: ingested records between evaluations ("sample size", Section V-A; 0: only
      at the start and the end).

  Returns:
    The history: dicts with samples, updates, seconds and eval_fn's keys.

  Raises:
    ParameterValueError: for concurrency < 1 or a bad Algorithm 1 parameter.
  """
  rng = rng if rng is not None else np.random.default_rng()
  validation.check_integer("concurrency", concurrency, 1)
  wave = server.batch_size if server.strategy == "server_batch" else concurrency
  history = []
  samples = updates = 0
  next_eval = eval_every if eval_every else None
  t0 = time.perf_counter()
  if eval_fn is not None:
    history.append(dict(samples=0, updates=0, seconds=0.0, **eval_fn(server)))
  for _ in range(passes):
    order = rng.permutation(clients.shape[0])
    for start in range(0, len(order), wave):
      cl = clients[order[start:start + wave]]
      idx, w = server.draw(len(cl))
      new = client_lib.client_update(w, x[cl], y[cl], family=family, gamma=gamma,
                                     epsilon=epsilon, clip=clip, outputs=outputs,
                                     noise=noise, rng=rng)
      server.submit(new, idx)
      samples += cl.size
      updates += len(cl)
      if next_eval is not None and samples >= next_eval and eval_fn is not None:
        history.append(dict(samples=samples, updates=updates,
                            seconds=time.perf_counter() - t0, **eval_fn(server)))
        while next_eval <= samples:
          next_eval += eval_every
  if eval_fn is not None and (not history or history[-1]["samples"] != samples):
    history.append(dict(samples=samples, updates=updates,
                        seconds=time.perf_counter() - t0, **eval_fn(server)))
  return history


def _pure_noise_updates(inst: np.ndarray, m: int, rng: np.random.Generator, strategy: str,
                        noise: str, noise_std: float) -> None:
  """m updates of every replicate in place: inst [replicates, k, p]; the drawn instance
  plus noise replaces a uniform slot ("same_instance": the drawn one)."""
  replicates, k, num_weights = inst.shape
  r = np.arange(replicates)
  draws = rng.integers(0, k, size=(m, replicates))
  slots = draws if strategy == "same_instance" else rng.integers(0, k, size=(m, replicates))
  eps = (rng.laplace(0.0, noise_std / np.sqrt(2.0), size=(m, replicates, num_weights))
         if noise == "laplace" else rng.normal(0.0, noise_std, size=(m, replicates, num_weights)))
  for t in range(m):
    inst[r, slots[t]] = inst[r, draws[t]] + eps[t]


def variance_trajectory(k: int, noise_std: float, num_updates: int, *, replicates: int = 200,
                        num_weights: int = 4, checkpoints: int = 10, noise: str = "laplace",
                        init: str = "stabilized", strategy: str = "draw_discard",
                        rng: np.random.Generator | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
  """Intra-model variance under draw/discard with pure noise (Theorem 1).

  A variance is the ddof=1 variance over the k instances, averaged over the weights.

  Why ddof=1 (the paper: "computed with k-1"): let D = E(B_a - B_b)^2 for a != b at
  stationarity. One update changes the sum of the k(k-1)/2 pairwise squares by (k-1)sigma^2
  when the drawn slot is overwritten (prob. 1/k) and by (k-1)sigma^2 - D otherwise; zero
  expected change gives D = k sigma^2, and E s^2 = D/2 = k/2 sigma^2 (our derivation,
  agreeing with Theorem 1).

  Args:
    k: number of instances (>= 2).
    noise_std: per-update noise std sigma (weight units).
    num_updates: updates per replicate.
    replicates: independent servers (vectorized).
    num_weights: weights per server.
    checkpoints: evenly spaced points where the variance is recorded.
    noise: "laplace" or anything else for Gaussian.
    init: "stabilized" (N(0, k/2 sigma^2)) or "zero" (all instances equal).
    strategy: "draw_discard" (Algorithm 2) or "same_instance" (write back to the drawn
      slot: k independent random walks, the diverging right panel of Figure 1).
    rng: generator.

  Returns:
    (steps [checkpoints], variances [checkpoints, replicates]).

  Raises:
    ParameterValueError: for k < 2 or an unknown strategy.
  """
  rng = rng if rng is not None else np.random.default_rng()
  validation.check_integer("k", k, 2)   # an intra-model variance needs two instances
  validation.check_one_of("strategy", strategy, ("draw_discard", "same_instance"))
  sd0 = np.sqrt(0.5 * k) * noise_std if init == "stabilized" else 0.0
  inst = sd0 * rng.standard_normal((replicates, k, num_weights))
  steps = np.linspace(num_updates / checkpoints, num_updates, checkpoints).astype(int)
  out = np.zeros((checkpoints, replicates))
  chunk = 1000
  c = 0
  done = 0
  while done < num_updates:
    m = min(chunk, num_updates - done, steps[c] - done) if c < checkpoints else chunk
    _pure_noise_updates(inst, m, rng, strategy, noise, noise_std)
    done += m
    if c < checkpoints and done == steps[c]:
      out[c] = inst.var(axis=1, ddof=1).mean(axis=-1)
      c += 1
  return steps, out


def survival_share(k: int, num_tracked: int, *, rng: np.random.Generator | None = None,
                   max_steps: int = 10_000_000) -> float:
  """Share of updates whose descendants take over all k instances (Lemma 2: 1/k).

  Runs Algorithm 2 and tracks `num_tracked` consecutive updates as bit columns
  (instance j descends from update m); each update's fate is settled when its column is
  all ones (survives) or all zeros (discarded).

  Args:
    k: number of instances (>= 1).
    num_tracked: updates tracked.
    rng: generator.
    max_steps: stop after this many updates even if some fates are unsettled.

  Returns:
    The share of tracked updates that survived (expected 1/k).

  Raises:
    ParameterValueError: for k < 1.
  """
  rng = rng if rng is not None else np.random.default_rng()
  validation.check_integer("k", k, 1)
  if k == 1:
    return 1.0
  desc = np.zeros((k, num_tracked), dtype=bool)
  steps = 0
  # Place the tracked updates one per step; the drawn instance is the pre-image.
  for m in range(num_tracked):
    i, j = rng.integers(0, k, size=2)
    row = desc[i].copy()
    row[m] = True
    desc[j] = row
    steps += 1
  while steps < max_steps:
    col_sum = desc.sum(axis=0)
    if np.all((col_sum == 0) | (col_sum == k)):
      break
    draws = rng.integers(0, k, size=(1000, 2))
    for i, j in draws:
      desc[j] = desc[i]
    steps += 1000
  col_sum = desc.sum(axis=0)
  return float(np.mean(col_sum == k))
