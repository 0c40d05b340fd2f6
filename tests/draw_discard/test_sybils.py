"""Sybils: k identities cost what docs/draw_discard_security.md states.

Loopback HTTP only (sources in 127.0.0.0/8); bounded: <= 60 submits per test.
"""

import numpy as np
import pytest

from tf_dpiter.draw_discard import auth, cli, service, sybil
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.errors import ParameterValueError
from tests.draw_discard import loopback

SPEC = cli.dense_spec(9, epsilon=1.0, gamma=0.01)


def _submit_all(url, sources, tokens=None, rng=None):
  rng, codes = rng or np.random.default_rng(7), []
  for i, src in enumerate(sources):
    with loopback.BoundClient(url, src, token=None if tokens is None else tokens[i]) as c:
      ok, code, _, _ = loopback.honest_submit(c, rng)
      codes.append("ok" if ok else code)
  return codes


def test_addresses_in_one_prefix_share_one_budget_without_tokens(start_service):
  """12 addresses of one /24 (tokens off) get the rate bound of one identity: 8 updates."""
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0)
  srv = start_service(svc)
  codes = _submit_all(srv.url, [f"127.40.0.{i + 1}" for i in range(12)])
  assert codes.count("ok") == 8  # was 12: one budget per address
  assert codes[8:] == ["influence_rate_exceeded"] * 4
  assert _submit_all(srv.url, ["127.40.1.1"]) == ["ok"]  # another /24: its own budget


def test_new_identities_are_held_to_their_share(start_service):
  """Three established tokens (first seen an hour ago, 5 updates each), then 39 fresh sybil
  tokens: with new_identity_share = 0.5 a new identity's update needs N + 1 <= max(min_new,
  0.5 (T + 1)) = 16 here (decayed counts; the first three updates weigh 2^-6 after an hour),
  so the sybils get 15 of 39 (before: 39)."""
  tokens = [f"token-{i:02d}-0123456789abcdef" for i in range(42)]
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0,
                            tokens=auth.TokenSet(tokens), new_identity_share=0.5)
  now = [0.0]
  svc.admission.newcomers.clock = lambda: now[0]
  srv = start_service(svc)
  assert _submit_all(srv.url, ["127.41.0.1"] * 3, tokens[:3]) == ["ok"] * 3
  now[0] = 3601.0  # the three are established now
  assert _submit_all(srv.url, ["127.41.0.1"] * 12, tokens[:3] * 4) == ["ok"] * 12
  codes = _submit_all(srv.url, [loopback.prefix_source(i, 42) for i in range(39)], tokens[3:])
  assert codes == ["ok"] * 15 + ["new_identity_share"] * 24
  assert _submit_all(srv.url, ["127.41.0.1"], tokens[2:3]) == ["ok"]  # established: unaffected


def test_share_cap_arithmetic_and_arguments():
  now = [0.0]
  cap = sybil.NewIdentityShare(0.25, window_s=600.0, new_age_s=60.0, min_new=2,
                               clock=lambda: now[0])
  assert cap.take("a") == (0.0, True) and cap.take("b") == (0.0, True)
  wait, new = cap.take("c")
  assert wait > 0 and not new  # 3 > max(2, 0.25 * 3)
  now[0] = 61.0
  assert cap.take("a") == (0.0, False)  # established after new_age_s
  assert sybil.budget_key("10.1.2.3", tokens=False) == "10.1.2.0/24"
  assert sybil.budget_key("2001:db8:1:2:3::4", tokens=False) == "2001:db8:1:2::/64"
  assert sybil.budget_key("abc", tokens=True) == "abc"
  with pytest.raises(ParameterValueError, match="new_identity_share"):
    sybil.NewIdentityShare(1.0)
  with pytest.raises(ParameterValueError, match="window_s"):
    sybil.NewIdentityShare(0.5, window_s=0)
