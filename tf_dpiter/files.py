"""Whole-file writes that a crash cannot tear: a reader finds the old file or the new one.

A file written in place (Keras' `model.save`, `save_weights`, hence `ModelCheckpoint` and
`BackupAndRestore`) is truncated when it is opened: a process killed while it writes leaves
neither the earlier file nor the new one, and with the earlier checkpoint goes the ledger it
carried. `replaced` writes the new file beside the old one under a temporary name, flushes it
to disk, renames it over the old one (`os.replace`: one atomic step on POSIX and Windows) and
flushes the directory, so at every instant the path holds a whole file.
"""

import contextlib
import errno
import os
import re
import secrets

# flock's errors on a file system that has no such lock (NFS without a lock manager, ...):
# a caller that locks a file (draw_discard/anchor.py, ledger/journal.py) goes on unlocked.
NO_FLOCK_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

# Paths that are not files of this machine's file system (Keras' remote patterns: GCS, HDFS,
# any URL): written as they were, in place.
_REMOTE = re.compile(r"^(/cns|/cfs|/gcs|/hdfs|/readahead|/placer|/tfhub|.*://)")


def is_local_file_path(path):
  """True when `path` (str or os.PathLike) names a file of the local file system.

  Args:
    path: the path to test.

  Returns:
    bool: False for other types and for remote patterns (URLs, /gcs, /hdfs, ...).
  """
  return isinstance(path, (str, os.PathLike)) and not _REMOTE.match(os.fspath(path))


@contextlib.contextmanager
def replaced(path, suffix=""):
  """Yields a temporary path beside `path`; the file written there replaces `path` when the
  block ends, or is removed when the block raises (`path` is then untouched).

  The temporary file is `.NAME.PID.RANDOM.tmpSUFFIX` in `path`'s directory (a writer that
  reads the format from the name, as Keras does, gets `suffix`). The block's writer creates it,
  so its permissions are the ones the writer gives. On success the file is fsynced, renamed
  over `path` and the directory fsynced. A process killed inside the block leaves `path` as it
  was and the hidden temporary file behind.

  Args:
    path: the destination file (str or os.PathLike), on the local file system.
    suffix: the end of the temporary name, e.g. ".keras" or ".weights.h5".

  Yields:
    str, the temporary path to write.
  """
  path = os.fspath(path)
  directory = os.path.dirname(os.path.abspath(path))
  tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}."
                                f"{secrets.token_hex(4)}.tmp{suffix}")
  try:
    yield tmp
    _fsync(tmp, os.O_RDONLY)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise
  _fsync(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))   # the rename itself


def _fsync(path, flags):
  """Flushes the file or directory `path` to disk."""
  fd = os.open(path, flags)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
