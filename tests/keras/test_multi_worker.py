"""tf.distribute.MultiWorkerMirroredStrategy with 2 and 3 worker processes on loopback
(TF_CONFIG), CPU only: one global Poisson sample per step (each worker samples its own range
of the records, tf_dpiter.data.indexed_sampling.distributed_poisson_batches), one ledger
sample per step, epsilon equal to a single-worker run of the same steps (dp-accounting by
hand), workers in sync, and the noise scale z C / B. Keras' fit under the strategy needs
tf_dpiter.keras.model.multi_worker.MultiWorkerFitMixin (see there). Kill and resume: a worker is
SIGKILLed mid-training, the job is restarted from BackupAndRestore, and the chief's ledger
(the only one written) charges every noised step taken. Each run starts 2-3 processes
(3-8 min on a loaded 2-core machine): slow."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import dp_accounting
import pytest

from tf_dpiter.ledger import journal

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
N, B, STEPS, Z = 400, 40, 6, 1.25     # as in multi_worker_worker.py


def _free_ports(k):
  socks = [socket.socket() for _ in range(k)]
  for s in socks:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


def _worker_env(cluster, index):
  return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
              TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
              CUDA_VISIBLE_DEVICES="")


def start_workers(tmp_path, script, args, num_workers, tag):
  """Starts `script` in `num_workers` processes (one TF_CONFIG cluster on fresh loopback
  ports); worker i gets argv args(i). Returns (processes, log paths)."""
  cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(num_workers)]}
  procs, logs = [], []
  for i in range(num_workers):
    logs.append(tmp_path / f"{tag}_{i}.log")
    with open(logs[-1], "w", encoding="utf-8") as log:
      procs.append(subprocess.Popen(
          [sys.executable, os.path.join(HERE, script), *args(i)], env=_worker_env(cluster, i),
          cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
  return procs, logs


def wait_workers(procs, logs, timeout, expect_killed=()):
  """Waits for every process; as soon as one fails (a worker in `expect_killed` may die of
  SIGKILL), the others, stuck in collectives, are killed and the test fails with the logs."""
  deadline = time.monotonic() + timeout
  while any(p.poll() is None for p in procs):
    failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)
              and not (i in expect_killed and p.returncode == -signal.SIGKILL)]
    if failed or time.monotonic() > deadline:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
      tails = [f"--- worker {i} (rc {p.returncode}) ---\n" + logs[i].read_text()[-2500:]
               for i, p in enumerate(procs)]
      pytest.fail("multi-worker run failed or timed out:\n" + "\n".join(tails))
    time.sleep(0.5)
  return [p.returncode for p in procs]


def run_workers(tmp_path, scenario, num_workers=2, seed="none", timeout=420):
  """Runs the worker script in `num_workers` processes; returns their JSON outputs."""
  outs = [str(tmp_path / f"{scenario}_{i}.json") for i in range(num_workers)]
  procs, logs = start_workers(tmp_path, "multi_worker_worker.py",
                              lambda i: (scenario, outs[i], seed), num_workers, scenario)
  wait_workers(procs, logs, timeout)
  results = []
  for path in outs:
    with open(path, encoding="utf-8") as f:
      results.append(json.load(f))
  return results


def _single_worker_epsilon(steps):
  acc = dp_accounting.rdp.RdpAccountant()
  acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      B / N, dp_accounting.GaussianDpEvent(Z)), steps))
  return acc.get_epsilon(1e-5)


@pytest.fixture(name="os_entropy_run", scope="module")
def _os_entropy_run(tmp_path_factory):
  return run_workers(tmp_path_factory.mktemp("mw"), "source")


def _check_one_global_sample_per_step(out, num_workers):
  assert "error" not in out, out
  assert (out["replicas"], out["workers"]) == (num_workers, num_workers)
  led = out["ledger"]
  assert led["samples"] == out["noisy_ledger_samples"] == STEPS   # one per global step
  (run,) = led["runs"]
  assert (run["policy"], run["population_size"], run["count"]) == ("poisson", N, STEPS)
  assert run["selection_probability"] == pytest.approx(B / N, rel=1e-12)
  assert led["epsilon"] == pytest.approx(_single_worker_epsilon(STEPS), rel=1e-9)


@pytest.mark.slow
def test_two_workers_one_global_poisson_sample_per_step(os_entropy_run):
  chief, other = os_entropy_run
  assert (chief["chief"], other["chief"]) == (True, False)
  for out in (chief, other):
    _check_one_global_sample_per_step(out, 2)
  assert chief["weights"] == other["weights"]          # the workers stay in sync
  assert chief["own_value"] != other["own_value"]
  assert other["broadcast"] == chief["broadcast"] == chief["own_value"]


# Relative standard error of a std estimated from 18000 draws: 1 / sqrt(2 * 18000) = 0.53%;
# allow 5 standard errors.
STD_TOL = 5 / (2 * 3000 * STEPS) ** 0.5


@pytest.mark.slow
def test_noise_std_is_z_c_over_b_when_the_workers_generators_agree(tmp_path):
  # Same seed on every worker (tests only): every worker adds the same draw, Keras' average
  # of the workers' updates keeps it whole.
  chief, other = run_workers(tmp_path, "source", seed="3")
  assert abs(chief["noise_std_ratio"] - 1.0) < STD_TOL, chief["noise_std_ratio"]
  assert chief["noise_head"] == other["noise_head"]


@pytest.mark.slow
def test_noise_std_is_z_c_over_b_with_os_entropy(os_entropy_run):
  chief, other = os_entropy_run
  assert abs(chief["noise_std_ratio"] - 1.0) < STD_TOL, chief["noise_std_ratio"]
  assert chief["noise_head"] == other["noise_head"]


@pytest.mark.slow
def test_three_workers_one_global_poisson_sample_per_step(tmp_path):
  # The same properties with 3 worker processes (each samples its own third of the records).
  outs = run_workers(tmp_path, "source", num_workers=3, timeout=600)
  assert [o["chief"] for o in outs] == [True, False, False]
  for out in outs:
    _check_one_global_sample_per_step(out, 3)
    assert out["weights"] == outs[0]["weights"]          # the workers stay in sync
    assert out["noise_head"] == outs[0]["noise_head"]    # noise drawn from the chief's state
    assert out["broadcast"] == outs[0]["own_value"]
  assert len({tuple(o["own_value"]) for o in outs}) == 3
  assert abs(outs[0]["noise_std_ratio"] - 1.0) < STD_TOL, outs[0]["noise_std_ratio"]


# ---- kill and resume (multi_worker_fault_worker.py) ----
FAULT_EPOCHS, FAULT_SPE = 4, 2     # as in multi_worker_fault_worker.py (same N, B, Z)
KILL_AFTER = 5        # worker 1 SIGKILLs itself before its 6th step (mid epoch 2)


def _fault_job(tmp_path, tag, kill_after):
  backup, files = tmp_path / "backup", tmp_path / "files"
  files.mkdir(exist_ok=True)
  outs = [str(tmp_path / f"{tag}_{i}.json") for i in range(2)]
  procs, logs = start_workers(
      tmp_path, "multi_worker_fault_worker.py",
      lambda i: (outs[i], str(backup), str(files), str(kill_after[i])), 2, tag)
  return procs, logs, outs


@pytest.fixture(name="kill_and_resume", scope="module")
def _kill_and_resume(tmp_path_factory):
  """Worker 1 is SIGKILLed mid-training; the job is restarted (both workers) from the
  BackupAndRestore directory and runs to the end."""
  tmp = tmp_path_factory.mktemp("fault")
  procs, logs, _ = _fault_job(tmp, "killed", (-1, KILL_AFTER))
  deadline = time.monotonic() + 420
  while procs[1].poll() is None and procs[0].poll() in (None, 0):
    assert time.monotonic() < deadline, "worker 1 never reached its kill step"
    time.sleep(0.5)
  assert procs[1].returncode == -signal.SIGKILL, logs[1].read_text()[-2500:]
  # MultiWorkerMirroredStrategy cannot replace a worker inside a running job: the chief
  # stays blocked in the step's all-reduce. Keras' fault tolerance restarts the whole job.
  try:
    procs[0].wait(timeout=20)
  except subprocess.TimeoutExpired:
    procs[0].kill()
    procs[0].wait()
  chief_first_rc = procs[0].returncode
  procs, logs, outs = _fault_job(tmp, "resumed", (-1, -1))
  wait_workers(procs, logs, 420)
  results = []
  for path in outs:
    with open(path, encoding="utf-8") as f:
      results.append(json.load(f))
  return tmp, results, chief_first_rc


def _lines(path):
  return len(path.read_text().split()) if path.exists() else 0


@pytest.mark.slow
def test_kill_and_resume_charges_every_noised_step(kill_and_resume):
  tmp, (chief, other), chief_first_rc = kill_and_resume
  # the chief did not survive its peer's death (failed collective, or killed after 20 s)
  assert chief_first_rc != 0
  assert (chief["chief"], other["chief"]) == (True, False)
  total = FAULT_EPOCHS * FAULT_SPE
  # the restored job resumed from the backup of the last finished epoch (epoch 2 of 4)
  assert chief["epochs_run"] == other["epochs_run"] == FAULT_EPOCHS - KILL_AFTER // FAULT_SPE
  assert chief["iterations"] == total                     # the restored optimizer's steps
  steps_taken = _lines(tmp / "files" / "steps_0.txt")     # noised steps the chief completed
  assert steps_taken == KILL_AFTER + total - (KILL_AFTER // FAULT_SPE) * FAULT_SPE
  samples, _, _ = journal.LedgerJournal(str(tmp / "backup" / "privacy_ledger.journal")).read()
  # Rule: every noised step ever taken is charged (re-run steps included).
  assert chief["samples"] == samples.shape[0] >= steps_taken >= chief["iterations"]
  assert chief["epsilon"] == pytest.approx(_single_worker_epsilon(chief["samples"]), rel=1e-9)
  assert chief["epsilon"] >= _single_worker_epsilon(total)      # >= an uninterrupted run
  # the other worker loaded the chief's journal: the same ledger, the same weights
  assert other["samples"] == chief["samples"]
  assert other["weights"] == chief["weights"]


@pytest.mark.slow
def test_only_the_chief_writes_ledger_files(kill_and_resume):
  tmp, _, _ = kill_and_resume
  files = tmp / "files"
  assert (files / "ledger_0.json").exists()
  assert not (files / "ledger_1.json").exists()           # LedgerExport dropped on worker 1
  assert (files / "steps_1.txt").exists()                 # though worker 1 trained
  journals = sorted(p.name for p in tmp.rglob("*journal*"))
  assert journals == ["privacy_ledger.journal"]           # one journal, the chief's
