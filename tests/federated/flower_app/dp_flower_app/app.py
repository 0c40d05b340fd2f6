"""ServerApp and ClientApp of the test Flower App: DP-FedAvg on tiny synthetic data.

Run config ([tool.flwr.app.config] in pyproject.toml, override with `flwr run -c`): num-server-rounds,
num-clients (K), clients-per-round (m), noise-multiplier (z),
l2-norm-clip, target-delta, local-epochs, batch-size, learning-rate,
examples-per-client, seed, result-file.

Each SuperNode holds one partition of the synthetic data set, chosen by its node config
(`--node-config "partition-id=0 num-partitions=3"`). At the end of the run the ServerApp
writes the ledger's epsilon and the per-round info to `result-file` (run config) or, if
that is empty, to the file named by the env var TF_DPITER_FLOWER_RESULT (if set).
"""

import json
import os

from tf_dpiter import accounting
from tf_dpiter import dp_query as dpq
from tf_dpiter import federated as F
from tf_dpiter.federated import flower as FL

from dp_flower_app.data import synthetic

RESULT_ENV = "TF_DPITER_FLOWER_RESULT"

MODEL = F.MLP((12, 8, 4), use_bias=True)


def load_examples(context):
  """This SuperNode's own examples: partition `partition-id` of `num-partitions`."""
  k = int(context.node_config["num-partitions"])
  pid = int(context.node_config["partition-id"])
  per_client = int(context.run_config.get("examples-per-client", 20))
  fd = F.partition_iid(*synthetic(), k, examples_per_client=per_client, seed=0)
  return fd.client_examples(pid)


client_app = FL.make_client_app(
    MODEL, load_examples, seed_fn=lambda ctx: int(ctx.node_config["partition-id"]))

def make_strategy(context):
  cfg = context.run_config
  clip, z = float(cfg["l2-norm-clip"]), float(cfg["noise-multiplier"])
  seed = int(cfg["seed"])
  return FL.DPFedAvgMessageStrategy(
      MODEL, dpq.GaussianSumQuery(clip, z * clip, seed=seed), MODEL.init_params(seed=seed),
      num_clients=int(cfg["num-clients"]), clients_per_round=int(cfg["clients-per-round"]),
      train_config={"epochs": int(cfg["local-epochs"]), "batch_size": int(cfg["batch-size"]),
                    "lr": float(cfg["learning-rate"])},
      fixed_delta=float(cfg["target-delta"]), seed=seed)


def write_result(strategy, result, context):
  """Writes the ledger's epsilon and the rounds to `result-file` (or $TF_DPITER_FLOWER_RESULT)."""
  path = str(context.run_config.get("result-file", "")) or os.environ.get(RESULT_ENV, "")
  if not path:
    return
  rounds = strategy.rounds
  count = int(strategy.ledger.sample_count)
  delta = float(context.run_config["target-delta"])
  out = dict(
      num_rounds=int(context.run_config["num-server-rounds"]),
      rounds=rounds,
      ledger_epsilon=float(accounting.epsilon(strategy.ledger, delta)) if count else None,
      epsilon=rounds[-1].get("epsilon") if rounds else None,
      delta=rounds[-1].get("delta") if rounds else None,
      sample_count=count,
      stopped_reason=strategy.stopped_reason,
      final_arrays=len(result.arrays) if result.arrays is not None else 0,
      run_id=context.run_id)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(out, f, default=float)
  os.replace(tmp, path)


server_app = FL.make_server_app(make_strategy, num_rounds="num-server-rounds",
                                on_finish=write_result)
