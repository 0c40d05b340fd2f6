"""A drawn instance is never paired with another version's spec: when the served version
moves on between a draw and its spec fetch, both clients refuse with DDMLError 409
version_changed (the caller draws again) instead of attaching the newer spec, against which
the privacy floor would then be checked."""
import asyncio
import dataclasses

import numpy as np
import pytest

from tf_dpiter.draw_discard import cli
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard.client_lib import AsyncDDMLClient, DDMLClient, DDMLError

SPEC = cli.dense_spec(9, epsilon=1.0, gamma=0.01)


def _server(spec_version):
  """A stand-in for the service's answers: draws are of SPEC.version, the spec endpoint
  answers `spec_version`'s spec; `calls` counts the spec fetches."""
  calls = []
  weights = store_lib.encode_weights(np.zeros(SPEC.num_weights))

  def answer(method, path, body=None, headers=None, raw=False):
    if path.startswith("/v1/draw"):
      return SPEC.version, weights
    assert path == "/v1/spec", path
    calls.append(path)
    return dataclasses.replace(SPEC, version=spec_version).to_dict()
  return answer, calls


def test_sync_draw_refuses_a_spec_of_another_version():
  c = DDMLClient("http://127.0.0.1:9")
  c._request, calls = _server("v-next")
  with pytest.raises(DDMLError, match="version_changed.*drew version") as e:
    c.draw()
  assert e.value.status == 409 and e.value.code == "version_changed"
  assert not c._specs  # nothing cached under the drawn version


def test_sync_draw_fetches_the_spec_once_per_version():
  c = DDMLClient("http://127.0.0.1:9")
  c._request, calls = _server(SPEC.version)
  first, second = c.draw(), c.draw()
  assert first.spec.version == second.spec.version == first.version == SPEC.version
  assert len(calls) == 1


def test_async_draw_refuses_a_spec_of_another_version():
  async def run():
    c = AsyncDDMLClient.__new__(AsyncDDMLClient)  # no aiohttp session: answers stand in
    c._specs, c.last_ticket = {}, None
    answer, _ = _server("v-next")

    async def request(*args, **kwargs):
      return answer(*args, **kwargs)
    c._request = request
    with pytest.raises(DDMLError, match="version_changed") as e:
      await c.draw()
    assert e.value.status == 409 and not c._specs
  asyncio.run(run())
