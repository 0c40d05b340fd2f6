"""The private train step is traced once per model and reused across fit calls, and a slow
first step (tracing, graph optimization, first run) is reported by one line in the fit log
(train_step.SLOW_FIRST_STEP_SECONDS; set to 0 here so that a small model's first step counts
as slow)."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.model import train_step


def _model():
  keras.utils.set_random_seed(0)
  inp = keras.Input((6,))
  out = keras.layers.Dense(2)(keras.layers.Dense(8, activation="relu")(inp))
  model = dp.keras.DPModel(inp, out)
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


@pytest.fixture(name="data")
def _data():
  rng = np.random.RandomState(0)
  return rng.randn(64, 6).astype("float32"), rng.randint(0, 2, 64)


def test_slow_first_step_is_one_line_and_the_step_is_traced_once(data, monkeypatch, capsys):
  monkeypatch.setattr(train_step, "SLOW_FIRST_STEP_SECONDS", 0.0)
  traces = []
  original = clipping._clipped_grad_sum  # pylint: disable=protected-access
  monkeypatch.setattr(clipping, "_clipped_grad_sum",
                      lambda *a, **k: traces.append(1) or original(*a, **k))
  model = _model()
  x, y = data
  model.fit(x, y, batch_size=16, epochs=1, verbose=2)
  lines = [l for l in capsys.readouterr().out.splitlines() if "first private step took" in l]
  assert len(lines) == 1, lines
  assert "clipped sum by ghost norms" in lines[0] and "tracing" in lines[0]
  assert "batch-independence probe" in lines[0]   # the probe's seconds, apart from the trace
  model.fit(x, y, batch_size=16, epochs=1, verbose=2)   # the same model: reused, no new line
  assert not [l for l in capsys.readouterr().out.splitlines() if "first private step" in l]
  assert len(traces) == 1


def test_no_line_when_quiet_or_fast(data, monkeypatch, capsys):
  x, y = data
  monkeypatch.setattr(train_step, "SLOW_FIRST_STEP_SECONDS", 0.0)
  _model().fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert "first private step" not in capsys.readouterr().out
  monkeypatch.setattr(train_step, "SLOW_FIRST_STEP_SECONDS", 1e9)
  _model().fit(x, y, batch_size=16, epochs=1, verbose=2)
  assert "first private step" not in capsys.readouterr().out


def test_line_splits_the_probe_from_the_trace(monkeypatch):
  """The probe's seconds (in make_train_function and in the trace) are named apart; the
  trace's own seconds exclude the probes run within it; the phases add up to the total."""
  monkeypatch.setattr(train_step, "SLOW_FIRST_STEP_SECONDS", 1.0)

  class _Model:
    _dp_trace_seconds = 5.0   # of which 1.5 s were a probe run in the trace
    _dp_traced_clipping = "fast"

  line = train_step._first_step_line(_Model(), 12.0, probe_before=2.0, probe=3.5)  # pylint: disable=protected-access
  assert "took 14.0 s" in line
  assert "batch-independence probe 3.5 s, tracing 3.5 s" in line
  assert "first run 7.0 s" in line
  assert train_step._first_step_line(_Model(), 0.5, probe_before=0.4, probe=0.4) is None  # pylint: disable=protected-access
