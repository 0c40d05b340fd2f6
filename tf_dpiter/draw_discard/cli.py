"""Command line: tf-dpiter-ddml serve | privacy | example-spec.

  tf-dpiter-ddml serve --k 20 --model spec.json --store memory --port 8080
  tf-dpiter-ddml serve --k 20 --model spec.json --store redis://127.0.0.1:6379/0
  tf-dpiter-ddml privacy --epsilon 3.47 --k 20 --T 1000
  tf-dpiter-ddml example-spec --kind known-weights > spec.json
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

from tf_dpiter.draw_discard import glm
from tf_dpiter.draw_discard import privacy


def known_weights_spec(**kw) -> glm.ModelSpec:
  """The 33-weight logistic model of Section V-C (B, E1, E2, D, I and their 10 crosses)."""
  feats = (glm.Feature("B", "boolean"),
           glm.Feature("E1", "categorical", levels=("A", "B", "C")),
           glm.Feature("E2", "categorical", levels=("a", "b", "c", "d")),
           glm.Feature("D", "numeric", min=0.0, max=3.0),
           glm.Feature("I", "numeric", min=0.0, max=4.0))
  crosses = (("B", "E1"), ("B", "E2"), ("B", "D"), ("B", "I"), ("E1", "E2"), ("D", "E1"),
             ("I", "E1"), ("D", "E2"), ("I", "E2"), ("D", "I"))
  args = dict(family="logistic", features=feats, crosses=crosses, name="known_weights",
              version="1", gamma=0.005, epsilon=None, noise="none")
  args.update(kw)
  return glm.ModelSpec(**args)


def dense_spec(num_weights: int, **kw) -> glm.ModelSpec:
  """Logistic model on one dense vector feature: num_weights - 1 inputs + intercept."""
  if num_weights < 2:
    raise ValueError(f"num_weights must be >= 2, got {num_weights}")
  args = dict(family="logistic", features=(glm.Feature("x", "vector", size=num_weights - 1),),
              name=f"dense{num_weights}", version="1", gamma=0.001, epsilon=math.log(32))
  args.update(kw)
  return glm.ModelSpec(**args)


def _parse_eps(s: str) -> float | None:
  if s.lower() in ("none", "inf"):
    return None
  if s.startswith("log(") and s.endswith(")"):
    return math.log(float(s[4:-1]))
  return float(s)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tf-dpiter-ddml", description="Draw and Discard ML (seed 004)")
  sub = ap.add_subparsers(dest="cmd", required=True)
  s = sub.add_parser("serve", help="run the asynchronous HTTP service")
  s.add_argument("--k", type=int, default=20, help="number of model instances")
  s.add_argument("--model", required=True, help="model spec JSON file (glm.ModelSpec)")
  s.add_argument("--store", default="memory", help="'memory' or redis://host:port/db")
  s.add_argument("--prefix", default="ddml", help="Redis key prefix (one model per prefix)")
  s.add_argument("--host", default="127.0.0.1")
  s.add_argument("--port", type=int, default=8080)
  s.add_argument("--spam-t", type=float, default=None,
                 help="spam filter: refuse a weight outside mu +- t*sigma (off if unset)")
  s.add_argument("--stats-ttl", type=float, default=1.0, help="seconds between spam-stat refreshes")
  s.add_argument("--seed", type=int, default=None, help="initialization seed (tests only)")
  s.add_argument("--reset", action="store_true", help="overwrite an existing Redis model")
  s.add_argument("--max-body-bytes", type=int, default=None)
  p = sub.add_parser("privacy", help="print the guarantees against adversaries I, II, III")
  p.add_argument("--epsilon", type=_parse_eps, required=True, help="e.g. 3.47 or log(32)")
  p.add_argument("--k", type=int, required=True)
  p.add_argument("--T", type=float, default=1000.0, help="later updates to the instance")
  p.add_argument("--delta-t", type=float, default=1e-8)
  e = sub.add_parser("example-spec", help="print an example model spec JSON")
  e.add_argument("--kind", choices=("known-weights", "dense"), default="known-weights")
  e.add_argument("--num-weights", type=int, default=387)
  args = ap.parse_args(argv)

  if args.cmd == "privacy":
    if args.epsilon is None:
      print("epsilon None: no client noise, no local DP guarantee")
      return 0
    print(privacy.privacy_statement(args.epsilon, args.k, args.T, args.delta_t))
    return 0
  if args.cmd == "example-spec":
    spec = known_weights_spec() if args.kind == "known-weights" else dense_spec(args.num_weights)
    print(spec.to_json())
    return 0
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  from tf_dpiter.draw_discard import service  # pylint: disable=g-import-not-at-top
  spec = glm.ModelSpec.load(args.model)
  print(f"tf-dpiter-ddml: serving {spec.name} v{spec.version} ({spec.num_weights} weights), "
        f"k={args.k}, store={args.store} on http://{args.host}:{args.port}", flush=True)
  service.run(spec, args.k, args.store, host=args.host, port=args.port, prefix=args.prefix,
              spam_t=args.spam_t, stats_ttl_s=args.stats_ttl, seed=args.seed, reset=args.reset,
              max_body_bytes=args.max_body_bytes)
  return 0


if __name__ == "__main__":
  sys.exit(main())
