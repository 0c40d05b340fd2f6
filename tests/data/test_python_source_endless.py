"""python_source.python_dataset(..., endless=True): the same elements, drawn as lazily, from
the scan alone (no end flag, take_while nor the map that drops the flag); a generator that
ends anyway fails its iterator, never read as the dataset's end (python_source docstring)."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.data import python_source

_SIG = (tf.TensorSpec([None], tf.int64), {"w": tf.TensorSpec([], tf.float32)})


def _make(log, n=None):
  def make():
    log.append("start")
    for i in (itertools.count() if n is None else range(n)):
      log.append(i)
      yield (np.full([i % 3 + 1], i, np.int64), {"w": np.float32(i) / 2})
  return make


def _take(ds, k):
  it = iter(ds)
  return [next(it) for _ in range(k)]


def test_endless_yields_the_elements_of_the_flagged_source_as_lazily():
  endless_log, flagged_log = [], []
  endless = python_source.python_dataset(_make(endless_log), _SIG, endless=True)
  flagged = python_source.python_dataset(_make(flagged_log), _SIG)
  assert endless.element_spec == flagged.element_spec == _SIG
  assert endless_log == []                                # nothing drawn when building
  for (a, d), (b, e) in zip(_take(endless, 5), _take(flagged, 5)):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert float(d["w"]) == float(e["w"])
  assert endless_log == flagged_log == ["start", 0, 1, 2, 3, 4]
  # two functions fewer: the scan is the source itself (no take_while, no map over it)
  assert "Scan" in type(endless._input_dataset).__name__   # pylint: disable=protected-access
  assert "Map" in type(flagged._input_dataset).__name__   # pylint: disable=protected-access


def test_an_endless_source_whose_generator_ends_fails_its_iterator():
  ds = python_source.python_dataset(_make([], n=2), _SIG, endless=True)
  it = iter(ds)
  assert [int(next(it)[0][0]) for _ in range(2)] == [0, 1]
  with pytest.raises(tf.errors.OpError, match="endless=True"):
    next(it)
