"""tf_dpiter.data.python_source: from_generator's contract without its allocator side effect."""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data import python_source
from tf_dpiter.errors import ParameterTypeError


def _counting(n, log):
  def make():
    log.append("start")
    for i in range(n):
      log.append(i)
      yield (np.full([i % 3 + 1], i, np.int64), {"w": np.float32(i) / 2})
  return make


_SIG = (tf.TensorSpec([None], tf.int64), {"w": tf.TensorSpec([], tf.float32)})


def test_one_generator_per_iterator_in_order_with_nested_elements():
  log = []
  ds = python_source.python_dataset(_counting(5, log), _SIG)
  assert log == []                                   # nothing drawn when building
  first = list(ds.as_numpy_iterator())
  second = list(ds.as_numpy_iterator())
  for got in (first, second):
    assert [int(a[0]) for a, _ in got] == [0, 1, 2, 3, 4]
    assert [a.shape for a, _ in got] == [(1,), (2,), (3,), (1,), (2,)]
    assert [float(d["w"]) for _, d in got] == [0.0, 0.5, 1.0, 1.5, 2.0]
  assert log == ["start", 0, 1, 2, 3, 4] * 2        # a new generator per iterator
  assert ds.element_spec == _SIG


def test_interleaved_iterators_keep_their_own_generators():
  ds = python_source.python_dataset(_counting(4, []), _SIG)
  a, b = iter(ds), iter(ds)
  got = [int(next(it)[0][0]) for it in (a, b, a, a, b)]
  assert got == [0, 0, 1, 2, 1]


def test_reads_no_further_ahead_than_the_prefetch():
  """7 elements taken through prefetch(2): at most 9 drawn, as from_generator draws (measured
  with from_generator in a separate process: building one in this worker would set the
  allocator option this module avoids, for every later test of the worker)."""
  drawn = []

  def make():
    for i in range(100):
      drawn.append(i)
      yield np.int64(i)
  it = iter(python_source.python_dataset(make, tf.TensorSpec([], tf.int64)).prefetch(2))
  assert [int(next(it)) for _ in range(7)] == list(range(7))
  time.sleep(0.5)   # let the prefetch fill its buffer
  assert 7 <= len(drawn) <= 9


def test_bad_elements_and_arguments_are_refused():
  with pytest.raises(ParameterTypeError, match="make_generator"):
    python_source.python_dataset([1, 2], tf.TensorSpec([], tf.int64))
  with pytest.raises(ParameterTypeError, match="output_signature"):
    python_source.python_dataset(lambda: iter([]), tf.TensorSpec(None, tf.int64))
  bad_shape = python_source.python_dataset(lambda: iter([np.zeros([2, 3])]),
                                           tf.TensorSpec([None, 4], tf.float32))
  with pytest.raises(tf.errors.OpError, match="shape"):
    list(bad_shape)
  bad_arity = python_source.python_dataset(lambda: iter([(1, 2)]),
                                           tf.TensorSpec([], tf.float32))
  with pytest.raises(tf.errors.OpError, match="yielded 2 arrays"):
    list(bad_arity)


def test_an_iterator_whose_generator_was_dropped_is_refused(monkeypatch):
  monkeypatch.setattr(python_source, "MAX_LIVE_ITERATORS", 2)
  ds = python_source.python_dataset(_counting(4, []), _SIG)
  old = iter(ds)
  next(old)
  newer = [iter(ds) for _ in range(2)]
  for it in newer:
    next(it)
  with pytest.raises(tf.errors.OpError, match="newer iterators"):
    next(old)


# The samplers' pipelines, each run for two samples: in the fresh-process probe and in-process.
_PIPELINES = textwrap.dedent("""
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    y = np.arange(20) % 2
    pipelines = [
        dp.data.poisson_batches(x, y, expected_batch_size=4, seed=0),
        dp.data.shuffled_batches(x, y, batch_size=4, seed=0),
        dp.data.poisson_user_batches(x, y, np.arange(20) % 5, 2, 4, seed=0),
        dp.data.poisson_batches_from_source(dp.data.ArraySource(x, y), 4, seed=0),
    ]
    for ds in pipelines:
      assert len(list(ds.take(2))) >= 1
""")
_PROBE = "import sys\nimport numpy as np\nimport tensorflow as tf\nimport tf_dpiter as dp\n" + (
    _PIPELINES) + textwrap.dedent("""
    sys.stderr.write("@@ours done@@\\n")
    sys.stderr.flush()
    list(tf.data.Dataset.from_generator(lambda: iter([1]), output_signature=tf.TensorSpec(
        [], tf.int32)))
""")


def _dataset_ops(ds):
  """Every op type of a dataset's graph and of the functions in its library (map, scan...)."""
  graph = tf.compat.v1.GraphDef()
  graph.ParseFromString(ds._as_serialized_graph(  # pylint: disable=protected-access
      external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE).numpy())
  ops = {n.op for n in graph.node}
  for function in graph.library.function:
    ops |= {n.op for n in function.node_def}
  return ops


def test_samplers_build_no_generator_dataset():
  """The in-process form of the check below (which needs a fresh process: the log line is
  written once, by the first GeneratorDataset kernel): the samplers' pipelines, run as there,
  hold no GeneratorDataset op in their graph or its functions; the control (from_generator)
  holds one."""
  namespace = {"np": np, "dp": dp}
  exec(_PIPELINES, namespace)  # pylint: disable=exec-used
  assert len(namespace["pipelines"]) == 4
  for ds in namespace["pipelines"]:
    ops = _dataset_ops(ds)
    assert "PyFunc" in ops and "GeneratorDataset" not in ops, sorted(ops)
  control = tf.data.Dataset.from_generator(lambda: iter([1]), output_signature=tf.TensorSpec(
      [], tf.int32))
  assert "GeneratorDataset" in _dataset_ops(control)


@pytest.mark.slow
def test_samplers_leave_the_allocator_alone():
  """TensorFlow's GeneratorDataset logs "Memory patch applied" when it sets glibc's
  M_TRIM_THRESHOLD (python_source's docstring); the samplers never build one. The control
  (a from_generator after them) shows the probe sees the line. A fresh process (about 8 CPU
  s), so with -m slow; the default suite checks the cause in-process (above)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", PYTHONWARNINGS="ignore")
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                       text=True, timeout=300, check=True).stderr
  ours, control = out.split("@@ours done@@")
  assert "Memory patch applied" not in ours
  assert "Memory patch applied" in control
