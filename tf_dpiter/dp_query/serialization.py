"""Serialization of DPQuery objects: {"class_name", "config": get_config()} with plain values
(child queries serialized), and a registry of classes (`register_query`; upper layers'
queries through `declare_query_module`). A rebuilt query has the same clip, noise and seed;
its generator starts afresh.
"""

import importlib
import numbers

import numpy as np
import tensorflow as tf

from tf_dpiter import dp_query as dp_query_package
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError

_REGISTRY = {}       # name -> class
_NAMES = {}          # class -> name
_TUPLE_KEY = "__tuple__"


def register_query(name=None):
  """Class decorator: makes a DPQuery subclass (de)serializable under `name`.

  Args:
    name: the registered name (default: the class name). The class must implement
      `get_config()` (and `from_config` unless its constructor takes the config).

  Returns:
    the decorator, which returns the class unchanged.

  Raises:
    ParameterTypeError: the decorated object is not a DPQuery subclass, or `name` is not a
      non-empty string.
    ParameterValueError: `name` is already registered for another class.
  """
  def decorator(cls):
    from tf_dpiter.dp_query import dp_query  # pylint: disable=g-import-not-at-top
    if not (isinstance(cls, type) and issubclass(cls, dp_query.DPQuery)):
      raise ParameterTypeError(f"register_query expects a DPQuery subclass, got {cls!r}")
    key = name or cls.__name__
    if not isinstance(key, str) or not key:
      raise ParameterTypeError(f"name must be a non-empty string, got {key!r}")
    old = _REGISTRY.get(key)
    if old is not None and old is not cls and (
        old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
      raise ParameterValueError(f"the DPQuery name {key!r} is already registered for "
                                f"{old.__module__}.{old.__qualname__}; pass another name")
    _REGISTRY[key] = cls
    _NAMES[cls] = key
    return cls
  return decorator


def _keras_registration():
  import keras  # pylint: disable=g-import-not-at-top  (imported when first needed)
  return keras.saving


def registered_name(cls):
  """The name class `cls` is serialized under (ours, else Keras'), or None when it is not
  registered."""
  if cls in _NAMES:
    return _NAMES[cls]
  ks = _keras_registration()
  name = ks.get_registered_name(cls)
  return name if ks.get_registered_object(name) is cls else None


def _how_to_register(name):
  return ("decorate the class with @tf_dpiter.dp_query.register_query() (or "
          "@keras.saving.register_keras_serializable()) and import it before loading, or pass "
          f"custom_objects={{{name!r}: TheClass}}")


def serialize(query):
  """The plain, JSON-able description of a registered DPQuery.

  Args:
    query: a DPQuery whose class is registered (`register_query`, or Keras' registration).

  Returns:
    {"class_name": its registered name, "config": query.get_config()}.

  Raises:
    ParameterTypeError: `query` is not a DPQuery, or its config is not plain JSON values.
    ParameterValueError: its class is not registered.
  """
  from tf_dpiter.dp_query import dp_query  # pylint: disable=g-import-not-at-top
  if not isinstance(query, dp_query.DPQuery):
    raise ParameterTypeError(f"serialize expects a DPQuery, got {query!r}")
  cls = type(query)
  name = registered_name(cls)
  if name is None:
    raise ParameterValueError(f"DPQuery class {cls.__qualname__!r} is not registered for "
                              f"serialization: {_how_to_register(cls.__name__)}")
  config = query.get_config()
  if not isinstance(config, dict):
    raise ParameterTypeError(f"{cls.__qualname__}.get_config() must return a dict, "
                             f"got {config!r}")
  _check_plain(config, f"{cls.__qualname__}.get_config()")
  return {"class_name": name, "config": config}


def _lookup(name, custom_objects):
  if custom_objects and name in custom_objects:
    return custom_objects[name]
  if name in _REGISTRY:
    return _REGISTRY[name]
  cls = _keras_registration().get_registered_object(name)  # sees load_model's custom_objects
  if cls is not None:
    return cls
  module = dp_query_package.declared_query_module(name)
  if module is not None:
    importlib.import_module(module)   # the module registers the class when it is imported
    return _REGISTRY.get(name)
  return None


def deserialize(config, custom_objects=None):
  """The DPQuery described by `config` (a dict from `serialize`); the class is looked up in
  `custom_objects`, the registry, Keras' registry, then the declared modules.

  Args:
    config: a dict {"class_name": str, "config": dict} (a DPQuery is returned as it is).
    custom_objects: optional {name: class} for unregistered classes (child queries too).

  Returns:
    the DPQuery, built by `cls.from_config(config["config"])`.

  Raises:
    ParameterValueError: a malformed dict or an unknown class name.
    ParameterTypeError: the name resolves to something that is not a DPQuery subclass.
  """
  from tf_dpiter.dp_query import dp_query  # pylint: disable=g-import-not-at-top
  if isinstance(config, dp_query.DPQuery):
    return config
  if not (isinstance(config, dict) and isinstance(config.get("class_name"), str)
          and isinstance(config.get("config", {}), dict)):
    raise ParameterValueError('a serialized DPQuery is a dict {"class_name": str, "config": dict}, '
                              f"got {config!r}")
  name = config["class_name"]
  cls = _lookup(name, custom_objects)
  if cls is None:
    raise ParameterValueError(f"unknown DPQuery class {name!r}: {_how_to_register(name)}")
  if not (isinstance(cls, type) and issubclass(cls, dp_query.DPQuery)):
    raise ParameterTypeError(f"{name!r} names {cls!r}, which is not a DPQuery subclass")
  inner = dict(config.get("config") or {})
  if custom_objects:
    with _keras_registration().CustomObjectScope(custom_objects):  # for child queries too
      return cls.from_config(inner)
  return cls.from_config(inner)


# ---- helpers for get_config / from_config ------------------------------------------

def plain(value):
  """A plain Python value for a config: tensors, variables and numpy values converted (a
  number/str/None/bool, or a nested list for an array)."""
  if isinstance(value, tf.Variable) or tf.is_tensor(value):
    value = value.numpy()
  if isinstance(value, np.ndarray):
    return value.tolist()
  return value.item() if isinstance(value, np.generic) else value


def _check_plain(value, where):
  if value is None or isinstance(value, (str, bool, numbers.Integral, float)):
    return
  if isinstance(value, list):
    for v in value:
      _check_plain(v, where)
    return
  if isinstance(value, dict):
    for k, v in value.items():
      if not isinstance(k, str):
        raise ParameterTypeError(f"{where}: dict keys must be strings to survive JSON, got {k!r}")
      _check_plain(v, where)
    return
  raise ParameterTypeError(f"{where} holds {value!r} of type {type(value).__name__}, which is "
                           "not a plain JSON value (number, str, bool, None, list, dict); "
                           "convert it (tuples: tf_dpiter.dp_query.serialization.encode_nest)")


def encode_nest(nest, leaf_fn=plain):
  """A JSON-able copy of a dict/list/tuple nest, leaves encoded by `leaf_fn`; tuples become
  {"__tuple__": [...]}.

  Raises:
    ParameterTypeError: a namedtuple or a non-string key.
    ParameterValueError: a dict with a key "class_name" or "__tuple__" (ambiguous).
  """
  if isinstance(nest, tuple) and hasattr(nest, "_fields"):
    raise ParameterTypeError(f"a namedtuple nest ({type(nest).__name__}) cannot be serialized; "
                             "use a dict")
  if isinstance(nest, tuple):
    return {_TUPLE_KEY: [encode_nest(x, leaf_fn) for x in nest]}
  if isinstance(nest, list):
    return [encode_nest(x, leaf_fn) for x in nest]
  if isinstance(nest, dict):
    for k in nest:
      if not isinstance(k, str):
        raise ParameterTypeError(f"a nest with a non-string key {k!r} cannot be serialized "
                                 "(JSON keys are strings)")
    if "class_name" in nest or _TUPLE_KEY in nest:
      raise ParameterValueError(f"a nest with a key 'class_name' or {_TUPLE_KEY!r} cannot be serialized "
                                f"unambiguously, got keys {sorted(nest)}")
    return {k: encode_nest(v, leaf_fn) for k, v in nest.items()}
  return leaf_fn(nest)


def decode_nest(data, leaf_fn=lambda x: x, is_leaf=lambda x: False):
  """Inverse of `encode_nest` (`leaf_fn` decodes a leaf, `is_leaf` says which dicts/lists are
  leaves): tuples restored, lists stay lists."""
  if is_leaf(data):
    return leaf_fn(data)
  if isinstance(data, dict) and set(data) == {_TUPLE_KEY}:
    return tuple(decode_nest(x, leaf_fn, is_leaf) for x in data[_TUPLE_KEY])
  if isinstance(data, (list, tuple)):
    return [decode_nest(x, leaf_fn, is_leaf) for x in data]
  if isinstance(data, dict):
    return {k: decode_nest(v, leaf_fn, is_leaf) for k, v in data.items()}
  return leaf_fn(data)


def encode_queries(nest):
  """`encode_nest` for a nest of DPQuery objects (each leaf `serialize`d; errors: those of
  `encode_nest` and `serialize`)."""
  return encode_nest(nest, serialize)


def decode_queries(data):
  """Inverse of `encode_queries` (a `deserialize` given custom_objects holds them in scope)."""
  return decode_nest(data, deserialize,
                     is_leaf=lambda d: isinstance(d, dict) and "class_name" in d)
