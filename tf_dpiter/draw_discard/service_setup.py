"""Store setup of the Draw and Discard service (a base class of service.DDMLService): the
first server writes the k initial instances (Theorem 1's spread around 0) and the meta; later
servers join only when their spec fingerprint, every setting and their secret's key_id match
(store.check_meta).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import numpy as np

from tf_dpiter.draw_discard import auth
from tf_dpiter.draw_discard import calibration
from tf_dpiter.draw_discard import glm
from tf_dpiter.draw_discard import keys
from tf_dpiter.draw_discard import server as server_lib
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard import tickets as tickets_lib
from tf_dpiter.draw_discard import web_errors

log = logging.getLogger(__name__)


def spec_fingerprint(spec: glm.ModelSpec) -> str:
  """SHA-256 hex (64 characters) of the canonical JSON of a model spec (every field: gamma,
  epsilon, family, features...)."""
  return auth.token_digest(json.dumps(spec.to_dict(), sort_keys=True))


class StoreSetup:
  """Initialization and join (reads the service's spec, k, p, store, quotas, rule, budget)."""

  def settings(self, alpha, budget_alpha, max_abs_weight, centre_factor) -> dict:
    """Every acceptance (alpha, max_abs_weight, centre_factor), ticket, quota, influence
    (budget_alpha), sybil and draw-gate setting, a JSON-serializable dict: a server whose dict
    differs cannot join the store."""
    q = self.quotas
    newcomers = self.admission.newcomers
    return dict(alpha=float(alpha), budget_alpha=float(budget_alpha),
                max_abs_weight=float(max_abs_weight), centre_factor=float(centre_factor),
                tokens=self.tokens is not None,
                tickets=self.use_tickets, rebase=self.rebase, ticket_ttl_s=self.ticket_ttl_s,
                history=self.history, draw_max_age_s=self.draw_max_age_s,
                quotas=None if q is None else dict(rates=q.rates, burst=q.burst,
                                                   cluster=q.cluster),
                budget=self.budget.describe(),
                new_identity_share=None if newcomers is None else newcomers.share,
                draw_min_updates=self.draw_gate.m)

  def initial_std(self) -> float:
    """Per-weight std of the instances, sqrt(k/2) sigma (Theorem 1), sigma from the spec's
    noise (init_epsilon's Laplace noise when the spec has none)."""
    noise = self.spec.noise if self.spec.epsilon is not None else "laplace"
    eps = self.spec.epsilon if self.spec.epsilon is not None else self.init_epsilon
    noise = "laplace" if noise == "none" else noise
    var = calibration.noise_std(noise, self.spec.gamma, eps, self.spec.clip, self.spec.delta) ** 2
    return float(np.sqrt(calibration.init_variance(self.k, var)))

  def initial_instances(self) -> np.ndarray:
    """[k, p] float64 instances, N(0, k/2 sigma^2) per weight (Theorem 1)."""
    return server_lib.initial_instances(self.k, self.p, 0.0, self.initial_std(),
                                        np.random.default_rng(self.seed))

  async def startup(self, app=None) -> None:
    """Initializes or joins the store (checks version, k, size, spec fingerprint, history);
    `app` (the on_startup signal's application) is unused.

    Raises:
      store.StoreMismatch: when the store holds a different model.
      store.StoreRolledBack: when the store lost acknowledged updates this server's anchor
        records, or the anchor is missing for a store that holds updates (anchor.py).
    """
    secret = self.secret
    if secret is None and self.legacy_store_key and self.store.kind == "redis":
      secret = await self.store.shared_secret(keys.random_secret())
      web_errors.log_event(log, "insecure_key_in_store", logging.WARNING,
                           detail="the ticket and slot keys are kept in the store: anyone "
                                  "who can read it can forge tickets; use --key-file")
    secret = secret if secret is not None else keys.random_secret()
    self.meta["key_id"] = keys.key_id(secret)
    self.store.integrity_key = keys.derive(secret, "slots")
    wrote = await self.store.initialize(self.meta, self.initial_instances(), reset=self.reset)
    self.tickets = tickets_lib.Tickets(keys.derive(secret, "tickets"), self.ticket_ttl_s,
                                       scope=self.store.scope)
    self.admission.tickets = self.tickets
    if self.store.kind == "redis" and self.anchor is not None:
      await self.anchor.start(self.store, wrote, self.reset)
      self._anchor_task = asyncio.get_running_loop().create_task(self.anchor.run(self.store))
    elif self.store.kind == "redis":  # still an epoch: anchored peers see a re-issue after it
      await self.store.epochs(new_epoch=uuid.uuid4().hex[:16])
      web_errors.log_event(log, "no_state_file", logging.WARNING,
                           detail="without --state-file this server cannot tell, when it "
                                  "starts, that the store lost acknowledged updates")
    if self.store.kind == "memory":
      web_errors.log_event(log, "memory_store_not_durable", logging.WARNING,
                           detail="the k instances live in this process only: a restart or "
                                  "crash starts a new model and every accepted update is lost; "
                                  "use a Redis store with --state-file to keep them")
    web_errors.log_event(log, "store_ready", store=self.store.kind,
                         action="initialized" if wrote else "joined")
    if auth.take_early_hangup():  # a SIGHUP before the loop handled signals: reload now
      self.reload_tokens()

  async def shutdown(self, app=None) -> None:
    """Saves the anchor (anchor.py) and closes the store; `app` (on_cleanup) is unused."""
    task = getattr(self, "_anchor_task", None)
    if task is not None:
      task.cancel()
      try:
        await self.anchor.commit(self.store, self.store.high_water)
      except (store_lib.StoreLost, store_lib.StoreUnavailable) as e:
        web_errors.log_event(log, "anchor_not_saved", logging.ERROR, detail=str(e))
      self.anchor.close()
    await self.store.close()

  # ---- handlers ----
