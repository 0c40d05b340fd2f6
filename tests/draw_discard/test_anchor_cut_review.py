"""Review R (session 29): the Draw and Discard anchor file (anchor.py) cut or torn at every
byte never reads back a lower sequence number than the older intact record, and never as
"no anchor" (which would let a rolled-back store be adopted silently).

The file holds two 256-byte records (checksum | JSON with a counter n), each save overwriting
the older one in place; a crash can tear the record being written or (a file system that
loses the tail) cut the file. Every cut length 0..512 and a torn byte in each record.
"""

import pytest

from tf_dpiter.draw_discard import anchor as anchor_lib
from tf_dpiter.errors import ParameterValueError


def _saved(path, seqs):
  a = anchor_lib.Anchor(str(path))
  for seq in seqs:
    a.save("g", seq, epochs=1, last_epoch="e:0")
  a.close()
  return path.read_bytes()


@pytest.mark.parametrize("saves", [2, 3])   # the newest record in slot 1, then in slot 0
def test_a_cut_anchor_reads_an_intact_record_or_refuses(tmp_path, saves):
  path = tmp_path / "anchor"
  full = _saved(path, range(10, 10 + saves))
  newest, older = 10 + saves - 1, 10 + saves - 2
  newest_slot = (saves - 1) % 2
  def body_end(slot):   # the record's checksum and JSON end here; padding follows
    return slot * 256 + len(full[slot * 256:slot * 256 + 256].rstrip())

  for cut in range(0, len(full) + 1):
    path.write_bytes(full[:cut])
    intact = [seq for seq, slot in ((newest, newest_slot), (older, 1 - newest_slot))
              if cut >= body_end(slot)]
    if not intact:
      with pytest.raises(ParameterValueError, match="not an anchor file"):
        anchor_lib.Anchor(str(path)).load()
      continue
    got = anchor_lib.Anchor(str(path)).load()
    assert got["generation"] == "g" and got["seq"] == max(intact), (cut, got, intact)


def test_a_torn_byte_in_either_record_keeps_the_other(tmp_path):
  path = tmp_path / "anchor"
  full = _saved(path, [10, 11, 12])   # 12 in slot 0, 11 in slot 1
  for offset in range(0, 512, 7):
    torn = bytearray(full)
    torn[offset] ^= 0x5A
    path.write_bytes(bytes(torn))
    got = anchor_lib.Anchor(str(path)).load()
    assert got["seq"] == (11 if offset < 256 else 12), (offset, got)


def test_a_failed_write_never_moves_the_next_one_onto_the_newest_record(tmp_path, monkeypatch):
  """A save whose write fails (ENOSPC, EIO) part-way tears its slot; the next save must go to
  that same slot, not onto the newest intact record: otherwise a crash (or a second failure)
  during it leaves no intact record and the server cannot start on its anchor. Before: the
  counter moved on the failed write, the retry overwrote seq 11's slot, the file read "not an
  anchor file"."""
  import os
  path = tmp_path / "anchor"
  a = anchor_lib.Anchor(str(path))
  for seq in (10, 11):
    a.save("g", seq)
  real_pwrite = os.pwrite

  def torn_pwrite(fd, data, offset):  # a part of the record reaches the disk, then the error
    real_pwrite(fd, data[:24], offset)  # inside the checksum and JSON: the record is torn
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(os, "pwrite", torn_pwrite)
  for seq in (12, 13):  # the failing save, then its retry crashing part-way as well
    with pytest.raises(OSError):
      a.save("g", seq)
  monkeypatch.setattr(os, "pwrite", real_pwrite)
  got = anchor_lib.Anchor(str(path)).load()
  assert got["seq"] == 11  # the last save that returned (12 and 13 were never acknowledged)
  a.save("g", 14)
  assert anchor_lib.Anchor(str(path)).load()["seq"] == 14
  a.close()
