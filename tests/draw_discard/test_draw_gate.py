"""Draw privacy at low traffic (issue 39, finding 8): a tracker that keeps every instance it
is served cannot recover a victim's step by differencing two served instances.

Loopback only: the victims are many source addresses in 127.0.0.0/8, one /24 each (tokens
off: one identity each); bounded in count (<= 40 victim updates, 30 tracker draws each).
"""

import itertools

import numpy as np
import pytest

from tf_dpiter.draw_discard import cli, draw_gate, service
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.errors import ParameterValueError
from tests.draw_discard import loopback

SPEC = cli.dense_spec(9, epsilon=1.0, gamma=0.01)


def _recovered(seen, steps):
  """Victim steps d for which two served instances differ by exactly d."""
  vals = np.array(list(seen.values()))
  diffs = (vals[:, None, :] - vals[None, :, :]).reshape(-1, vals.shape[1])
  return sum(bool(np.any(np.all(np.abs(diffs - d) <= 1e-9 * (1 + np.abs(d)), axis=1)))
             for d in steps)


def _track(svc, start_service, victims=12, draws=30):
  srv = start_service(svc)
  rng, seen, steps = np.random.default_rng(3), {}, []
  with loopback.BoundClient(srv.url, "127.12.0.1") as tracker:
    def watch():
      for _ in range(draws):
        w = tracker.draw().weights
        seen[w.tobytes()] = w
    watch()
    for i in range(victims):
      with loopback.BoundClient(srv.url, loopback.prefix_source(i, first=30)) as v:
        ok, code, drawn, u = loopback.honest_submit(v, rng)
        assert ok, code
        steps.append(u - drawn.weights)
      watch()
  return _recovered(seen, steps), len(seen)


def test_tracker_recovers_no_step_with_the_gate(start_service):
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0)
  recovered, distinct = _track(svc, start_service, victims=40)
  assert recovered == 0
  assert distinct > 4  # values did move on: some were served fresh (simulated: by the 25th
  # update in 99.9 % of runs at k = m = 4)
  assert svc.metrics.render().count("draws_stale_total") >= 1


def test_without_the_gate_the_tracker_recovers_steps(start_service):
  """The audit's attack, reproduced with m = 1 (Algorithm 2's draws)."""
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0, draw_min_updates=1)
  recovered, _ = _track(svc, start_service)
  assert recovered >= 9  # of 12


class _Snap:
  def __init__(self, slots, seq):
    self.slots, self.seq = slots, seq


@pytest.mark.parametrize("m", [2, 3, 5])
def test_served_values_are_m_updates_apart(m):
  """Simulated rebased lineage: no two served values differ by a single update's step."""
  k, rng, gate = 4, np.random.default_rng(m), draw_gate.DrawGate(4, m)
  slots, seq, served, steps = rng.normal(size=(k, 6)), 0, {}, []
  for _ in range(400):
    snap = _Snap(slots.copy(), seq)
    for _ in range(3):
      w, _ = gate.draw(snap)
      served[w.tobytes()] = w
    q, r, d = rng.integers(k), rng.integers(k), rng.normal(size=6)
    steps.append(d)
    node = gate.pending(r, slots[q] + d, gate.parent(snap, q))
    slots[r] = slots[q] + d
    seq += 1
    gate.written(r, node, seq)
  assert len(served) > 20  # values keep moving
  assert _recovered(served, steps) == 0
  gate1 = draw_gate.DrawGate(4, 1)  # m = 1: Algorithm 2, every draw fresh
  assert not gate1.draw(snap)[1]


def test_gate_arguments_are_checked():
  with pytest.raises(ParameterValueError, match="draw_min_updates"):
    draw_gate.DrawGate(4, 0)
  with pytest.raises(ParameterValueError, match="k"):
    draw_gate.DrawGate(1, 2)
