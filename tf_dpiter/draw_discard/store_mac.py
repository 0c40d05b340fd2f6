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
  """The stored bytes (8 p + 28) of the [p] instance `w` in slot `index` of the store's
  generation, under the 32-byte slot-integrity key."""
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
  """The weight bytes (len(raws) * 8 p) of stored values (None for a missing key),
  concatenated, after checking each against the key, the generation and the slot index it
  must carry (`indices`; None: any, for history entries).

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
  """One 8-byte write id per stored value of 8 p + TAIL bytes (checked by open_many first)."""
  return [raw[8 * p + 4:8 * p + 12] for raw in raws]
