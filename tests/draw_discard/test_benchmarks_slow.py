"""The service benchmarks (benchmarks/draw_discard_*.py) run end to end, briefly (slow)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script, *args, timeout=600):
  out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script), *args],
                       capture_output=True, text=True, timeout=timeout, cwd=REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _need_redis():
  if shutil.which("redis-server") is None:
    pytest.skip("redis-server binary not found")


def test_false_rejections_and_attacks():
  (frr,) = _run("draw_discard_acceptance.py", "frr", "--weights", "387", "--updates", "1000")
  assert frr["updates"] == 1000 and frr["rate"] <= 0.01
  rows = {r["attack"]: r for r in _run("draw_discard_acceptance.py", "attacks", "--weights", "387",
                                       "--submits", "100")}
  assert rows["collapse-copy"]["accepted"] == 0 and rows["collapse-average"]["accepted"] == 0
  assert rows["ratchet"]["mean_shift_in_steps"] < 3 * 100 / 20


@pytest.mark.parametrize("stores", [["memory"], ["redis"]])
def test_load_with_tls_and_tokens(stores):
  if "redis" in stores:
    _need_redis()
  rows = _run("draw_discard_load.py", "--stores", *stores, "--clients", "4", "--duration", "2")
  assert rows[0]["tls"] and rows[0]["updates"] > 0
  assert rows[0]["errors"] <= 0.01 * rows[0]["updates"] + 2


def test_soak_with_redis_restart_loses_nothing():
  _need_redis()
  (r,) = _run("draw_discard_soak.py", "--duration", "20", "--rate", "50", "--clients", "4",
              "--outage", "2")
  assert r["lost"] == 0 and r["acknowledged"] == r["unique_seqs"] > 0
  assert r["store_seq"] >= r["acknowledged"] and all(r["servers_alive"])


def test_draw_tracking_under_quota():
  rows = _run("draw_discard_draw_tracking.py", "--quota", "2", "--honest", "10",
              "--victim-updates", "10", "--victim-period", "0.3")
  assert rows[0]["attacker_draws_per_s"] <= 4.0 and rows[0]["victim_updates"] > 0
