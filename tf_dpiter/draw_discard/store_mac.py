"""Slot integrity for the Draw and Discard stores: every stored instance carries a tag.

A stored instance is weights (8 p bytes, LE float64) | slot index (4) | write id (8) | tag
(16), tag = BLAKE2b-128 keyed with the slot key (keys.py, outside the store) over
generation | everything before it. A value of the wrong length, corrupted, copied from
another slot, of another generation or forged is refused on read (StoreCorrupt). Which
legitimate value is the newest a tag cannot show: rollbacks are caught by the sequence
high-water mark (redis_store.py) and write-backs by retired write ids (replay_guard.py).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

import numpy as np

from tf_dpiter.draw_discard.store import StoreCorrupt

TAIL = 4 + 8 + 16
__all__ = ["StoreCorrupt", "TAIL", "open_many", "seal", "write_ids"]


def seal(key: bytes, generation: str, index: int, w: np.ndarray) -> bytes:
  """The stored bytes of instance `w` in slot `index`.

  Args:
    key: the slot-integrity key (32 bytes).
    generation: the store's generation.
    index: the slot written.
    w: [p] weights.

  Returns:
    8 p + 28 bytes.
  """
  body = (np.ascontiguousarray(w, dtype="<f8").tobytes() + struct.pack(">I", index)
          + secrets.token_bytes(8))
  return body + _tag(key, generation, body)


def _tag(key: bytes, generation: str, body: bytes) -> bytes:
  h = hashlib.blake2b(digest_size=16, key=key)
  h.update(generation.encode())
  h.update(body)
  return h.digest()


def open_many(key: bytes, generation: str, raws: list, p: int,
              indices: list | None = None) -> bytes:
  """Checks stored values and returns their weight bytes, concatenated.

  Args:
    key: the slot-integrity key.
    generation: the store's generation.
    raws: stored values (bytes; None for a missing key).
    p: number of weights.
    indices: the slot index each value must carry (None: any, for history entries).

  Returns:
    len(raws) * 8 p bytes.

  Raises:
    StoreCorrupt: naming the first bad value's position and why.
  """
  out = []
  for j, raw in enumerate(raws):
    if raw is None:
      raise StoreCorrupt(f"stored instance {j} is missing")
    if len(raw) != 8 * p + TAIL:
      raise StoreCorrupt(f"stored instance {j} holds {len(raw)} bytes, expected {8 * p + TAIL}")
    body, tag = raw[:-16], raw[-16:]
    if not hmac.compare_digest(tag, _tag(key, generation, body)):
      raise StoreCorrupt(f"stored instance {j} fails its integrity tag (corrupted, forged or "
                         "from another generation)")
    if indices is not None and struct.unpack(">I", body[8 * p:8 * p + 4])[0] != indices[j]:
      raise StoreCorrupt(f"slot {indices[j]} holds the value of another slot")
    out.append(body[:8 * p])
  return b"".join(out)


def write_ids(raws: list, p: int) -> list:
  """The write ids of stored values (checked by open_many first).

  Args:
    raws: stored values of 8 p + TAIL bytes.
    p: number of weights.

  Returns:
    One 8-byte id per value.
  """
  return [raw[8 * p + 4:8 * p + 12] for raw in raws]
