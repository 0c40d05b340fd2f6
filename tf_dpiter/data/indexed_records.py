"""Random-access record sources for out-of-core sampling (McMahan et al. 2018, Section 5).

A Poisson sample is scattered over the data set, so a sampler reads record i without reading
records 0..i-1. Two sources share `num_records` and `read(indices)`:

* `TFRecordSource`: standard TFRecord shards with an offset index per shard
  (`<shard>.offsets.npy`, int64, one entry per record plus the end of the file), written
  chunk by chunk by `write_indexed_tfrecords`. Each payload is one element of a numpy
  structured dtype (fields "x" and "y", raw little-endian bytes: `record_dtype`), so a step
  decodes with one `np.frombuffer`; `tf.data.TFRecordDataset` still reads the files.
* `ArraySource`: numpy arrays in memory (or np.memmap).
"""

import json
import os

import numpy as np
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.data import sampling
from tf_dpiter.errors import ParameterValueError

META_NAME = "records.json"
_HEADER = 12   # uint64 length + uint32 masked CRC of the length
_FOOTER = 4    # uint32 masked CRC of the payload


def _field_dtype(name, a):
  a = np.asarray(a)
  return (name, a.dtype.newbyteorder("<"), a.shape[1:])


def record_dtype(x, y=None):
  """The numpy structured dtype of one record of chunk (x, y): fields "x" (and "y").

  x, y: arrays with the records on the leading axis (only dtype and trailing shape used).
  """
  fields = [_field_dtype("x", x)]
  if y is not None:
    fields.append(_field_dtype("y", y))
  return np.dtype(fields)


def _to_records(x, y, dtype):
  rec = np.empty(sampling.num_records(x if y is None else (x, y)), dtype)
  rec["x"] = x
  if y is not None:
    rec["y"] = y
  return rec


def write_indexed_tfrecords(directory, chunks, records_per_shard=100_000):
  """Writes (x, y) chunks as TFRecord shards with an offset index; returns the directory.

  Args:
    directory: output directory (created; must not hold a previous data set).
    chunks: iterable of (x, y) or (x, None) numpy chunks, records on the leading axis; every
      chunk has the same dtypes and trailing shapes. Only one chunk is in memory at a time.
    records_per_shard: records per shard file (the last shard may hold fewer).

  Returns:
    `directory`, readable by `TFRecordSource(directory)`.

  Raises:
    ParameterValueError: records_per_shard < 1, an existing data set, no record, or chunks whose
      layout differs.
  """
  validation.check_integer("records_per_shard", records_per_shard, 1)
  os.makedirs(directory, exist_ok=True)
  if os.path.exists(os.path.join(directory, META_NAME)):
    raise ParameterValueError(f"directory {directory!r} already holds an indexed data set")
  dtype, shards, counts = None, [], []
  writer, offsets = None, None

  def close_shard():
    writer.close()
    np.save(os.path.join(directory, shards[-1] + ".offsets.npy"), np.asarray(offsets, np.int64))
    counts.append(len(offsets) - 1)

  for x, y in chunks:
    dtype = record_dtype(x, y) if dtype is None else dtype
    if record_dtype(x, y) != dtype:
      raise ParameterValueError(f"chunk layout {record_dtype(x, y)} differs from the first chunk's {dtype}")
    for row in _to_records(x, y, dtype):
      if writer is None or len(offsets) - 1 == records_per_shard:
        if writer is not None:
          close_shard()
        shards.append(f"shard-{len(shards):05d}.tfrecord")
        writer = tf.io.TFRecordWriter(os.path.join(directory, shards[-1]))
        offsets = [0]
      payload = row.tobytes()
      writer.write(payload)
      offsets.append(offsets[-1] + _HEADER + len(payload) + _FOOTER)
  if writer is None:
    raise ParameterValueError("chunks held no record")
  close_shard()
  meta = {"shards": shards, "counts": counts,
          "dtype": np.lib.format.dtype_to_descr(dtype)}
  with open(os.path.join(directory, META_NAME), "w", encoding="utf-8") as f:
    json.dump(meta, f)
  return directory


def _decode(buf, dtype):
  rec = np.frombuffer(buf, dtype)
  return rec["x"], (rec["y"] if "y" in dtype.names else None)


class ArraySource:
  """Records held as arrays (in memory or np.memmap): the same interface as TFRecordSource.

  Args:
    x: the features, an array (or np.memmap) with the records on the leading axis.
    y: the labels, with as many records as x, or None.

  Raises:
    ParameterValueError: x and y hold different numbers of records.
  """

  def __init__(self, x, y=None):
    self._x = x
    self._y = y
    self._n = sampling.num_records(x if y is None else (x, y))

  @property
  def num_records(self):
    """n, the number of records."""
    return self._n

  @property
  def has_labels(self):
    """Whether read() returns labels."""
    return self._y is not None

  @property
  def element_layout(self):
    """[(dtype, trailing shape)] of x (and y)."""
    out = [(np.asarray(self._x[:0]).dtype, tuple(np.shape(self._x)[1:]))]
    if self._y is not None:
      out.append((np.asarray(self._y[:0]).dtype, tuple(np.shape(self._y)[1:])))
    return out

  def read(self, indices):
    """(x[indices], y[indices] or None) for sorted int64 indices.

    Args:
      indices: sorted int64 array of record indices in [0, n).

    Returns:
      Tuple (x[indices], y[indices]), the second None when the source has no y.
    """
    return self._x[indices], (None if self._y is None else self._y[indices])


class TFRecordSource:
  """Random access to the records written by `write_indexed_tfrecords`.

  `read(indices)` gathers the records at their indexed offsets from memory-mapped shards (one
  vectorized gather per shard; the OS pages in only what is touched): memory is the offset
  index (8 bytes a record) plus the records read.

  Args:
    directory: the directory `write_indexed_tfrecords` wrote.

  Raises:
    ParameterValueError: no indexed data set in `directory`.
  """

  def __init__(self, directory):
    path = os.path.join(directory, META_NAME)
    if not os.path.exists(path):
      raise ParameterValueError(f"no indexed data set in {directory!r} (missing {META_NAME})")
    with open(path, encoding="utf-8") as f:
      meta = json.load(f)
    self._dtype = np.lib.format.descr_to_dtype(
        [tuple(f) if len(f) == 2 else (f[0], f[1], tuple(f[2])) for f in meta["dtype"]])
    self._paths = [os.path.join(directory, s) for s in meta["shards"]]
    self._offsets = [np.load(p + ".offsets.npy") for p in self._paths]
    counts = [len(o) - 1 for o in self._offsets]
    if counts != list(meta["counts"]):
      raise ParameterValueError(f"offset indexes of {directory!r} hold {counts} records, "
                                f"{META_NAME} says {meta['counts']}")
    for p, o in zip(self._paths, self._offsets):
      if os.path.getsize(p) < o[-1]:
        raise ParameterValueError(f"shard {p!r} holds {os.path.getsize(p)} bytes, its offset index "
                                  f"{o[-1]} (truncated file?)")
    self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    self._maps = None

  @property
  def num_records(self):
    """n, the number of records over all shards."""
    return int(self._starts[-1])

  @property
  def has_labels(self):
    """Whether read() returns labels."""
    return "y" in self._dtype.names

  @property
  def element_layout(self):
    """[(dtype, trailing shape)] of x (and y)."""
    return [(self._dtype[k].base, self._dtype[k].shape) for k in self._dtype.names]

  @property
  def shard_paths(self):
    """The shard files, in record order (for sequential reading by TFRecordDataset)."""
    return list(self._paths)

  @property
  def dtype(self):
    """numpy structured dtype of one record's payload (tf.io.decode_raw with uint8)."""
    return self._dtype

  def read(self, indices):
    """(x[indices], y[indices] or None) for sorted int64 global record indices.

    Args:
      indices: sorted int64 array of global record indices in [0, num_records).

    Returns:
      Tuple (x[indices], y[indices]), the second None when the records have no y.

    Raises:
      ParameterValueError: if an index is out of range, or a shard is shorter than its offset
        index (truncated file).
    """
    indices = np.asarray(indices, np.int64)
    if indices.size and (indices[0] < 0 or indices[-1] >= self.num_records):
      raise ParameterValueError(f"record indices must be in [0, {self.num_records}), got "
                                f"[{indices[0]}, {indices[-1]}]")
    if self._maps is None:   # mapped lazily: the source may be built in another process
      self._maps = [np.memmap(p, np.uint8, "r") for p in self._paths]
    shard = np.searchsorted(self._starts, indices, side="right") - 1
    size = self._dtype.itemsize
    parts = []
    for s in np.unique(shard):
      offs = self._offsets[s][indices[shard == s] - self._starts[s]] + _HEADER
      if offs.size and offs[-1] + size > self._maps[s].shape[0]:
        raise ParameterValueError(f"shard {self._paths[s]!r} is shorter than its offset index "
                                  "(truncated file?)")
      parts.append(self._maps[s][offs[:, None] + np.arange(size)])   # one gather per shard
    buf = np.concatenate(parts) if parts else np.zeros([0, size], np.uint8)
    return _decode(buf.reshape(-1), self._dtype)

  def close(self):
    """Unmaps the shard files (mapped again by the next read)."""
    self._maps = None
