"""A real Flower deployment on loopback: SuperLink, 3 SuperNodes and `flwr run` (slow).

The Flower App in tests/federated/flower_app (ServerApp: `DPFedAvgMessageStrategy` through
`make_server_app`; ClientApp: `make_client_app`) runs over Flower's real transport: the
Fleet API (gRPC) between SuperLink and SuperNodes, the Runtime/Control HTTP API between the
CLI, the SuperLink and the ServerApp/ClientApp processes. The ServerApp writes the ledger's
epsilon and its rounds to a JSON file (run config `result-file`), checked here against
dp-accounting.

Every process runs under a temporary FLWR_HOME (the CLI's config.toml with the SuperLink
connection, the installed FAB) and is stopped in a finally block.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import dp_accounting as dpa
import pytest

from tf_dpiter.federated import flower as FL

APP_DIR = pathlib.Path(__file__).parent / "flower_app"
BIN = pathlib.Path(sys.executable).parent
CONNECTION = "loopback"


class _Deployment:
  """SuperLink and SuperNodes on 127.0.0.1 under a temporary FLWR_HOME."""

  def __init__(self, root):
    self.root = pathlib.Path(root)
    self.home = self.root / "flwr_home"
    self.home.mkdir()
    self.fleet_port, self.http_port = FL.free_port(), FL.free_port()
    (self.home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.http_port}"\n'
        "insecure = true\n", encoding="utf-8")
    self.env = dict(os.environ, FLWR_HOME=str(self.home),
                    PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
                    TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    self.procs = []      # (name, Popen, log path)

  def start(self, name, *args):
    log = self.root / f"{name}.log"
    with open(log, "wb") as f:
      # A new session per process: stop() ends it and the children it spawned
      # (SuperExec, ServerApp/ClientApp processes), and nothing else.
      proc = subprocess.Popen([str(BIN / args[0]), *args[1:]], stdout=f,
                              stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
                              start_new_session=True)
    self.procs.append((name, proc, log))
    return proc

  def start_superlink(self):
    return self.start("superlink", "flower-superlink", "--insecure",
                      "--fleet-api-address", f"127.0.0.1:{self.fleet_port}",
                      "--host", "127.0.0.1", "--port", str(self.http_port),
                      "--database", str(self.root / "superlink.db"),
                      "--disable-runtime-dependency-installation")

  def start_supernode(self, partition_id, num_partitions):
    return self.start(f"supernode{partition_id}", "flower-supernode", "--insecure",
                      "--superlink", f"127.0.0.1:{self.fleet_port}",
                      "--host", "127.0.0.1", "--port", str(FL.free_port()),
                      "--node-config",
                      f"partition-id={partition_id} num-partitions={num_partitions}")

  def flwr(self, *args, timeout=120):
    """Runs the flwr CLI; returns its parsed JSON output (every call uses --format json)."""
    res = subprocess.run([str(BIN / "flwr"), *args, "--format", "json"], env=self.env,
                         cwd=self.root, capture_output=True, text=True, timeout=timeout,
                         check=False)
    out = res.stdout
    try:
      return json.loads(out[out.index("{"):])
    except ValueError as e:
      raise AssertionError(f"flwr {' '.join(args)} (exit {res.returncode}):\n{out}\n"
                           f"{res.stderr}\n{self.logs()}") from e

  def check_alive(self):
    for name, proc, _ in self.procs:
      if proc.poll() is not None:
        raise AssertionError(f"{name} exited with {proc.returncode}\n{self.logs()}")

  def wait_for_nodes(self, count, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
      self.check_alive()
      out = self.flwr("supernode", "ls", CONNECTION)
      if out.get("success") and sum(
          n["status"] == "online" for n in out.get("nodes", [])) >= count:
        return
      time.sleep(1)
    raise AssertionError(f"fewer than {count} SuperNodes online after {timeout}s\n"
                         f"{self.logs()}")

  def wait_for_run(self, run_id, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
      self.check_alive()
      out = self.flwr("ls", CONNECTION, "--run-id", str(run_id))
      status = out["runs"][0]["status"] if out.get("runs") else ""
      if status.startswith("finished"):
        return out["runs"][0]
      time.sleep(2)
    raise AssertionError(f"run {run_id} not finished after {timeout}s\n{self.logs()}")

  def run_log(self, run_id):
    res = subprocess.run([str(BIN / "flwr"), "log", str(run_id), CONNECTION, "--show"],
                         env=self.env, cwd=self.root, capture_output=True, text=True,
                         timeout=60, check=False)
    return res.stdout[-6000:]

  def logs(self, chars=3000):
    return "\n".join(f"--- {name} log (tail) ---\n"
                     f"{log.read_text(errors='replace')[-chars:]}"
                     for name, _, log in self.procs)

  def stop(self):
    for _, proc, _ in self.procs:
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
          pass
    for _, proc, _ in self.procs:
      try:
        proc.wait(timeout=15)
      except subprocess.TimeoutExpired:
        pass
    for _, proc, _ in self.procs:
      try:               # the group: children (SuperExec, app processes) included
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      proc.wait(timeout=15)


@pytest.mark.slow
def test_flower_deployment_superlink_supernodes_flwr_run():
  k, m, z, rounds, delta = 3, 2, 1.3, 2, 1e-5
  with tempfile.TemporaryDirectory(prefix="tf_dpiter_flwr_") as root:
    dep = _Deployment(root)
    result_file = pathlib.Path(root) / "result.json"
    try:
      dep.start_superlink()
      for i in range(k):
        dep.start_supernode(i, k)
      dep.wait_for_nodes(k)
      # The strategy needs exactly K connected nodes at round 1 (the ledger's n).
      started = dep.flwr(
          "run", str(APP_DIR), CONNECTION,
          "--run-config", f'result-file="{result_file}" num-clients={k} '
                          f'clients-per-round={m} noise-multiplier={z} l2-norm-clip=0.5 '
                          f"target-delta={delta}")
      assert started.get("success"), started
      run_id = started["run-id"]
      run = dep.wait_for_run(run_id, timeout=420)
      assert run["status"] == "finished:completed", (run, dep.run_log(run_id))
      assert result_file.exists(), dep.run_log(run_id)
      result = json.loads(result_file.read_text())
    finally:
      dep.stop()

  assert str(result["run_id"]) == str(run_id)
  assert result["stopped_reason"] is None
  assert [r["round"] for r in result["rounds"]] == [1, 2]
  assert all(r["clients"] == m and r["returned"] == m and r["rejected"] == 0
             for r in result["rounds"]), result["rounds"]
  assert result["sample_count"] == rounds
  assert result["final_arrays"] == 4          # w_T of the MLP (two kernels, two biases)
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  acc.compose(dpa.SelfComposedDpEvent(
      dpa.SampledWithoutReplacementDpEvent(k, m, dpa.GaussianDpEvent(z / 2)), rounds))  # replace one client: 2S
  expected = acc.get_epsilon(delta)
  assert result["epsilon"] == pytest.approx(expected, rel=1e-6)
  assert result["ledger_epsilon"] == pytest.approx(expected, rel=1e-6)
  assert result["delta"] == pytest.approx(delta)
