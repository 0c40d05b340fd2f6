"""Empirical privacy audit on MNIST: claimed ε beside black-box and white-box lower bounds.

For a non-private and a DP-SGD-trained MLP (784-64-10) on a pool of MNIST examples:
* black box, LiRA (Carlini et al. 2022): N + 1 models, each trained on a fair-coin half of
  the pool with the same recipe; model 0 is the target, the other N its shadows. Printed:
  attack AUC, TPR at 0.1 % FPR, loss-attack AUC, and the sound one-run ε lower bound
  (Steinke et al. 2023) of the target's membership guesses;
* white box, Dirac canaries: the same recipe on a fair-coin half of the pool with m gradient
  canaries inside the real DP step (tf_dpiter.auditing.run_whitebox_audit), audited every
  few epochs by AuditCallback (claimed ε from the ledger, white-box bounds, loss-attack AUC);
  the final bound from the released updates beside the claim (per run: the T-step claim;
  per step: each step is a one-step trial). `--report` draws the DP run's audit as a PNG.
Claimed ε comes from the ledger / dp_accounting; the non-private model claims ε = inf.

  python tutorials/audit_mnist.py --data_path ../shared/data/mnist.npz --quick
  python tutorials/audit_mnist.py --data_path ../shared/data/mnist.npz --pool 2000 --shadows 16

The last line printed is JSON with every number of the table.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter.auditing as audit  # noqa: E402
from tf_dpiter import accounting  # noqa: E402
from tf_dpiter import data as dp_data  # noqa: E402
from tf_dpiter import keras as dp_keras  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.environ.get("TF_DPITER_MNIST",
                              os.path.join(REPO, "..", "shared", "data", "mnist.npz"))


def load_pool(path, size, seed):
  """`size` training images (flattened, in [0, 1]) and labels, drawn with `seed`."""
  if not os.path.exists(path):
    raise SystemExit(f"--data_path {path!r} does not exist (keras-layout mnist.npz expected)")
  with np.load(path) as d:
    x, y = d["x_train"], d["y_train"]
  idx = np.random.default_rng(seed).choice(len(x), size, replace=False)
  return (x[idx].reshape(size, -1).astype("float32") / 255.0), y[idx].astype("int64")


def mlp():
  return keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"),
                           keras.layers.Dense(10)])


def _ce():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Recipe:
  """One training recipe (private or not); `train_and_predict` is the LiRA callable."""

  def __init__(self, args, private):
    self.args, self.private = args, private
    self.last_epsilon = None

  def train_and_predict(self, x_train, y_train, x_all=None):
    a = self.args
    if self.private:
      model = dp_keras.make_private(mlp())
      model.compile(optimizer=dp_keras.DPKerasSGDOptimizer(
          a.l2_norm_clip, a.noise_multiplier, learning_rate=a.learning_rate), loss=_ce())
      data = dp_data.poisson_batches(x_train, y_train, expected_batch_size=a.batch_size)
      model.fit(data, epochs=a.epochs, verbose=0)
      self.last_epsilon = float(accounting.epsilon(model.ledger, a.delta))
    else:
      model = mlp()
      model.compile(optimizer=keras.optimizers.SGD(a.learning_rate), loss=_ce())
      model.fit(x_train, y_train, batch_size=a.batch_size, epochs=a.epochs, verbose=0)
      self.last_epsilon = float("inf")
    return keras.ops.convert_to_numpy(model.predict(self.pool_x, verbose=0))


def black_box(recipe, x, y, num_shadows, delta, seed):
  recipe.pool_x = x
  phi, masks = audit.shadow_confidences(recipe.train_and_predict, x, y, num_shadows + 1, seed)
  claimed = recipe.last_epsilon      # every model has the same recipe, hence the same claim
  lira = audit.lira_scores(phi[0], phi[1:], masks[1:], fix_variance=num_shadows < 32)
  m = audit.attack_metrics(lira, masks[0], y, delta)
  loss_auc = audit.auc(phi[0][masks[0]], phi[0][~masks[0]])   # φ is monotone in the loss
  return {"claimed_epsilon": claimed, "lira_auc": m.auc, "lira_tpr_at_0.1pct": m.tpr_at_0_1pct,
          "lira_epsilon_lb": m.epsilon_lower_bound, "loss_auc": loss_auc,
          "lira_auc_by_class": m.auc_by_class}


def white_box(args, x, y, private):
  """Canary run on a fair-coin half of the pool, audited every epoch (AuditCallback)."""
  z = args.noise_multiplier if private else 0.0
  member = np.random.default_rng(args.seed + 1).random(len(x)) < 0.5
  n_total = int(member.sum()) + int(args.canaries * 0.5)
  q = args.batch_size / n_total

  def attack_fn(model):   # loss attack on the canary run's own model, fair-coin members
    out = keras.ops.convert_to_numpy(model.base(x))
    return audit.loss_scores(out, y), member, y

  audit_kwargs = {"attack_fn": attack_fn, "accountant": "rdp",
                  "every_n_epochs": max(1, args.epochs // 5),
                  "report_path": args.report if private else None}
  r = audit.run_whitebox_audit(
      mlp(), x[member], y[member], 10, num_canaries=args.canaries, noise_multiplier=z,
      sampling_probability=q, steps=int(round(1 / q)), epochs=args.epochs,
      l2_norm_clip=args.l2_norm_clip, learning_rate=args.learning_rate, delta=args.delta,
      design_seed=args.seed, ledger_accountant=None, audit_kwargs=audit_kwargs)
  for row in r.audit_callback.history:
    print(f"  {'DP-SGD' if private else 'non-private'} canary run, epoch {row['epoch']}: "
          f"claimed eps {row['claimed_epsilon']:.3f}, white-box bound {row['whitebox_epsilon_lb']:.3f}"
          f" (per step {row['whitebox_step_epsilon_lb']:.3f}), loss attack AUC "
          f"{row['attack_auc']:.3f}, one-run bound {row['attack_epsilon_lb']:.3f}")
  return {"whitebox_claimed_epsilon": r.claimed_epsilon("rdp"),
          "whitebox_step_claimed_epsilon": r.step_claimed_epsilon("pld"),
          "whitebox_epsilon_lb": r.run_bound.epsilon,
          "whitebox_step_epsilon_lb": r.step_bound.epsilon,
          "whitebox_steps": r.steps, "whitebox_q": r.sampling_probability,
          "canary_run_history": r.audit_callback.history}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data_path", default=DEFAULT_DATA)
  p.add_argument("--pool", type=int, default=1000, help="examples; each a member w.p. 1/2")
  p.add_argument("--shadows", type=int, default=8, help="LiRA shadow models (plus 1 target)")
  p.add_argument("--epochs", type=int, default=20)
  p.add_argument("--batch_size", type=int, default=50, help="expected batch size")
  p.add_argument("--learning_rate", type=float, default=0.2)
  p.add_argument("--l2_norm_clip", type=float, default=1.0)
  p.add_argument("--noise_multiplier", type=float, default=1.1)
  p.add_argument("--canaries", type=int, default=2000, help="white-box Dirac canaries m")
  p.add_argument("--delta", type=float, default=1e-5)
  p.add_argument("--seed", type=int, default=0, help="audit design (pool, memberships)")
  p.add_argument("--quick", action="store_true", help="pool 400, 4 shadows, 8 epochs, 1000 canaries")
  p.add_argument("--report", default=None,
                 help="PNG of the DP canary run: claimed ε, bounds and attack AUC over epochs")
  args = p.parse_args(argv)
  if args.quick:
    args.pool, args.shadows, args.epochs, args.canaries = 400, 4, 8, 1000
  t0 = time.time()
  x, y = load_pool(args.data_path, args.pool, args.seed)
  rows = {}
  for name, private in (("non-private", False), ("DP-SGD", True)):
    row = black_box(Recipe(args, private), x, y, args.shadows, args.delta, args.seed)
    row.update(white_box(args, x, y, private))
    rows[name] = row
  print(audit.report.format_summary(rows))
  for name, r in rows.items():
    print(f"{name}: claimed eps {r['claimed_epsilon']:.3f} | LiRA AUC {r['lira_auc']:.3f}, "
          f"one-run bound {r['lira_epsilon_lb']:.3f} | white-box bound per run "
          f"{r['whitebox_epsilon_lb']:.3f} (claim {r['whitebox_claimed_epsilon']:.3f}), per step "
          f"{r['whitebox_step_epsilon_lb']:.3f} (one-step claim "
          f"{r['whitebox_step_claimed_epsilon']:.3f})")
  summary = {"args": vars(args), "seconds": round(time.time() - t0, 1),
             "results": {k: {kk: (vv if vv != float("inf") else "inf") for kk, vv in v.items()}
                         for k, v in rows.items()}}
  print(json.dumps(summary, default=str))
  return rows


if __name__ == "__main__":
  main()
