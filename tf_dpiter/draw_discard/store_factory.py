"""The store of a command-line spec: 'memory' (MemoryStore) or a Redis URL (RedisStore, loaded
only then; the redis package is optional). Kept above both stores: no import cycle."""

from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.errors import ParameterValueError


def make_store(spec: str, prefix: str = "ddml", lock_ttl_s: float = 10.0,
               group_commit: bool = True):
  """A MemoryStore ('memory') or a RedisStore ('redis://host:port/db', also rediss://,
  unix://) of its command-line form; for Redis, the key prefix, the initialization lock
  expiry and group_commit (pipeline the scripts of one event-loop iteration).

  Raises:
    ParameterValueError: for any other spec.
  """
  if spec == "memory":
    return store_lib.MemoryStore()
  if spec.startswith(("redis://", "rediss://", "unix://")):
    from tf_dpiter.draw_discard import redis_store  # pylint: disable=g-import-not-at-top  (redis is optional)
    return redis_store.RedisStore(spec, prefix=prefix, lock_ttl_s=lock_ttl_s,
                                  group_commit=group_commit)
  raise ParameterValueError(f"store must be 'memory' or 'redis://host:port/db', got {spec!r}")
