"""Draw and Discard on MNIST: multinomial logistic regression (Pihur et al. 2018, Section V, Figs. 2-3).

gamma = 0.001, features in [0, 1], N_c = 10 examples per client (6,000 clients), 20 passes.
Training loss (averaged model, a fixed 10,000-record training subset) and test accuracy against the sample
size (records ingested). Panels:
  fig2 "k":     k in {1, 10, 20, 50, 100}, no client noise.
  fig2 "batch": k = 10, 20 against server batching N_s in {10, 100, 1000, 10000}.
  fig2 "eps":   k = 10, epsilon in {log 3, log 16, no noise}.
  fig3:         k = 20: Draw and Discard, 1/k accept rate, same-instance replace, and the
                two averaging strategies; k = 1 (server-side training) for reference.
  fig4 (--figure 4): the five fig3 strategies for each k in --ks (default 10 20 50 100, the
                k > 1 values of fig2), gamma = 0.0001 (10x smaller), k = 1 for reference;
                one panel per k; histories in draw_discard_mnist_fig4.json next to the plot.
Initialization N(0, k/2 sigma^2), sigma from epsilon (epsilon = 1 when no noise), as V-A.

  nice python tutorials/draw_and_discard_mnist.py --passes 20 --out benchmarks/plots
  nice python tutorials/draw_and_discard_mnist.py --figure 4 --passes 20 --out benchmarks/plots
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

from tf_dpiter.draw_discard import glm, simulate  # noqa: E402  pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MNIST = os.environ.get("TF_DPITER_MNIST",
                               os.path.join(REPO, "..", "shared", "data", "mnist.npz"))

# name -> (k, strategy, batch_size N_s, epsilon)
CONFIGS = {
    "k=1": (1, "draw_discard", 1, None),
    "k=10": (10, "draw_discard", 1, None),
    "k=20": (20, "draw_discard", 1, None),
    "k=50": (50, "draw_discard", 1, None),
    "k=100": (100, "draw_discard", 1, None),
    "Ns=10": (1, "server_batch", 10, None),
    "Ns=100": (1, "server_batch", 100, None),
    "Ns=1000": (1, "server_batch", 1000, None),
    "Ns=10000": (1, "server_batch", 10000, None),
    "k=10,eps=log3": (10, "draw_discard", 1, math.log(3)),
    "k=10,eps=log16": (10, "draw_discard", 1, math.log(16)),
    "k=20,1/k accept": (20, "accept_1_over_k", 1, None),
    "k=20,same instance": (20, "same_instance", 1, None),
    "k=20,avg draw-discard": (20, "average_draw_discard", 1, None),
    "k=20,avg same instance": (20, "average_same_instance", 1, None),
}
PANELS = {
    "k": ["k=1", "k=10", "k=20", "k=50", "k=100"],
    "batch": ["k=10", "k=20", "Ns=10", "Ns=100", "Ns=1000", "Ns=10000"],
    "eps": ["k=10", "k=10,eps=log16", "k=10,eps=log3"],
    "strategies": ["k=1", "k=20", "k=20,1/k accept", "k=20,same instance",
                   "k=20,avg draw-discard", "k=20,avg same instance"],
}

# Figure 4: the Figure 3 strategies over k. Name suffixes as in CONFIGS ("k=20,1/k accept").
FIG4_STRATEGIES = {
    "draw_discard": "",
    "accept_1_over_k": "1/k accept",
    "same_instance": "same instance",
    "average_draw_discard": "avg draw-discard",
    "average_same_instance": "avg same instance",
}
FIG4_KS = (10, 20, 50, 100)
FIG4_GAMMA = 0.0001


def config_name(k: int, strategy: str) -> str:
  suffix = FIG4_STRATEGIES[strategy]
  return f"k={k},{suffix}" if suffix else f"k={k}"


def fig4_configs(ks=FIG4_KS) -> dict:
  """k = 1 (server-side) then, for each k, the five strategies: name -> (k, strategy, 1, None)."""
  configs = {"k=1": (1, "draw_discard", 1, None)}
  for k in ks:
    for strategy in FIG4_STRATEGIES:
      configs[config_name(k, strategy)] = (k, strategy, 1, None)
  return configs


def load_mnist(path: str):
  if not os.path.exists(path):
    raise SystemExit(f"MNIST not found at {path}: pass --mnist or set TF_DPITER_MNIST")
  d = np.load(path)
  def prep(x):
    x = x.reshape(len(x), -1).astype(np.float64) / 255.0  # features in [0, 1] (Algorithm 1)
    return np.c_[np.ones(len(x)), x]
  return prep(d["x_train"]), d["y_train"].astype(np.int64), prep(d["x_test"]), d["y_test"].astype(np.int64)


def run_config(name, x, y, xt, yt, passes, gamma, n_c, seed, eval_points, configs=None):
  k, strategy, n_s, eps = (configs or CONFIGS)[name]
  rng = np.random.default_rng(seed)
  clients = simulate.assign_clients(len(y), n_c, rng)
  p = x.shape[1]
  srv = simulate.make_server(k, p * 10, strategy=strategy, gamma=gamma, epsilon=eps,
                             batch_size=n_s, rng=rng)

  sub = np.random.default_rng(1234).choice(len(y), min(10_000, len(y)), replace=False)
  xs, ys = x[sub], y[sub]

  def evaluate(s):  # training loss on a fixed 10,000-record subset (keeps evaluation cheap)
    w = glm.weights_matrix(s.average_weights(), p, 10)
    return dict(loss=glm.mean_loss("multinomial", w, xs, ys),
                accuracy=float(np.mean(glm.predict_label("multinomial", w, xt) == yt)))

  total = passes * clients.size
  t0 = time.perf_counter()
  hist = simulate.train(srv, x, y, clients, family="multinomial", gamma=gamma, epsilon=eps,
                        outputs=10, passes=passes, rng=rng, eval_fn=evaluate,
                        eval_every=max(total // eval_points, 1))
  secs = time.perf_counter() - t0
  m = srv.metrics()
  print(f"{name:24s} loss {hist[-1]['loss']:.4f} acc {hist[-1]['accuracy']:.4f} "
        f"updates {hist[-1]['updates']} accepted {m.get('accepted', 0)} "
        f"({hist[-1]['updates'] / secs:.0f} updates/s, {secs:.0f}s)", flush=True)
  return dict(name=name, k=k, strategy=strategy, batch_size=n_s, epsilon=eps, gamma=gamma,
              history=hist, seconds=secs)


def plot(results, out_dir):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  by = {r["name"]: r for r in results}
  for fig_name, panels in (("fig2", ["k", "batch", "eps"]), ("fig3", ["strategies"])):
    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 7), squeeze=False)
    for j, panel in enumerate(panels):
      for name in PANELS[panel]:
        if name not in by:
          continue
        h = by[name]["history"]
        s = [e["samples"] for e in h]
        axes[0, j].plot(s, [e["loss"] for e in h], label=name)
        axes[1, j].plot(s, [e["accuracy"] for e in h], label=name)
      axes[0, j].set_title({"k": "k instances", "batch": "server batching N_s vs k",
                            "eps": "epsilon (k=10)", "strategies": "strategies (k=20)"}[panel])
      axes[0, j].set_ylabel("training loss")
      axes[1, j].set_ylabel("test accuracy")
      axes[1, j].set_xlabel("sample size (records ingested)")
      axes[1, j].set_ylim(0.5, 0.95)
      axes[0, j].legend(fontsize=7)
    fig.suptitle(f"Draw and Discard, MNIST multinomial logistic regression ({fig_name}), gamma=0.001")
    fig.tight_layout()
    path = os.path.join(out_dir, f"draw_discard_mnist_{fig_name}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print("wrote", path)


def plot_fig4(results, out_dir, gamma):
  """One column per k > 1: every strategy at that k plus k = 1 (server-side) for reference."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  ks = sorted({r["k"] for r in results if r["k"] > 1})
  ref = [r for r in results if r["k"] == 1]
  fig, axes = plt.subplots(2, len(ks), figsize=(4.5 * len(ks), 7), squeeze=False,
                           sharey="row")
  for j, k in enumerate(ks):
    for r in ref + [r for r in results if r["k"] == k]:
      label = "k=1 (server-side)" if r["k"] == 1 else (FIG4_STRATEGIES[r["strategy"]]
                                                        or "draw-discard")
      style = dict(color="black", ls="--") if r["k"] == 1 else {}
      s = [e["samples"] for e in r["history"]]
      axes[0, j].plot(s, [e["loss"] for e in r["history"]], label=label, **style)
      axes[1, j].plot(s, [e["accuracy"] for e in r["history"]], label=label, **style)
    axes[0, j].set_title(f"k = {k}")
    axes[1, j].set_xlabel("sample size (records ingested)")
  axes[0, 0].set_ylabel("training loss")
  axes[1, 0].set_ylabel("test accuracy")
  axes[1, 0].legend(fontsize=7, loc="lower right")
  fig.suptitle(f"Draw and Discard strategies over k, MNIST logistic regression (fig4), gamma={gamma:g}")
  fig.tight_layout()
  path = os.path.join(out_dir, "draw_discard_mnist_fig4.png")
  fig.savefig(path, dpi=90)
  plt.close(fig)
  print("wrote", path)


def main(argv=None):
  """Runs the figure's configurations and writes their plot and histories.

  Args:
    argv: the command-line arguments (default: sys.argv[1:]).
  """
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--mnist", default=DEFAULT_MNIST)
  ap.add_argument("--figure", choices=("2-3", "4"), default="2-3",
                  help="2-3: Figures 2 and 3 (CONFIGS); 4: the strategies over --ks")
  ap.add_argument("--passes", type=int, default=20)
  ap.add_argument("--gamma", type=float, default=None,
                  help=f"default 0.001 (Figures 2-3), {FIG4_GAMMA} (Figure 4)")
  ap.add_argument("--ks", type=int, nargs="+", default=list(FIG4_KS), help="Figure 4 k values")
  ap.add_argument("--records-per-client", type=int, default=10)
  ap.add_argument("--configs", nargs="*", default=None,
                  help=f"subset of the figure's configs (default all); Figures 2-3: {list(CONFIGS)}")
  ap.add_argument("--eval-points", type=int, default=60)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "plots"))
  ap.add_argument("--json", default=None, help="write the histories here (Figure 4 default: "
                  "draw_discard_mnist_fig4.json in --out)")
  args = ap.parse_args(argv)
  fig4 = args.figure == "4"
  configs = fig4_configs(args.ks) if fig4 else CONFIGS
  gamma = args.gamma if args.gamma is not None else (FIG4_GAMMA if fig4 else 0.001)
  json_path = args.json or (os.path.join(args.out, "draw_discard_mnist_fig4.json") if fig4 else None)
  x, y, xt, yt = load_mnist(args.mnist)
  os.makedirs(args.out, exist_ok=True)
  results = []
  for name in (args.configs if args.configs is not None else list(configs)):
    results.append(run_config(name, x, y, xt, yt, args.passes, gamma,
                              args.records_per_client, args.seed, args.eval_points, configs))
    if json_path:
      with open(json_path, "w") as f:
        json.dump(results, f)
  if fig4:
    plot_fig4(results, args.out, gamma)
  else:
    plot(results, args.out)
  print("\n| config | final loss | final test accuracy | accuracy at 1/4 | updates/s |")
  print("|---|---|---|---|---|")
  for r in results:
    h = r["history"]
    q = h[len(h) // 4]
    print(f"| {r['name']} | {h[-1]['loss']:.4f} | {h[-1]['accuracy']:.4f} | {q['accuracy']:.4f} "
          f"| {h[-1]['updates'] / r['seconds']:.0f} |")


if __name__ == "__main__":
  main()
