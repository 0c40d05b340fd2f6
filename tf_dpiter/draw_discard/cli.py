"""Command line: tf-dpiter-ddml serve | privacy | example-spec.

  tf-dpiter-ddml serve --k 20 --model spec.json --store memory --port 8080
  tf-dpiter-ddml serve --k 20 --model spec.json --store redis://127.0.0.1:6379/0 \\
      --tokens tokens.txt --tls-cert cert.pem --tls-key key.pem --draw-quota 2 --submit-quota 2
  tf-dpiter-ddml privacy --epsilon 3.47 --k 20 --T 1000
  tf-dpiter-ddml example-spec --kind known-weights > spec.json
"""

from __future__ import annotations

import argparse
import logging
import math
import ssl
import sys

from tf_dpiter.draw_discard import glm
from tf_dpiter.draw_discard import privacy
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.errors import DPiterError
from tf_dpiter.errors import ParameterValueError


def known_weights_spec(**kw) -> glm.ModelSpec:
  """The 33-weight logistic ModelSpec of Section V-C (B, E1, E2, D, I and their 10 crosses);
  `kw` ModelSpec fields override the defaults (gamma 0.005, no noise)."""
  feats = (glm.Feature("B", "boolean"),
           glm.Feature("E1", "categorical", levels=("A", "B", "C")),
           glm.Feature("E2", "categorical", levels=("a", "b", "c", "d")),
           glm.Feature("D", "numeric", min=0.0, max=3.0),
           glm.Feature("I", "numeric", min=0.0, max=4.0))
  crosses = (("B", "E1"), ("B", "E2"), ("B", "D"), ("B", "I"), ("E1", "E2"), ("D", "E1"),
             ("I", "E1"), ("D", "E2"), ("I", "E2"), ("D", "I"))
  return glm.ModelSpec(**{**dict(family="logistic", features=feats, crosses=crosses,
                                 name="known_weights", version="1", gamma=0.005, epsilon=None,
                                 noise="none"), **kw})


def dense_spec(num_weights: int, **kw) -> glm.ModelSpec:
  """The logistic ModelSpec on one dense vector feature: p - 1 = num_weights - 1 inputs +
  intercept; `kw` ModelSpec fields override the defaults (gamma 0.001, epsilon ln 32).

  Raises:
    ParameterValueError: for num_weights < 2.
  """
  if num_weights < 2:
    raise ParameterValueError(f"num_weights must be >= 2, got {num_weights}")
  return glm.ModelSpec(**{**dict(family="logistic", name=f"dense{num_weights}", version="1",
                                 features=(glm.Feature("x", "vector", size=num_weights - 1),),
                                 gamma=0.001, epsilon=math.log(32)), **kw})


_CLI_ERRORS = (DPiterError, ValueError, OSError, ssl.SSLError, TimeoutError, KeyError,
               store_lib.StoreMismatch, store_lib.StoreLost, store_lib.StoreUnavailable)


def _parse_eps(s: str) -> float | None:
  if s.lower() in ("none", "inf"):
    return None
  return math.log(float(s[4:-1])) if s.startswith("log(") and s.endswith(")") else float(s)


def _parse_quota(s: str) -> float | None:
  return None if s.lower() == "none" else float(s)


def _add_serve(sub) -> None:
  s = sub.add_parser("serve", help="run the asynchronous HTTP service")
  s.add_argument("--k", type=int, default=20, help="number of model instances")
  s.add_argument("--model", required=True, help="model spec JSON file (glm.ModelSpec)")
  s.add_argument("--store", default="memory",
                 help="'memory' (this process only: a restart starts a new model, every "
                      "accepted update is lost; logged as a warning) or redis://host:port/db")
  s.add_argument("--prefix", default="ddml", help="Redis key prefix (one model per prefix)")
  s.add_argument("--host", default="127.0.0.1")
  s.add_argument("--port", type=int, default=8080)
  s.add_argument("--tokens", default=None,
                 help="file with one bearer token per line (only their SHA-256 is kept)")
  s.add_argument("--key-file", default=None,
                 help="file with the servers' shared secret (64 hex characters; default "
                      "$DDML_SECRET). Ticket and slot-integrity keys derive from it; it is "
                      "never written to the store. Required with a Redis store unless "
                      "--insecure-key-in-store")
  s.add_argument("--state-file", default=None,
                 help="Redis: this server's anchor file (its own disk), written before each "
                      "update is acknowledged: refuse to start on a store that lost "
                      "acknowledged updates, or whose anchor is missing; one file per "
                      "server (locked while it runs: a second server on it is refused)")
  s.add_argument("--adopt-store", action="store_true",
                 help="with --state-file: accept the store as it is although the anchor is "
                      "missing or records another generation (a server new to the store)")
  s.add_argument("--insecure-key-in-store", action="store_true",
                 help="Redis without --key-file: keep the secret in the store (anyone who can "
                      "read Redis can forge tickets)")
  s.add_argument("--insecure", action="store_true",
                 help="allow serving a non-loopback address without TLS or without tokens "
                      "(tokens and updates then travel in clear, or anyone may submit)")
  s.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key)")
  s.add_argument("--tls-key", default=None, help="PEM private key (with --tls-cert)")
  s.add_argument("--draw-quota", type=_parse_quota, default=2.0,
                 help="draws (and /v1/model reads) per second per token, or per address "
                      "without tokens (default 2; 'none' disables it: draw tracking, "
                      "Section IV adversary II, then needs only a fast client)")
  s.add_argument("--model-min-updates", type=int, default=None,
                 help="/v1/model: release a new average only after this many updates "
                      "(default k)")
  s.add_argument("--model-interval", type=float, default=10.0,
                 help="/v1/model: and only after this many seconds")
  s.add_argument("--submit-quota", type=_parse_quota, default=None, help="submits/s per token")
  s.add_argument("--quota-burst", type=float, default=None, help="bucket size (default 2x rate)")
  s.add_argument("--cluster-quotas", action="store_true",
                 help="Redis: the quotas hold for all servers of the store together (one "
                      "token bucket per token in Redis), not per server process")
  s.add_argument("--alpha", type=float, default=1e-3,
                 help="acceptance rule: bound on an honest update's rejection probability")
  s.add_argument("--history", type=int, default=None,
                 help="replaced instances kept as acceptance candidates (default 0 with "
                      "tickets, 256 with --no-tickets)")
  s.add_argument("--no-tickets", action="store_true",
                 help="accept submits without draw tickets (old candidate rule: weaker, "
                      "attackers can chain their own updates)")
  s.add_argument("--ticket-ttl", type=float, default=60.0, help="draw ticket lifetime (s)")
  s.add_argument("--no-rebase", action="store_true",
                 help="store the submitted instance itself (Algorithm 2 literally) instead of "
                      "its step applied to an instance drawn at submit time; clients that "
                      "discard draws can then select favourable pre-images")
  s.add_argument("--budget-alpha", type=float, default=1e-3,
                 help="influence budget: bound on an honest token's lifetime refusal probability")
  s.add_argument("--influence-steps", type=_parse_quota, default=8.0,
                 help="poisoning bound: at most this many updates of one token count at once "
                      "(decayed count; 'none': no rate cap, one token may then move the model "
                      "one full step per submit)")
  s.add_argument("--influence-half-life", type=_parse_quota, default=300.0,
                 help="half-life (s) of a token's influence budget ('none': no decay)")
  s.add_argument("--budget-memory-mb", type=float, default=256.0,
                 help="memory bound of the influence budgets, in MiB (default 256; 16 p + 160 "
                      "bytes per identity, p the number of weights)")
  s.add_argument("--new-identity-share", type=_parse_quota, default=None,
                 help="cap, in (0, 1), on the share of recent accepted updates (decayed "
                      "counts, half-life 600 s) from identities first seen less than an hour "
                      "ago; against freshly minted sybils (default 'none': no cap, since "
                      "one-shot honest clients are new identities too)")
  s.add_argument("--draw-min-updates", type=int, default=4,
                 help="draw gate: serve an instance only once it is at least this many "
                      "accepted updates away from every instance already served, else the "
                      "slot's last served instance again (default 4; 1: every draw fresh, "
                      "the local-DP guarantee of each step alone; off with --no-rebase)")
  s.add_argument("--max-abs-weight", type=float, default=1e6)
  s.add_argument("--centre-factor", type=float, default=36.0,
                 help="refuse updates farther (mean square) from the average than this many "
                      "times an honest update's expectation (anti-chaining; empirical)")
  s.add_argument("--max-connections", type=int, default=1024,
                 help="open connections in all (default 1024; the open-file soft limit is "
                      "raised to this + 64 at start-up, or the server refuses to start)")
  s.add_argument("--max-per-client", type=int, default=256,
                 help="open connections per address (default 256)")
  s.add_argument("--max-per-prefix", type=int, default=None,
                 help="open connections per /24 (IPv4) or /64 (IPv6) address prefix (default "
                      "max(2 x --max-per-client, --max-connections / 4): 512 at the defaults)")
  s.add_argument("--idle-timeout", type=float, default=15.0,
                 help="close a connection with no request started (or a TLS handshake not "
                      "done) for this many seconds while the connection table is at most half "
                      "full (default 15)")
  s.add_argument("--min-idle", type=float, default=1.0,
                 help="the idle and TLS handshake timeout (s) when the connection table is "
                      "full, and the idle time after which a newcomer may evict a connection "
                      "(default 1; from half full the timeout falls linearly from "
                      "--idle-timeout to this)")
  s.add_argument("--body-timeout", type=float, default=10.0, help="seconds to send a body")
  s.add_argument("--lock-ttl", type=float, default=10.0, help="Redis init lock expiry (s)")
  s.add_argument("--no-group-commit", action="store_true",
                 help="Redis: one round trip per script instead of one pipeline per loop turn")
  s.add_argument("--seed", type=int, default=None, help="initialization seed (tests only)")
  s.add_argument("--reset", action="store_true", help="overwrite an existing Redis model")
  s.add_argument("--max-body-bytes", type=int, default=None)


def _check_exposure(args) -> str:
  """Refuses a non-loopback address without TLS and tokens (unless --insecure); returns the
  warning to print before serving ("" when TLS and tokens are on)."""
  import ipaddress  # pylint: disable=g-import-not-at-top
  missing = [name for name, ok in (("TLS (--tls-cert/--tls-key)", args.tls_cert),
                                   ("tokens (--tokens)", args.tokens)) if not ok]
  if not missing:
    return ""
  try:
    loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
  except ValueError:
    loopback = False
  what = " and ".join(missing)
  if not loopback and not args.insecure:
    raise ParameterValueError(f"serving {args.host} without {what}: tokens and updates would travel in "
                              "clear or anyone could submit; add them, or pass --insecure")
  return (f"tf-dpiter-ddml: WARNING: serving without {what}"
          + ("" if loopback else " on a non-loopback address (--insecure)"))


def _serve(args) -> int:
  from tf_dpiter.draw_discard import auth, http_server, service  # pylint: disable=g-import-not-at-top
  from tf_dpiter.draw_discard import store_factory  # pylint: disable=g-import-not-at-top
  if (args.tls_cert is None) != (args.tls_key is None):
    raise ParameterValueError("`--tls-cert` and `--tls-key` go together. Received: "
                              f"--tls-cert={args.tls_cert!r}, --tls-key={args.tls_key!r}")
  if args.adopt_store and args.state_file is None:
    raise ParameterValueError("`--adopt-store` accepts a store against an anchor: it needs "
                              "--state-file. Received: --adopt-store without --state-file")
  warning = _check_exposure(args)
  spec = glm.ModelSpec.load(args.model)
  tokens = auth.TokenSet.from_file(args.tokens) if args.tokens else None
  quotas = None
  if args.draw_quota is not None or args.submit_quota is not None:
    burst = {"draw": args.quota_burst, "submit": args.quota_burst}
    quotas = auth.Quotas({"draw": args.draw_quota, "submit": args.submit_quota}, burst,
                         cluster=args.cluster_quotas)
  ctx = http_server.tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
  limits = http_server.Limits(args.max_connections, args.max_per_client, args.idle_timeout,
                              max_per_prefix=args.max_per_prefix, min_idle_s=args.min_idle)
  http_server.ensure_open_files(limits.max_connections)  # refuse before touching the store
  store = store_factory.make_store(args.store, prefix=args.prefix, lock_ttl_s=args.lock_ttl,
                                   group_commit=not args.no_group_commit)
  from tf_dpiter.draw_discard import keys  # pylint: disable=g-import-not-at-top
  secret = keys.load_secret(args.key_file)
  if secret is None and args.store != "memory" and not args.insecure_key_in_store:
    raise ParameterValueError("a Redis store needs the servers' shared secret: --key-file FILE or "
                              "$DDML_SECRET (64 hex characters), or --insecure-key-in-store")
  svc = service.DDMLService(
      spec, args.k, store, tokens=tokens, quotas=quotas, alpha=args.alpha, history=args.history,
      max_abs_weight=args.max_abs_weight, centre_factor=args.centre_factor,
      body_timeout_s=args.body_timeout, seed=args.seed,
      reset=args.reset, max_body_bytes=args.max_body_bytes, tickets=not args.no_tickets,
      ticket_ttl_s=args.ticket_ttl, budget_alpha=args.budget_alpha, rebase=not args.no_rebase,
      secret=secret, legacy_store_key=args.insecure_key_in_store,
      model_min_updates=args.model_min_updates, model_interval_s=args.model_interval,
      influence_steps=args.influence_steps, influence_half_life_s=args.influence_half_life,
      budget_memory_bytes=int(args.budget_memory_mb * 2**20), state_file=args.state_file,
      adopt_state=args.adopt_store, new_identity_share=args.new_identity_share,
      draw_min_updates=args.draw_min_updates)
  scheme = "https" if ctx else "http"
  print(f"tf-dpiter-ddml: serving {spec.name} v{spec.version} ({spec.num_weights} weights), "
        f"k={args.k}, store={store.kind}, tokens={len(tokens) if tokens else 'off'} on "
        f"{scheme}://{args.host}:{args.port}", flush=True)
  if warning:
    print(warning, file=sys.stderr, flush=True)
  http_server.run(svc, args.host, args.port, ctx, limits)
  return 0


def main(argv=None) -> int:
  """Entry point of tf-dpiter-ddml on argv (default sys.argv[1:]); returns the exit status: 0
  on success, 2 for bad input (a one-line message, no traceback)."""
  from tf_dpiter.draw_discard import auth  # pylint: disable=g-import-not-at-top
  auth.catch_early_hangups()  # SIGHUP must not kill a server still starting
  ap = argparse.ArgumentParser(prog="tf-dpiter-ddml", description="Draw and Discard ML (Pihur et al. 2018)")
  sub = ap.add_subparsers(dest="cmd", required=True)
  _add_serve(sub)
  p = sub.add_parser("privacy", help="print the guarantees against adversaries I, II, III")
  p.add_argument("--epsilon", type=_parse_eps, required=True, help="e.g. 3.47 or log(32)")
  p.add_argument("--k", type=int, required=True)
  p.add_argument("--T", type=float, default=1000.0, help="later updates to the instance")
  p.add_argument("--delta-t", type=float, default=1e-8)
  e = sub.add_parser("example-spec", help="print an example model spec JSON")
  e.add_argument("--kind", choices=("known-weights", "dense"), default="known-weights")
  e.add_argument("--num-weights", type=int, default=387)
  args = ap.parse_args(argv)
  try:
    return _run(args)
  except _CLI_ERRORS as err:
    print(f"tf-dpiter-ddml: error: {err}", file=sys.stderr)
    return 2


def _run(args) -> int:
  if args.cmd == "privacy":
    print("epsilon None: no client noise, no local DP guarantee" if args.epsilon is None
          else privacy.privacy_statement(args.epsilon, args.k, args.T, args.delta_t))
    return 0
  if args.cmd == "example-spec":
    spec = known_weights_spec() if args.kind == "known-weights" else dense_spec(args.num_weights)
    print(spec.to_json())
    return 0
  logging.basicConfig(level=logging.INFO,
                      format='{"time": "%(asctime)s", "level": "%(levelname)s", "log": %(message)s}')
  return _serve(args)


if __name__ == "__main__":
  sys.exit(main())
