"""Review R18 (session 47) of session 46's ledger journal changes (ledger/journal.py: an append
cuts the last line a crash tore; one writer per journal, refused by the file's size).

Rule (`ledger.journal`): every step or round released was appended (fsynced) before, and a
restart charges every chunk in the file; a crash can tear only the last line (an append
interrupted before its fsync returned: its step was not released), which `read` drops and the
next append cuts; a second writer is refused before its step is released.

Finding 2 (read). The torn bytes are whatever the file system left past the last complete
line (a prefix of the interrupted line, zeros, or the stale contents of the blocks the size
grew into). `read` opened the file as text: a torn tail holding a byte that is not UTF-8 made
every restart raise UnicodeDecodeError (not the library's error), and one holding a carriage
return was read as a line end (universal newlines), so the torn bytes before it were a
complete line, "line 4 is not JSON": the journal refused at every restart until it is edited
by hand (its 9 steps unreadable). Fixed: the file is read as bytes, only b"\\n" ends a
line.

Finding 3 (_check_unchanged). One writer per journal was checked by the file's size only. Two
writers resumed on a journal with a torn tail both hold the size with the torn bytes; the
first cuts them and appends its chunk; when that chunk is as long as the torn bytes the size
is back where it was, and the second writer's append passes the check, cuts the first one's
chunk (its step already released) and appends its own: a restart charges 8 of the 9 steps
released. Rare: the torn bytes must be exactly as long as the new chunk, and a restarted
writer's chunk holds one more run-table entry than the chunk the crash tore (a federated
server's round 3: 688 bytes against 675), so the torn chunk must have held more runs (several
steps of a noise schedule in one chunk). Fixed: the append also compares the file's last
bytes with those it last read or wrote.
"""

import os
import warnings

import pytest

from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L
from tf_dpiter.errors import PrivacyConfigError


def _steps(led, count, z=1.1):
  for _ in range(count):
    led.record_sample(1000.0, 0.05, (dq.GaussianSumEvent(1.0, z),), policy="poisson",
                      sample_size=50)


def _journal(path, appends=(3, 4, 2)):
  """A journal of sum(appends) steps, one chunk per append (z 1, 2, 3, ...)."""
  led, journal = L.PrivacyLedger(), L.LedgerJournal(path)
  for i, n in enumerate(appends):
    _steps(led, n, z=1.0 + i)
    journal.append(led)
  return led


def _resumed(path):
  """(a restarted writer's journal, its ledger), the torn-line warning silenced."""
  led, journal = L.PrivacyLedger(), L.LedgerJournal(path)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    journal.resume(led)
  return journal, led


def _charged(path):
  """The steps a restart on `path` charges."""
  return int(L.LedgerJournal(path).resume(L.PrivacyLedger()))


TORN = {"prefix": b'{"format":"tf_dpiter.privacy_ledger","ver',
        "zeros": b"\0" * 40,
        "no_newline": None,   # the whole next chunk but its newline
        "carriage_return": b'{"format":"tf_dp\r\0\0\0',
        "not_utf8": b'{"format":"tf_dp\xe2\x82\0\0'}


@pytest.mark.parametrize("torn", [
    "prefix", "zeros", "no_newline",
    pytest.param("carriage_return", marks=pytest.mark.slow), "not_utf8"])
def test_a_journal_with_any_torn_tail_resumes_and_appends(tmp_path, torn):
  """9 steps journaled, a torn tail; the restart resumes 9, journals one more step; the next
  restart charges all 10."""
  path = str(tmp_path / "ledger.journal")
  _journal(path)
  tail = TORN[torn]
  if tail is None:
    scratch = str(tmp_path / "scratch.journal")
    _journal(scratch, (3, 4, 2, 1))
    tail = open(scratch, "rb").read().split(b"\n")[3]
  with open(path, "ab") as f:
    f.write(tail)
  journal, led = _resumed(path)
  _steps(led, 1, z=5.0)
  assert journal.append(led) == 1
  assert _charged(path) == 10


def test_a_second_writer_that_finds_the_size_it_read_is_refused(tmp_path):
  """Two writers resume a journal whose torn tail is as long as the chunk the first appends
  (the torn chunk held several steps, the new one one); both release a step."""
  path = str(tmp_path / "ledger.journal")
  _journal(path, (3, 4))
  scratch = str(tmp_path / "scratch.journal")
  _journal(scratch, (3, 4))
  a_journal, a = _resumed(scratch)
  _steps(a, 1, z=9.0)
  a_journal.append(a)
  chunk = os.path.getsize(scratch) - os.path.getsize(path)   # the first writer's chunk
  crashed = str(tmp_path / "crashed.journal")
  led = _journal(crashed, (3, 4))
  for z in (3.0, 4.0, 5.0, 6.0):      # the crashed chunk: four runs of steps
    _steps(led, 1, z=z)
  L.LedgerJournal(crashed).append(led)
  crashed_line = open(crashed, "rb").read().split(b"\n")[2]
  assert len(crashed_line) > chunk
  with open(path, "ab") as f:
    f.write(crashed_line[:chunk])
  (a_journal, a), (b_journal, b) = _resumed(path), _resumed(path)
  _steps(a, 1, z=9.0)
  assert a_journal.append(a) == 1                 # its step is released
  assert os.path.getsize(path) == b_journal._size   # pylint: disable=protected-access
  _steps(b, 1, z=9.0)
  try:
    b_journal.append(b)
  except PrivacyConfigError:
    assert _charged(path) == 8                     # 7 + the first writer's step
    return
  pytest.fail(f"the second writer appended: a restart charges {_charged(path)} of the 9 "
              "steps released (the first writer's chunk cut)")
