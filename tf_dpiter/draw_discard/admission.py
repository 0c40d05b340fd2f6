"""Admission of a ticketed submit, in one place, each step refusing before anything is stored:

  1. values: non-finite or |w| > max_abs_weight (422);
  2. ticket (tickets.py): missing or malformed (400), not issued to this identity for the
     drawn instance (403), expired (409);
  3. step d = u - h against the served h (AcceptanceRule.check_step, 422),
     P(honest refused) <= alpha;
  4. influence budget (influence.py; key: token identity or address prefix,
     sybil.budget_key): 429 rate (Retry-After), 422 cumulative, 503 table full;
  5. new identities' share (sybil.py, when set): 429 (Retry-After).

The store then marks the ticket's nonce used with the write (409 ticket_used when it was).
A write whose outcome is unknown keeps its charge (`keep_unsettled`): a resend of the same
submission (same ticket, identity and step) takes that charge over instead of reserving a
second one, so the budget counts one step for it whichever send stored it; anything else
under that ticket is charged in full.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time

import numpy as np

from tf_dpiter.draw_discard import acceptance
from tf_dpiter.draw_discard import influence
from tf_dpiter.draw_discard import parsing
from tf_dpiter.draw_discard import tickets as tickets_lib


class Refused(Exception):
  """A refused submit: HTTP status, error code, the rule's reason and whether it was invalid
  input (counted as rejected_invalid) rather than a refused update (rejected)."""

  def __init__(self, status: int, code: str, reason: str, message: str, invalid: bool,
               retry_after: float | None = None):
    super().__init__(f"{status} {code} ({reason}): {message}")
    self.status, self.code, self.reason, self.message = status, code, reason, message
    self.invalid, self.retry_after = invalid, retry_after


@dataclasses.dataclass(frozen=True)
class Admitted:
  """An admitted submit: its budget key, its step u - h (reserved in the budget), the ticket
  nonce, whether it was counted as a new identity's update (sybil.NewIdentityShare) and
  whether it is a resend that took over an earlier send's charge (`resent`, take_unsettled)."""
  identity: str
  step: np.ndarray
  nonce: str
  new: bool = False
  resent: bool = False


def _step_digest(step: np.ndarray) -> bytes:
  return hashlib.blake2b(np.ascontiguousarray(step, dtype="<f8").tobytes(),
                         digest_size=16).digest()


def rule_refusal(rule: acceptance.AcceptanceRule, reason: str) -> Refused:
  """The Refused (422) to raise for an acceptance-rule or budget reason (the rule's
  max_abs_weight quoted)."""
  if reason == "non_finite":
    return Refused(422, "non_finite", reason, "weights contain NaN or infinity", True)
  if reason == "out_of_range":
    return Refused(422, "out_of_range", reason,
                   f"a weight exceeds {rule.max_abs_weight:g} in magnitude", True)
  return Refused(422, "rejected_update", reason,
                 "not a plausible update of a served instance under the served spec, or "
                 f"beyond this token's influence budget ({reason})", False)


class Admission:
  """Decides whether a ticketed submit may be stored.

  Args:
    rule: the served spec's AcceptanceRule.
    budget: the per-identity InfluenceBudget.
    tickets: the Tickets (set once the store's key is known).
    newcomers: a sybil.NewIdentityShare, or None (no cap on new identities' share).

  Attributes:
    max_unsettled: charges of writes with unknown outcome kept for a resend (the oldest go
      first; a resend whose record went is charged again: more, never less).
  """

  max_unsettled = 65536

  def __init__(self, rule: acceptance.AcceptanceRule, budget: influence.InfluenceBudget,
               tickets: tickets_lib.Tickets | None = None, newcomers=None):
    self.rule, self.budget, self.tickets = rule, budget, tickets
    self.newcomers = newcomers
    # nonce -> (monotonic expiry, budget key, step digest, counted as new): insertion order
    self._unsettled: collections.OrderedDict = collections.OrderedDict()

  def admit(self, identity: str, sub: parsing.Submission, key: str | None = None) -> Admitted:
    """Steps 1-5 of the module docstring for submission `sub` by `identity` (the ticket's
    binding; budget `key` default identity, sybil.budget_key); reserves the step in the budget
    and returns the Admitted submit: call `release` if it is not stored after all.

    Raises:
      Refused: at the first failing step.
    """
    bad = self.rule.value_reason(sub.weights)
    if bad:
      raise rule_refusal(self.rule, bad)
    try:
      nonce = self.tickets.verify(sub.ticket if sub.drawn is not None else None, identity,
                                  sub.drawn)
    except tickets_lib.TicketError as e:
      raise Refused(e.status, e.code, e.code, e.message, True) from e
    decision = self.rule.check_step(sub.weights, sub.drawn)
    if not decision.accepted:
      raise rule_refusal(self.rule, decision.reason)
    step = sub.weights - sub.drawn
    key = identity if key is None else key
    earlier = self.take_unsettled(nonce, key, step)
    if earlier is not None:  # a resend: the earlier send's charge covers it
      return earlier
    reason = self.budget.reserve(key, step)
    if reason == "influence_rate":
      raise Refused(429, "influence_rate_exceeded", reason,
                    "this token's updates exceed its influence rate "
                    f"({self.budget.max_steps:g} per {self.budget.half_life_s:g} s half-life); "
                    "retry later", False, retry_after=self.budget.wait_s(key))
    if reason == "influence_table_full":
      raise Refused(503, "influence_table_full", reason,
                    "the server tracks as many active identities as its memory bound allows; "
                    "retry later", False, retry_after=max(1.0, self.budget.room_in_s()))
    if reason:
      raise rule_refusal(self.rule, reason)
    return Admitted(key, step, nonce, self._newcomer(key, step))

  def _newcomer(self, key: str, step: np.ndarray) -> bool:
    """Step 5: counts the update in the new-identity share, or releases the step and refuses."""
    if self.newcomers is None:
      return False
    wait, new = self.newcomers.take(key)
    if wait > 0:
      self.budget.release(key, step)
      raise Refused(429, "new_identity_share", "new_identity_share",
                    "new identities already hold their share of recent updates; retry later",
                    False, retry_after=wait)
    return new

  def release(self, admitted: Admitted) -> None:
    """Undoes the budget reservation of an Admitted submit that was not stored; for a resend
    (`resent`) the earlier send's outcome is still unknown: its charge stays, kept again for
    the next resend (keep_unsettled)."""
    if admitted.resent:
      self.keep_unsettled(admitted, self.tickets.nonce_ttl_s)
      return
    self.budget.release(admitted.identity, admitted.step)
    if self.newcomers is not None:
      self.newcomers.untake(admitted.new)

  def keep_unsettled(self, admitted: Admitted, ttl_s: float) -> None:
    """Records that `admitted`'s write has an unknown outcome and its charge stays, for
    `ttl_s` seconds (the ticket's nonce lifetime: a resend after it is refused anyway), so
    that a resend of the same submission takes the charge over (take_unsettled)."""
    now = time.monotonic()
    while self._unsettled and next(iter(self._unsettled.values()))[0] < now:
      self._unsettled.popitem(last=False)
    self._unsettled.pop(admitted.nonce, None)
    self._unsettled[admitted.nonce] = (now + ttl_s, admitted.identity,
                                       _step_digest(admitted.step), admitted.new)
    while len(self._unsettled) > self.max_unsettled:
      self._unsettled.popitem(last=False)

  def take_unsettled(self, nonce: str, identity: str, step: np.ndarray) -> Admitted | None:
    """The Admitted (`resent`) of an unsettled charge of ticket nonce `nonce` by budget key
    `identity` for the same step [p], removed from the records; None when there is none (not
    kept, expired, or another key or step: that submit is charged in full)."""
    rec = self._unsettled.get(nonce)
    if rec is None or rec[1] != identity or rec[2] != _step_digest(step):
      return None
    del self._unsettled[nonce]
    if rec[0] < time.monotonic():
      return None
    return Admitted(identity, step, nonce, rec[3], resent=True)

  def unsettled_count(self) -> int:
    """How many unsettled charges are kept for a resend."""
    return len(self._unsettled)
