"""HTTP bodies of the Draw and Discard service: weight encodings (JSON list, "b64", "raw") and
body reads bounded in size (413) and time (408)."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
from aiohttp import web

from tf_dpiter.draw_discard import parsing
from tf_dpiter.draw_discard import store as store_lib

ENCODINGS = ("json", "b64", "raw")


def query_encoding(request: web.Request) -> str:
  """The `encoding` query parameter of a GET: "json" (default), "b64" or "raw".

  Raises:
    parsing.RequestError: 400 bad_encoding for any other value.
  """
  encoding = request.query.get("encoding", "json")
  if encoding not in ENCODINGS:
    raise parsing.RequestError(400, "bad_encoding", "encoding must be 'json', 'b64' or 'raw'")
  return encoding


def _weights_payload(w: np.ndarray, encoding: str) -> bytes:
  if encoding == "b64":
    return (b'"encoding":"b64","weights_b64":"'
            + base64.b64encode(store_lib.encode_weights(w)) + b'"')
  return b'"weights":' + json.dumps(w.tolist()).encode()


def raw_weights_response(w: np.ndarray, version: str, headers: dict | None = None
                         ) -> web.Response:
  """An application/octet-stream response of the flat weights [p] as 8p little-endian
  float64 bytes, the model version in X-DDML-Version, plus extra `headers` (X-DDML-Seq,
  X-DDML-Ticket...)."""
  return web.Response(body=store_lib.encode_weights(w), content_type=parsing.RAW_TYPE,
                      headers={"X-DDML-Version": version, **(headers or {})})


def weights_response(w: np.ndarray, encoding: str, version: str, head: bytes
                     ) -> web.Response:
  """Flat weights [p] in `encoding` ("json", "b64" or "raw"): `{"version": ..., <head>
  "weights": [...]}` (or "weights_b64"), `head` being JSON members already encoded, each
  followed by a comma (ignored for "raw"), or the raw bytes."""
  if encoding == "raw":
    return raw_weights_response(w, version)
  body = (b'{"version":' + json.dumps(version).encode() + head + _weights_payload(w, encoding)
          + b'}')
  return web.Response(body=body, content_type=parsing.JSON_TYPE)


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
  """The whole request body, at most max_bytes bytes received within timeout_s seconds (no
  timer when it has already arrived).

  Raises:
    parsing.RequestError: 413 body_too_large, or 408 body_timeout (closes the connection).
  """
  if request.content_length is not None and request.content_length > max_bytes:
    raise parsing.RequestError(413, "body_too_large", f"body exceeds {max_bytes} bytes")
  try:
    if request.content.is_eof():  # the whole body has arrived: no timer needed
      return await request.read()
    async with asyncio.timeout(timeout_s):
      return await request.read()
  except web.HTTPRequestEntityTooLarge as e:
    raise parsing.RequestError(413, "body_too_large", f"body exceeds {max_bytes} bytes") from e
  except asyncio.TimeoutError as e:
    raise parsing.RequestError(408, "body_timeout", f"body not received within {timeout_s:g} s",
                               headers={"Connection": "close"}) from e
