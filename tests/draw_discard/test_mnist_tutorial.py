"""tutorials/draw_and_discard_mnist.py: the Figure 4 configs, and --figure 4 end to end on a
small synthetic MNIST-layout npz."""

import importlib.util
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tutorials", "draw_and_discard_mnist.py")


def _tutorial():
  spec = importlib.util.spec_from_file_location("draw_and_discard_mnist", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_fig4_configs_cover_every_strategy_and_k():
  t = _tutorial()
  cfg = t.fig4_configs()
  assert cfg["k=1"] == (1, "draw_discard", 1, None)
  assert len(cfg) == 1 + len(t.FIG4_KS) * 5
  assert {(k, s) for k, s, _, _ in cfg.values()} == (
      {(1, "draw_discard")} | {(k, s) for k in t.FIG4_KS for s in t.FIG4_STRATEGIES})
  assert all(n_s == 1 and eps is None for _, _, n_s, eps in cfg.values())
  assert cfg["k=50,1/k accept"] == (50, "accept_1_over_k", 1, None)


def test_fig4_names_agree_with_figure_3():
  t = _tutorial()  # k = 20 generates exactly the Figure 3 panel (same names and configs)
  cfg = t.fig4_configs((20,))
  assert list(cfg) == t.PANELS["strategies"]
  assert all(t.CONFIGS[name] == c for name, c in cfg.items())


def test_figure4_runs_end_to_end(tmp_path):
  rng = np.random.RandomState(0)
  path = os.path.join(tmp_path, "mnist_small.npz")
  y_tr = rng.randint(0, 10, 400).astype("uint8")
  x_tr = (rng.rand(400, 28, 28) * 60 + y_tr[:, None, None] * 19).astype("uint8")
  y_te = rng.randint(0, 10, 100).astype("uint8")
  x_te = (rng.rand(100, 28, 28) * 60 + y_te[:, None, None] * 19).astype("uint8")
  np.savez(path, x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)
  _tutorial().main(["--figure", "4", "--ks", "2", "3", "--passes", "1", "--eval-points", "4",
                    "--mnist", path, "--out", str(tmp_path)])   # in process
  assert os.path.exists(os.path.join(tmp_path, "draw_discard_mnist_fig4.png"))
  assert not os.path.exists(os.path.join(tmp_path, "draw_discard_mnist_fig2.png"))
  with open(os.path.join(tmp_path, "draw_discard_mnist_fig4.json")) as f:
    results = json.load(f)
  assert [r["name"] for r in results][:3] == ["k=1", "k=2", "k=2,1/k accept"]
  assert len(results) == 11 and all(r["gamma"] == 0.0001 for r in results)
  assert all(r["history"][-1]["updates"] == 40 for r in results)
