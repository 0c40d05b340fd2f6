"""tf.distribute.MultiWorkerMirroredStrategy with 2 worker processes on loopback (TF_CONFIG),
CPU only: one global Poisson sample per step (each worker samples its own range of the
records, tf_dpiter.data.indexed_sampling.distributed_poisson_batches), one ledger sample per
step, epsilon equal to a single-worker run of the same steps (dp-accounting by hand), workers
in sync, and the noise scale z C / B. Keras' fit under the strategy needs
tf_dpiter.keras.multi_worker.MultiWorkerFitMixin (see there). Each run starts 2 processes
(1-6 min on a loaded 2-core machine): slow."""

import json
import os
import socket
import subprocess
import sys

import dp_accounting
import pytest

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


def run_workers(tmp_path, scenario, num_workers=2, seed="none", timeout=420):
  """Runs the worker script in `num_workers` processes; returns their JSON outputs."""
  cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(num_workers)]}
  procs, outs = [], []
  for i in range(num_workers):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
               CUDA_VISIBLE_DEVICES="")
    outs.append(str(tmp_path / f"{scenario}_{i}.json"))
    procs.append(subprocess.Popen(
        [sys.executable, os.path.join(HERE, "multi_worker_worker.py"), scenario, outs[-1], seed],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  logs = [p.communicate(timeout=timeout)[0] for p in procs]
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
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


@pytest.mark.slow
def test_two_workers_one_global_poisson_sample_per_step(os_entropy_run):
  chief, other = os_entropy_run
  assert (chief["replicas"], chief["workers"], chief["chief"], other["chief"]) == (
      2, 2, True, False)
  for out in (chief, other):
    assert "error" not in out, out
    led = out["ledger"]
    assert led["samples"] == out["noisy_ledger_samples"] == STEPS   # one per global step
    (run,) = led["runs"]
    assert (run["policy"], run["population_size"], run["count"]) == ("poisson", N, STEPS)
    assert run["selection_probability"] == pytest.approx(B / N, rel=1e-12)
    assert led["epsilon"] == pytest.approx(_single_worker_epsilon(STEPS), rel=1e-9)
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
