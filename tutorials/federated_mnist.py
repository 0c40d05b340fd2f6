"""Client-level DP federated averaging on non-IID MNIST: Table 1 / Figure 2 of Geyer et al. 2017.

Each run: K clients holding 600 examples each (two label-sorted shards of 300, data points
repeated for K > 100), an MLP without bias (the paper's 784-600-100-10 by default; the
presets use 784-200-10, which fared better under DP noise), E local epochs of
SGD with batch B, and a DPQuery aggregation with the private adaptive clip
(QuantileAdaptiveClipSumQuery, target: median norm) by default. Training stops before
delta at epsilon = 8 would pass delta_0 (accountant: tf_dpiter.accounting on the ledger).

  # one preset (Table 1 rows: k100, k1000, k10000, nondp), bounded by --max-rounds
  python tutorials/federated_mnist.py run --preset k100 --out-dir /tmp/fed
  # the accuracy-per-round plot (Figure 2) from the JSON files of the runs
  python tutorials/federated_mnist.py plot /tmp/fed/*.json --png benchmarks/plots/federated_accuracy.png
  # rounds per second of the vectorized simulation
  python tutorials/federated_mnist.py bench --clients 100 --clients-per-round 100

MNIST: --data, else env TF_DPITER_MNIST, else ../shared/data/mnist.npz from the repo root.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import absl.logging  # pylint: disable=g-import-not-at-top

# dp-accounting logs one line per RDP order it drops; keep the run log readable.
absl.logging.set_verbosity(absl.logging.ERROR)


from tf_dpiter import federated as F  # pylint: disable=g-import-not-at-top

# Table 1 rows of Geyer et al. 2017 (paper: ACC, CR, CC) and the settings we found best for each
# (BENCHMARKS.md). Poisson sampling: the ledger records it; its add/remove-one RDP bound is
# tighter than fixed-size sampling's. Any flag given on the command line wins.
PRESETS = {
    "k100": dict(clients=100, delta0=1e-3, clients_per_round=100, noise_multiplier=1.65,
                 epochs=4, hidden="200", paper=(0.78, 11, 550)),
    "k1000": dict(clients=1000, delta0=1e-5, clients_per_round=300, noise_multiplier=1.62,
                  epochs=1, hidden="200", server_momentum=0.9, paper=(0.92, 54, 11880)),
    "k10000": dict(clients=10000, delta0=1e-6, clients_per_round=500, noise_multiplier=0.88,
                   epochs=1, hidden="200", server_momentum=0.9, paper=(0.96, 412, 209500)),
    "nondp": dict(clients=100, delta0=None, clients_per_round=10, noise_multiplier=0.0,
                  query="none", epochs=4, paper=(0.97, 380, 38000)),
}
# Fallbacks when neither the flag nor the preset sets them.
RUN_DEFAULTS = dict(epochs=1, hidden="600,100", server_momentum=0.0, average_decay=None)


def _add_common(p):
  p.add_argument("--data", default=None, help="path of mnist.npz")
  p.add_argument("--clients", type=int, default=None, help="K (default: preset, else 100)")
  p.add_argument("--clients-per-round", type=int, default=None, help="m (start of schedule)")
  p.add_argument("--clients-per-round-end", type=int, default=None,
                 help="m at --max-rounds (linear schedule); default: constant m")
  p.add_argument("--epochs", type=int, default=None, help="E local epochs (default: preset, else 1)")
  p.add_argument("--batch-size", type=int, default=60, help="B examples per local batch")
  p.add_argument("--lr", type=float, default=0.1, help="client SGD learning rate")
  p.add_argument("--seed", type=int, default=None, help="partition/init seed (data only)")


def _load(args):
  x, y, xt, yt = F.load_mnist(args.data)
  fd = F.partition_noniid_shards(x, y, args.clients, 2, 600, seed=0)
  return fd, (xt, yt)


def cmd_run(args):
  preset = dict(PRESETS[args.preset]) if args.preset else {}
  for k in ("clients", "clients_per_round", "noise_multiplier", "delta0", "query"):
    v = getattr(args, k, None)
    if v is not None:
      preset[k] = v
  args.clients = preset.get("clients", 100)
  for k, fallback in RUN_DEFAULTS.items():
    if getattr(args, k) is None:
      setattr(args, k, preset.get(k, fallback))
  fd, test = _load(args)
  m = preset.get("clients_per_round") or 10
  m_sched = (F.linear_schedule(m, args.clients_per_round_end, args.max_rounds, integer=True)
             if args.clients_per_round_end else m)
  z = preset.get("noise_multiplier", 1.0)
  kind = preset.get("query", "quantile")
  query = F.make_query(kind, z, m, l2_norm_clip=args.initial_clip,
                       target_unclipped_quantile=args.target_quantile,
                       clip_learning_rate=args.clip_lr)
  delta0 = preset.get("delta0")
  hidden = tuple(int(h) for h in args.hidden.split(",") if h)
  model = F.MLP((784,) + hidden + (10,), use_bias=False)
  alg = F.DPFedAvg(model, fd, query, clients_per_round=m_sched, local_epochs=args.epochs,
                   batch_size=args.batch_size, client_learning_rate=args.lr,
                   server_momentum=args.server_momentum, sampling=args.sampling,
                   fixed_epsilon=(args.epsilon if kind != "none" else None),
                   max_delta=(delta0 if kind != "none" else None),
                   eval_data=test, initial_params=model.init_params(args.seed),
                   diagnostics=True, average_decay=args.average_decay)
  t0 = time.time()

  def log(r):
    print(f"round {r.round:4d} m={r.clients:5d} acc={r.accuracy:.4f} clip={r.clip} "
          f"delta={r.delta} Vc={r.between_clients_variance:.3g} Us={r.update_scale:.3g} "
          f"rejected={r.rejected} {r.seconds:.1f}s"
          + ("" if r.average_accuracy is None else f" avg_acc={r.average_accuracy:.4f}"),
          flush=True)

  rep = alg.run(args.max_rounds, callback=log)
  wall = time.time() - t0
  print(rep)
  name = args.name or args.preset or f"k{args.clients}"
  out = dict(name=name, preset=args.preset, argv=sys.argv, clients=args.clients,
             delta0=delta0, epsilon=args.epsilon, query=kind, noise_multiplier=z,
             clients_per_round=m, epochs=args.epochs, batch_size=args.batch_size,
             lr=args.lr, sampling=args.sampling, max_rounds=args.max_rounds,
             hidden=list(hidden), target_quantile=args.target_quantile,
             paper=PRESETS.get(args.preset, {}).get("paper"),
             accuracy=rep.accuracy, average_accuracy=rep.average_accuracy,
             average_decay=args.average_decay, communication_rounds=rep.communication_rounds,
             communication_costs=rep.communication_costs, seconds=wall,
             stopped_reason=rep.stopped_reason, guarantee_holds=rep.guarantee_holds,
             privacy_statement=rep.privacy_statement, warnings=list(rep.warnings),
             rounds=[dataclasses.asdict(r) for r in rep.rounds])
  if args.out_dir:
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{name}.json")
    with open(path, "w") as f:
      json.dump(out, f, indent=1)
    alg.ledger.save_json(os.path.join(args.out_dir, f"{name}.ledger.json"))
    print("wrote", path)


def cmd_plot(args):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for path in args.files:
    with open(path) as f:
      run = json.load(f)
    rounds = [r["round"] for r in run["rounds"] if r["accuracy"] is not None]
    accs = [r["accuracy"] for r in run["rounds"] if r["accuracy"] is not None]
    if run["delta0"]:
      label = f"K={run['clients']}, m={run['clients_per_round']}, delta0={run['delta0']:g}"
    else:
      label = f"K={run['clients']}, m={run['clients_per_round']}, non-DP"
    label += f", E={run['epochs']}"
    line, = ax.plot(rounds, accs, label=label)
    if run["stopped_reason"].startswith("privacy budget") and rounds:
      ax.plot(rounds[-1], accs[-1], "o", color=line.get_color())
  ax.set_xlabel("Communication round")
  ax.set_ylabel("Accuracy (MNIST test)")
  ax.set_ylim(0, 1)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  ax.set_title("DP federated averaging, non-IID MNIST (dot: delta budget reached)")
  fig.tight_layout()
  fig.savefig(args.png, dpi=110)
  print("wrote", args.png)


def cmd_bench(args):
  args.clients = args.clients or 100
  args.epochs = args.epochs or 1
  fd, _ = _load(args)
  m = args.clients_per_round or min(100, args.clients)
  model = F.MLP((784, 600, 100, 10), use_bias=False)
  query = F.make_query("quantile", 1.0, m)
  alg = F.DPFedAvg(model, fd, query, clients_per_round=m, local_epochs=args.epochs,
                   batch_size=args.batch_size, client_learning_rate=args.lr,
                   diagnostics=False, fixed_epsilon=8.0)
  alg.run(1)  # trace
  t0 = time.time()
  alg.run(args.rounds)
  dt = time.time() - t0
  print(json.dumps(dict(K=args.clients, m=m, E=args.epochs, B=args.batch_size,
                        rounds=args.rounds, seconds=round(dt, 2),
                        rounds_per_second=round(args.rounds / dt, 4),
                        client_updates_per_second=round(args.rounds * m / dt, 1))))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run", help="one training run")
  _add_common(r)
  r.add_argument("--preset", choices=sorted(PRESETS), default=None)
  r.add_argument("--name", default=None)
  r.add_argument("--noise-multiplier", type=float, default=None, help="total z")
  r.add_argument("--delta0", type=float, default=None)
  r.add_argument("--epsilon", type=float, default=8.0)
  r.add_argument("--query", choices=F.QUERY_KINDS, default=None)
  r.add_argument("--initial-clip", type=float, default=1.0)
  r.add_argument("--clip-lr", type=float, default=0.2)
  r.add_argument("--target-quantile", type=float, default=0.5,
                 help="share of client updates left unclipped by the adaptive clip")
  r.add_argument("--average-decay", type=float, default=None,
                 help="also report the accuracy of an exponential moving average of the "
                      "server models with this decay (post-processing, no privacy cost)")
  r.add_argument("--hidden", default=None,
                 help="hidden layer widths, e.g. 600,100 (the paper's network, the default "
                      "without a preset) or 200")
  r.add_argument("--server-momentum", type=float, default=None, help="default: preset, else 0")
  r.add_argument("--sampling", choices=["poisson", "fixed_size"], default="poisson")
  r.add_argument("--max-rounds", type=int, default=50)
  r.add_argument("--out-dir", default=None)
  r.set_defaults(fn=cmd_run)
  pl = sub.add_parser("plot", help="accuracy per round (Figure 2)")
  pl.add_argument("files", nargs="+")
  pl.add_argument("--png", required=True)
  pl.set_defaults(fn=cmd_plot)
  b = sub.add_parser("bench", help="rounds per second")
  _add_common(b)
  b.add_argument("--rounds", type=int, default=3)
  b.set_defaults(fn=cmd_bench)
  args = parser.parse_args(argv)
  args.fn(args)


if __name__ == "__main__":
  main()
