"""Asynchronous HTTP JSON service for Draw and Discard (Pihur et al., "Differentially-Private
Draw and Discard Machine Learning", Algorithm 2, over HTTP, aiohttp).

Endpoints (weights as a JSON list, base64 of little-endian float64 ("b64"), or raw float64
bytes ("raw", version in X-DDML-Version)):

  GET  /v1/draw   one instance drawn uniformly (secrets.randbelow) with its ticket (tickets.py);
                  X-DDML-Resend: same_ticket when the server requires tickets (a resend of
                  the submission with that ticket is stored at most once).
  POST /v1/submit the drawn instance, its ticket and the update: stored in a uniformly
                  random slot if the ticket is valid and unused, the step passes the
                  acceptance rule (acceptance.py) and the identity's influence budget
                  (influence.py); ?draw=raw answers with the next draw (draw quota).
  GET  /v1/model  the released average (model_release.py), charged to the draw quota.
  GET  /v1/spec, GET /v1/metrics, GET /metrics (Prometheus), GET /healthz.

Errors are JSON {"error": code, "message": ...}: 400 malformed / missing_ticket / bad_ticket,
401/403 token / invalid_ticket, 408 slow body, 409 wrong version / ticket_expired /
ticket_used, 413, 415, 422 wrong shape or refused, 429 quotas (Retry-After), 503 store_lost /
store_unavailable / too_many_connections / influence_table_full / update_not_acknowledged
(stored, anchor not written) / outcome_unknown (maybe stored: resend the same submission
with the same ticket, never the records under a new draw); both stay counted in the
influence budget. The server keeps no record of which instance was drawn. With
tickets=False any of the k instances and the last `history` replaced ones may be the
pre-image (acceptance.check).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time

import numpy as np
from aiohttp import web

from tf_dpiter import validation
from tf_dpiter.draw_discard import acceptance
from tf_dpiter.draw_discard import anchor as anchor_lib
from tf_dpiter.draw_discard import admission
from tf_dpiter.draw_discard import auth
from tf_dpiter.draw_discard import client_wire
from tf_dpiter.draw_discard import draw_gate
from tf_dpiter.draw_discard import glm
from tf_dpiter.draw_discard import http_io
from tf_dpiter.draw_discard import influence
from tf_dpiter.draw_discard import metrics as metrics_lib
from tf_dpiter.draw_discard import model_release
from tf_dpiter.draw_discard import parsing
from tf_dpiter.draw_discard import service_setup
from tf_dpiter.draw_discard import service_status
from tf_dpiter.draw_discard import snapshots
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard import sybil
from tf_dpiter.draw_discard import tickets as tickets_lib
from tf_dpiter.draw_discard import web_errors
from tf_dpiter.errors import ParameterValueError

log = logging.getLogger(__name__)
RequestError = parsing.RequestError


# What a store write raises with an answer of its own (web_errors: refused before writing, the
# store lost or unavailable); any other fault after the write was sent leaves its outcome
# unknown: 503 outcome_unknown, the client resends with the same ticket.
_ANSWERED = (store_lib.StoreLost, store_lib.StoreMismatch, store_lib.StoreUnavailable,
             store_lib.TicketUsed, store_lib.RateExceeded, ParameterValueError)


class DDMLService(service_setup.StoreSetup, service_status.StatusEndpoints):
  """State of one server process: the spec, a store, the acceptance rule and quotas.

  Args:
    spec: the served model spec.
    k: number of instances.
    store: a MemoryStore or RedisStore.
    tokens: a TokenSet; None serves without authentication.
    quotas: an auth.Quotas (per token, or per client address without tokens); None: none.
    alpha: the acceptance rule's false-rejection probability (acceptance.AcceptanceRule).
    history: replaced instances kept as acceptance candidates (default: 0 with tickets,
      256 without).
    max_abs_weight: no stored weight exceeds this magnitude.
    centre_factor: the acceptance rule's anti-chaining factor (acceptance.AcceptanceRule).
    draw_max_age_s: a draw may use a snapshot this old when the store moved on.
    body_timeout_s: seconds to receive a request body (408 after).
    init_epsilon: epsilon of the initial spread when the spec has no noise.
    seed: initialization seed (tests only).
    reset: overwrite an existing model in the store.
    max_body_bytes: request body limit (default: a JSON list of 2p doubles).
    tickets: require draw tickets (tickets.py) and test steps against the served instance.
    rebase: with tickets, store h' + (u - h), h' drawn by the server when the update arrives,
      instead of u (Algorithm 2; influence.py).
    ticket_ttl_s: a ticket's lifetime (and how long its nonce is remembered), finite.
    budget_alpha: the influence budget's lifetime false-rejection probability (influence.py).
    max_identities: identities whose influence budget is kept.
    secret: the shared secret of the store's servers (keys.py). None: a random one for this
      process (no other server can join), or with legacy_store_key the one in the store.
    influence_steps: rate cap of one identity's decayed update count (influence.py; None: none).
    influence_half_life_s: half-life of the influence budget's decay (None: no decay).
    budget_memory_bytes: memory bound of the influence budgets (all identities).
    state_file: Redis: this server's anchor file (anchor.py); None: only rollbacks seen while
      it runs are detected.
    adopt_state: with state_file, accept the store as it is at start-up (anchor.Anchor).
    model_min_updates: accepted updates between two releases of the average on /v1/model
      (model_release.py; default k).
    model_interval_s: seconds between two releases of the average.
    legacy_store_key: keep the secret in the store (anyone who reads it can forge tickets;
      keys.py); logged as a warning.
    new_identity_share: cap on the share of recent accepted updates from identities first
      seen less than an hour ago (sybil.NewIdentityShare; None: no cap).
    draw_min_updates: with rebasing, the draw gate's m (draw_gate.py); 1: Algorithm 2's draws.

  Raises:
    ParameterValueError: for k < 2, history < 0, a ticket_ttl_s that is not a finite number
      > 0 or a bad acceptance parameter.
  """

  def __init__(self, spec: glm.ModelSpec, k: int, store, *, tokens: auth.TokenSet | None = None,
               quotas: auth.Quotas | None = None, alpha: float = 1e-3,
               history: int | None = None, max_abs_weight: float = 1e6,
               centre_factor: float = 36.0, draw_max_age_s: float = 0.05,
               body_timeout_s: float = 10.0, init_epsilon: float = 1.0, seed: int | None = None,
               reset: bool = False, max_body_bytes: int | None = None, tickets: bool = True,
               ticket_ttl_s: float = 60.0, budget_alpha: float = 1e-3,
               max_identities: int = 100_000, rebase: bool = True,
               secret: bytes | None = None, legacy_store_key: bool = False,
               model_min_updates: int | None = None, model_interval_s: float = 10.0,
               influence_steps: float | None = 8.0, influence_half_life_s: float | None = 300.0,
               new_identity_share: float | None = None,
               budget_memory_bytes: int = 256 << 20, state_file: str | None = None,
               draw_min_updates: int = 4, adopt_state: bool = False):
    if history is None:
      history = 0 if tickets else 256
    validation.check_integer("k", k, 2)
    validation.check_integer("history", history, 0)
    validation.check_positive("body_timeout_s", body_timeout_s, allow_inf=True,
                              error=ParameterValueError)
    self.spec, self.k, self.store = spec, int(k), store
    self.tokens, self.quotas = tokens, quotas
    self.auth_throttle = auth.AuthThrottle()
    self.init_epsilon, self.seed, self.reset = init_epsilon, seed, reset
    self.rule = acceptance.AcceptanceRule(spec, alpha=alpha, max_abs_weight=max_abs_weight,
                                          spread_std=self.initial_std(),
                                          centre_factor=centre_factor)
    self.use_tickets = bool(tickets)
    self.rebase = bool(rebase) and self.use_tickets
    # finite: a used nonce is remembered this long (an infinite one would grow the memory
    # store's nonce table forever and overflow Redis's PX milliseconds on every submit)
    validation.check_positive("ticket_ttl_s", ticket_ttl_s, allow_inf=False,
                              error=ParameterValueError)
    self.ticket_ttl_s = float(ticket_ttl_s)
    self.tickets: tickets_lib.Tickets | None = None  # keyed from the store at startup
    self.budget = influence.InfluenceBudget(
        self.rule, budget_alpha, max_identities, max_steps=influence_steps,
        half_life_s=influence_half_life_s, max_memory_bytes=budget_memory_bytes)
    self.admission = admission.Admission(
        self.rule, self.budget, newcomers=None if new_identity_share is None
        else sybil.NewIdentityShare(new_identity_share))
    self.draw_gate = draw_gate.DrawGate(self.k, draw_min_updates if self.rebase else 1,
                                        self.rule.linf)
    self._pending_draws = 0
    self.history = int(history)
    self.draw_max_age_s = float(draw_max_age_s)
    self.body_timeout_s = float(body_timeout_s)
    self.p = spec.num_weights
    self.max_body_bytes = int(max_body_bytes or (52 * self.p + 65536))
    self.secret, self.legacy_store_key = secret, bool(legacy_store_key)
    self.anchor = anchor_lib.Anchor(state_file, adopt=adopt_state) if state_file else None
    self.meta = dict(version=spec.version, k=self.k, num_weights=self.p,
                     fingerprint=service_setup.spec_fingerprint(spec), history=self.history,
                     settings=self.settings(alpha, budget_alpha, max_abs_weight, centre_factor))
    self.spec_json = json.dumps(spec.to_dict()).encode()
    self.metrics = metrics_lib.Registry()
    self.connection_guard = None  # set by http_server.serve
    self.snapshots = snapshots.SnapshotCache(store, self.metrics, self.draw_max_age_s)
    self.release = model_release.ModelRelease(
        store, self.snapshots, self.k, self.k if model_min_updates is None else model_min_updates,
        model_interval_s)
    self.meta["settings"].update(model_min_updates=self.release.min_updates,
                                 model_interval_s=self.release.min_interval_s)
    self.started = time.time()

  async def handle_draw(self, request: web.Request) -> web.Response:
    """GET /v1/draw: one instance drawn uniformly from a full snapshot, in the requested
    encoding, with the spec and a draw ticket.

    Raises:
      parsing.RequestError: 400 bad_encoding.
    """
    encoding = http_io.query_encoding(request)
    w, ticket = await self.draw_for(self._identity(request))
    resp = http_io.weights_response(w, encoding, self.spec.version, b',"spec":' + self.spec_json + b',"ticket":"'
                                  + ticket.encode() + b'",')
    resp.headers["X-DDML-Ticket"] = ticket
    if self.use_tickets:
      resp.headers[client_wire.RESEND_HEADER] = "same_ticket"
    return resp

  async def draw_for(self, identity: str) -> tuple[np.ndarray, str]:
    """([p] instance drawn uniformly from a full snapshot, its ticket for `identity`)."""
    snap = await self.snapshots.for_draw()
    w = self._gated_draw(snap)  # never stored, never logged
    return w, self.tickets.issue(identity, w)

  def _gated_draw(self, snap) -> np.ndarray:
    w, stale = self.draw_gate.draw(snap)
    self.metrics.inc("draws_total", help_text="instances served")
    if stale:
      self.metrics.inc("draws_stale_total", help_text="draws that got an already served value")
    return w

  @staticmethod
  def _identity(request: web.Request) -> str:
    return request.get(web_errors.IDENTITY) or request.remote or "?"

  async def _parse(self, request: web.Request) -> parsing.Submission:
    try:
      media = parsing.content_type(request.headers.get("Content-Type"))
      raw = await http_io.read_body(request, self.max_body_bytes, self.body_timeout_s)
      if media == parsing.RAW_TYPE:
        return parsing.parse_raw_submission(raw, request.headers.get("X-DDML-Version"),
                                            self.spec.version, self.p,
                                            request.headers.get("X-DDML-Ticket"))
      return parsing.parse_json_submission(raw, self.spec.version, self.p)
    except RequestError:
      await self._count_refusal("rejected_invalid")
      raise

  async def _count_refusal(self, counter: str) -> None:
    """Adds a refused submit to the store's counters ("submits" and `counter`). A refusal is
    answered whatever the store's state (validation answers before the store is needed): when
    the store is down or lost, the refusal is counted in this process's metrics instead."""
    try:
      await self.store.incr("submits")
      await self.store.incr(counter)
    except (store_lib.StoreUnavailable, store_lib.StoreLost):
      self.metrics.inc("refusals_uncounted_total",
                       help_text="refused submits the store's counters missed (store down)")

  async def _refuse(self, e: admission.Refused) -> RequestError:
    self.metrics.inc("rejected_total", reason=e.reason, help_text="refused updates")
    await self._count_refusal("rejected_invalid" if e.invalid else "rejected")
    extra = {"reason": e.reason} if e.code == "rejected_update" else None
    headers = None
    if e.retry_after is not None:
      headers = {"Retry-After": auth.retry_after_header(e.retry_after)}
      extra = {"retry_after_s": round(e.retry_after, 3)}
    return RequestError(e.status, e.code, e.message, headers=headers, extra=extra)

  async def store_ticketed(self, identity: str, sub: parsing.Submission) -> int:
    """Admission (admission.py), then the write (rebased, see the class doc) of submission
    `sub` by `identity`; returns the new sequence number.

    Raises:
      parsing.RequestError: when refused (status and code in the module docstring).
    """
    key = sybil.budget_key(identity, self.tokens is not None)
    try:
      adm = self.admission.admit(identity, sub, key)
    except admission.Refused as e:
      raise await self._refuse(e) from e
    draws, self._pending_draws = self._pending_draws, 0
    sent = False  # whether the write reached the store (its outcome may then be unknown)
    try:
      new, parent, slot = sub.weights, None, secrets.randbelow(self.k)
      if self.rebase:  # the step lands on an instance the server draws now
        base, q = await self.snapshots.recent(), secrets.randbelow(self.k)
        new, parent = base.slots[q] + adm.step, self.draw_gate.parent(base, q)
        bad = self.rule.value_reason(new)
        if bad:
          raise await self._refuse(admission.rule_refusal(self.rule, bad))
      node = self.draw_gate.pending(slot, new, parent)
      sent = True
      try:
        seq = await self.store.replace(slot, new, adm.nonce, self.tickets.nonce_ttl_s, draws,
                                       self._rate(key))
      finally:
        self.draw_gate.dropped(slot, node)
      self.draw_gate.written(slot, node, seq)
      return seq
    except store_lib.StoreUnavailable as e:
      if sent and not isinstance(e, store_lib.StoreRefused):
        # stored (StoredNotAcknowledged) or maybe stored (a timeout after the write was
        # sent): the budget keeps the step, the draws are not counted twice; 503
        # update_not_acknowledged, or 503 outcome_unknown (resend with the same ticket,
        # which takes this charge over: one step for the submission, however many sends)
        self.admission.keep_unsettled(adm, self.tickets.nonce_ttl_s)
        if isinstance(e, (store_lib.StoredNotAcknowledged, store_lib.WriteOutcomeUnknown)):
          raise
        raise store_lib.WriteOutcomeUnknown(str(e)) from e
      self.admission.release(adm)
      self._pending_draws += draws
      raise
    except BaseException as e:
      if sent and not isinstance(e, (store_lib.TicketUsed, store_lib.RateExceeded,
                                     ParameterValueError)):
        # the write was sent and nothing says it was refused before writing (a fault or a
        # cancellation after it): it may be stored, so the budget keeps the step and the
        # draws it carried are not queued to be counted again; a fault is answered 503
        # outcome_unknown (the client resends with the same ticket), not 500
        self.admission.keep_unsettled(adm, self.tickets.nonce_ttl_s)
        if isinstance(e, Exception) and not isinstance(e, _ANSWERED):
          raise store_lib.WriteOutcomeUnknown(f"{type(e).__name__} after the write: {e}") from e
        raise
      # nothing stored by this send: the draws go back, and the reservation (for a resend:
      # the earlier send's charge stays, its outcome unknown, Admission.release) unless an
      # earlier send of this submission stored it (ticket used: its charge is the one)
      if not (adm.resent and isinstance(e, store_lib.TicketUsed)):
        self.admission.release(adm)
      self._pending_draws += draws
      if isinstance(e, store_lib.TicketUsed):
        raise await self._refuse(admission.Refused(
            409, "ticket_used", "ticket_used", "this draw ticket was already used; draw again",
            True)) from e
      if isinstance(e, store_lib.RateExceeded):
        b = self.budget
        raise await self._refuse(admission.Refused(
            429, "influence_rate_exceeded", "influence_rate",
            "this token's updates exceed its influence rate on the servers of this store; "
            "retry later", False,
            retry_after=b.half_life_s * math.log2(b.max_steps / (b.max_steps - 1.0))
            if b.max_steps > 1 else b.half_life_s)) from e
      raise

  def _rate(self, identity: str) -> tuple | None:
    """(identity, half-life, max_steps) for the store's cluster-wide rate check, or None."""
    b = self.budget
    if b.max_steps is None or b.half_life_s is None:
      return None
    return identity, b.half_life_s, b.max_steps

  async def handle_submit(self, request: web.Request) -> web.Response:
    """POST /v1/submit: parse strictly, check ticket, step and budget, replace a random slot;
    answers {"accepted": true, "seq": n}, or with ?draw=raw the next drawn instance (raw).

    Raises:
      parsing.RequestError: for a malformed body, a bad ticket, a refused step or a budget
        overrun (status and code in the module docstring).
    """
    sub = await self._parse(request)
    if self.use_tickets:
      seq = await self.store_ticketed(self._identity(request), sub)
    else:
      bad = self.rule.value_reason(sub.weights)  # before the snapshot read: no store needed
      if bad:
        raise await self._refuse(admission.rule_refusal(self.rule, bad))
      decision = await self._decide(sub.weights)
      if not decision.accepted:
        raise await self._refuse(admission.rule_refusal(self.rule, decision.reason))
      try:
        seq = await self.store.replace(secrets.randbelow(self.k), sub.weights)
      except store_lib.StoreUnavailable as e:  # sent: refused before writing, or unknown
        if isinstance(e, (store_lib.StoreRefused, store_lib.StoredNotAcknowledged,
                          store_lib.WriteOutcomeUnknown)):
          raise
        raise store_lib.WriteOutcomeUnknown(str(e)) from e
      except BaseException as e:
        if isinstance(e, Exception) and not isinstance(e, _ANSWERED):
          # sent, then a fault that is not the store's own answer: maybe stored
          raise store_lib.WriteOutcomeUnknown(f"{type(e).__name__} after the write: {e}") from e
        raise
    self.metrics.inc("accepted_total", help_text="stored updates")
    snap = None
    if request.query.get("draw") == "raw":
      # the next round's draw in the same answer (one request per update in steady state);
      # the replace just checked the generation and returned seq: no extra store call. The
      # update is stored: a store fault now leaves the answer an acknowledgement, no draw
      try:
        snap = await self.snapshots.at(seq) if await self._may_draw(request) else None
      except (store_lib.StoreUnavailable, store_lib.StoreLost):
        self.metrics.inc("next_draw_failed_total",
                         help_text="stored submits answered without their next draw")
    if snap is not None:
      self._pending_draws += 1
      w = self._gated_draw(snap)
      headers = {"X-DDML-Seq": str(seq),
                 "X-DDML-Ticket": self.tickets.issue(self._identity(request), w)}
      if self.use_tickets:
        headers[client_wire.RESEND_HEADER] = "same_ticket"
      return http_io.raw_weights_response(w, self.spec.version, headers)
    return web.Response(body=b'{"accepted":true,"seq":%d}' % seq, content_type=parsing.JSON_TYPE)

  async def take_quota(self, identity: str, op: str) -> float:
    """This process's bucket of (identity, op), then (quotas.cluster, Redis) the bucket all
    servers share: 0.0 when allowed, else the seconds to wait."""
    wait = self.quotas.take(identity, op)
    rate = self.quotas.rates.get(op)
    if wait == 0 and self.quotas.cluster and rate is not None and self.store.kind == "redis":
      wait = await self.store.take_quota(identity, op, rate, self.quotas.burst[op])
    return wait

  async def _may_draw(self, request: web.Request) -> bool:
    if self.quotas is None:
      return True
    ok = await self.take_quota(request.get(web_errors.IDENTITY) or "?", "draw") == 0
    if not ok:
      self.metrics.inc("quota_refused_total", op="draw", help_text="requests over quota (429)")
    return ok

  async def _decide(self, w: np.ndarray) -> acceptance.Decision:
    snap = await self.snapshots.current()
    decision = self.rule.check(w, snap.candidates, snap.centre, self.k)
    if decision.accepted or decision.reason in ("non_finite", "out_of_range"):
      return decision
    seq = await self.store.touch()
    if seq != snap.seq:  # the pre-image may be newer than our snapshot
      snap = await self.snapshots.refresh(seq)
      decision = self.rule.check(w, snap.candidates, snap.centre, self.k)
    return decision

  async def handle_model(self, request: web.Request) -> web.Response:
    """GET /v1/model: the released average of the k instances (model_release.py), in the
    requested encoding, with k and its sequence number. Charged to the caller's draw quota
    (web_errors); a new average is released only after `model_min_updates` updates and
    `model_interval_s` seconds.

    Raises:
      parsing.RequestError: 400 bad_encoding.
    """
    encoding = http_io.query_encoding(request)
    rel = await self.release.current()
    resp = http_io.weights_response(rel.mean, encoding, self.spec.version,
                                    b',"k":%d,"seq":%d,' % (self.k, rel.seq))
    resp.headers["X-DDML-Seq"] = str(rel.seq)
    return resp

  def make_app(self) -> web.Application:
    """The aiohttp web.Application (routes, JSON errors, auth, quotas, metrics); serve it with
    http_server.serve or an AppRunner."""
    app = web.Application(client_max_size=self.max_body_bytes + 1,
                          middlewares=[web_errors.make_middleware(self)])
    app.router.add_get("/v1/draw", self.handle_draw)
    app.router.add_post("/v1/submit", self.handle_submit)
    app.router.add_get("/v1/model", self.handle_model)
    app.router.add_get("/v1/spec", self.handle_spec)
    app.router.add_get("/v1/metrics", self.handle_metrics_json)
    app.router.add_get("/metrics", self.handle_prometheus)
    app.router.add_get("/healthz", self.handle_health)
    app.on_startup.append(self.startup)
    app.on_cleanup.append(self.shutdown)
    return app
