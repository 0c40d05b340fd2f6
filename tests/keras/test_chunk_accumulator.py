"""`chunking.sum_over_chunks` with acc=None: the first chunk's sums are the accumulator (no
zeros made), the same sums as from zeros, for one chunk, equal chunks, tail chunks and a
dynamic number of chunks (which starts from zeros of `template`)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras.optimizer import chunking


def _chunk_fn(acc, chunk, mask):
  part = [tf.reduce_sum(chunk * mask[:, None], 0), tf.reduce_sum(mask)]
  if acc is not None:
    part = [a + p for a, p in zip(acc, part)]
  return part, tf.reduce_sum(mask), chunk


_TEMPLATE = [tf.TensorSpec([3], tf.float32), tf.TensorSpec([], tf.float32)]


@pytest.mark.parametrize("per_chunk", [None, 4, chunking.TailChunks([8, 4, 4]), "dynamic"])
def test_first_chunk_is_the_accumulator(per_chunk):
  """Sums over 16 records (the last 3 padding) equal the masked sum computed directly."""
  x = np.arange(48, dtype=np.float32).reshape(16, 3)
  mask = np.array([1.0] * 13 + [0.0] * 3, np.float32)
  if per_chunk == "dynamic":   # unknown batch size: a tf.while_loop over the chunks
    fn = tf.function(lambda x, m: chunking.sum_over_chunks(_chunk_fn, None, x, m, 5,
                                                           template=_TEMPLATE)[:2],
                     input_signature=[tf.TensorSpec([None, 3]), tf.TensorSpec([None])])
  else:
    fn = tf.function(lambda x, m: chunking.sum_over_chunks(_chunk_fn, None, x, m, per_chunk,
                                                           template=_TEMPLATE)[:2])
  (total, count), loss = fn(tf.constant(x), tf.constant(mask))
  np.testing.assert_allclose(total.numpy(), (x * mask[:, None]).sum(0))
  assert float(count) == 13.0 and float(loss) == 13.0


def test_dynamic_chunks_without_template_are_refused():
  fn = tf.function(lambda x, m: chunking.sum_over_chunks(_chunk_fn, None, x, m, 5),
                   input_signature=[tf.TensorSpec([None, 3]), tf.TensorSpec([None])])
  with pytest.raises(ParameterValueError, match="template"):
    fn(tf.zeros([16, 3]), tf.ones([16]))
