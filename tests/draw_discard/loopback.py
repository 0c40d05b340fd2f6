"""Loopback helpers for the round-3 tests: clients bound to a chosen 127.0.0.0/8 source.

Linux routes all of 127.0.0.0/8 to lo, so a client bound to 127.0.x.y is a distinct
address to the server (its identity when tokens are off, its /24 prefix for the
connection caps).
"""

import http.client

import numpy as np

from tf_dpiter.draw_discard import client, client_lib


def source(i: int, prefix: int = 1) -> str:
  """The i-th loopback source address 127.`prefix`.(i // 254).(1 + i % 254): 254 per /24."""
  return f"127.{prefix}.{i // 254}.{1 + i % 254}"


def prefix_source(i: int, first: int = 20) -> str:
  """The i-th loopback address in its own /24: 127.(first + i // 256).(i % 256).1."""
  return f"127.{first + i // 256}.{i % 256}.1"


class BoundClient(client_lib.DDMLClient):
  """DDMLClient whose connections leave from `src` (an address in 127.0.0.0/8)."""

  def __init__(self, base_url: str, src: str, **kw):
    kw.setdefault("insecure", True)
    kw.setdefault("timeout", 10.0)
    super().__init__(base_url, **kw)
    self._src = src

  def _connect(self):
    if self._tls:
      return http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout,
                                         context=self._ctx, source_address=(self._src, 0))
    return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout,
                                      source_address=(self._src, 0))


def honest_submit(c: client_lib.DDMLClient, rng: np.random.Generator):
  """One Algorithm-1 update on a fresh draw: (accepted?, error code or "", drawn, update)."""
  d = c.draw()
  dim = d.spec.num_weights - 1
  u = client.spec_update(d.spec, d.weights, {"x": rng.random((8, dim))}, np.zeros(8), rng=rng)
  try:
    c.submit(d, u)
    return True, "", d, u
  except client_lib.DDMLError as e:
    return False, e.code, d, u
