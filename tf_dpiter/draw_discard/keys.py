"""Service secrets kept outside the store: the ticket key and the slot-integrity key.

One secret (>= 32 bytes; `serve --key-file` or `DDML_SECRET`) is shared by a store's
servers and never written to it; the ticket and slot keys are HMAC-SHA256 of it under fixed
labels, and the store holds only `key_id` (a third label), so a server with another secret
cannot join (StoreMismatch). Without a secret one is made per process (no second server
can join). `legacy_store_key=True` (`--insecure-key-in-store`) keeps it in the store's meta
as older versions did: a store reader can then forge tickets and tags (a startup warning).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from tf_dpiter.errors import ParameterValueError

ENV = "DDML_SECRET"
MIN_BYTES = 32


def derive(secret: bytes, label: str) -> bytes:
  """HMAC-SHA256(secret, label): the 32-byte key of one purpose ("tickets", "slots",
  "key_id")."""
  return hmac.new(secret, b"ddml/" + label.encode(), hashlib.sha256).digest()


def key_id(secret: bytes) -> str:
  """The public identifier (32 hex characters, stored in the meta) of a secret; reveals
  nothing about the secret."""
  return derive(secret, "key_id")[:16].hex()


def _check(secret: bytes, where: str) -> bytes:
  if len(secret) < MIN_BYTES:
    raise ParameterValueError(f"the secret from {where} must hold >= {MIN_BYTES} bytes "
                              f"(64 hex characters); received {len(secret)} bytes. Make one with "
                              "`python -c \"import secrets;print(secrets.token_hex(32))\"`")
  return secret


def _parse(raw: bytes, where: str) -> bytes:
  try:
    secret = bytes.fromhex(raw.strip().decode("ascii"))
  except ValueError:  # UnicodeDecodeError included: not hex, the raw bytes are the secret
    secret = raw
  return _check(secret, where)


def load_secret(path: str | None = None, environ=None) -> bytes | None:
  """The shared secret from `path` (hex or raw) or the DDML_SECRET variable (hex) of
  `environ` (default os.environ); None when neither is given.

  Raises:
    OSError: when the file cannot be read.
    ParameterValueError: when the secret is shorter than 32 bytes.
  """
  if path is not None:
    with open(path, "rb") as f:
      return _parse(f.read(), f"--key-file {path}")
  value = (os.environ if environ is None else environ).get(ENV)
  return _parse(value.encode(), f"${ENV}") if value else None


def random_secret() -> bytes:
  """A fresh 32-byte random secret (one process on its own store)."""
  return secrets.token_bytes(MIN_BYTES)
