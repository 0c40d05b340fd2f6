"""Group commit for the Redis store: the scripts requests issue in one event-loop iteration
travel in one pipeline; each stays atomic on its own."""

from __future__ import annotations

import asyncio

import redis.exceptions as redis_errors

from tf_dpiter.draw_discard import store as store_lib


class GroupCommit:
  """Queues script calls and sends them as one pipeline per event-loop iteration.

  Args:
    r: the redis.asyncio client.
    url: the store URL (for error messages).
    unavailable: the exception types that mean Redis cannot be reached.
    convert: maps a Redis error reply (an exception) to the exception the caller gets (None:
      unchanged), e.g. out of memory to store.StoreUnavailable.
  """

  def __init__(self, r, url: str, unavailable: tuple, convert=None):
    self._r, self.url, self._unavailable = r, url, unavailable
    self._convert = convert or (lambda e: e)
    self._queue: list = []  # (script, keys, args, future) waiting for the next pipeline
    self._flush_scheduled = False

  async def run(self, script, keys, args):
    """The reply of a registered redis-py Script run with KEYS `keys` and ARGV `args` in the
    next pipeline.

    Raises:
      store.StoreUnavailable: Redis cannot be reached; redis errors as raised.
    """
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    self._queue.append((script, keys, args, fut))
    if not self._flush_scheduled:
      self._flush_scheduled = True
      loop.call_soon(self._start_flush)
    return await fut

  def _start_flush(self) -> None:
    self._flush_scheduled = False
    batch, self._queue = self._queue, []
    asyncio.ensure_future(self._flush(batch))

  async def _flush(self, batch) -> None:
    try:
      if len(batch) == 1:
        script, keys, args, _ = batch[0]
        results = [await script(keys=keys, args=args)]
      else:  # plain EVALSHA (redis-py's pipelined Script runs SCRIPT EXISTS first: a round trip)
        pipe = self._r.pipeline(transaction=False)
        for script, keys, args, _ in batch:
          pipe.evalsha(script.sha, len(keys), *keys, *args)
        results = await pipe.execute(raise_on_error=False)
        for j, res in enumerate(results):  # scripts flushed (Redis restarted): load and rerun
          if isinstance(res, redis_errors.NoScriptError):
            script, keys, args, _ = batch[j]
            results[j] = await script(keys=keys, args=args)
    except self._unavailable as e:
      err = store_lib.StoreUnavailable(f"redis {self.url}: {type(e).__name__}: {e}")
      results = [err] * len(batch)
    except redis_errors.RedisError as e:
      results = [e] * len(batch)
    for (_, _, _, fut), res in zip(batch, results):
      if fut.done():  # the request was cancelled
        continue
      if isinstance(res, BaseException):
        fut.set_exception(self._convert(res))
      else:
        fut.set_result(res)
