"""Client-level DP federated averaging (Geyer et al. 2017) on the privacy core (McMahan et al. 2018).

A record is one client's flattened model update; a sample is the set of clients of a round;
the unit of privacy is the client.

The simulation is `DPFedAvg` on `DPServer`; `MedianNormClipSumQuery` (Geyer et al. 2017's
clip) is NOT private. Flower deployment (optional dependency): `tf_dpiter.federated.flower`.
"""

from tf_dpiter.federated.client import LocalSGD, draw_example_order, local_sgd_one_client
from tf_dpiter.federated.data import FederatedData
from tf_dpiter.data.mnist import default_mnist_path
from tf_dpiter.federated.data import load_mnist, partition_iid, partition_noniid_shards
from tf_dpiter.federated.dpfedavg import DPFedAvg
from tf_dpiter.federated.model import MLP, accuracy
from tf_dpiter.federated.queries import (
    NOT_PRIVATE_WARNING, QUERY_KINDS, MedianNormClipSumQuery, make_query, median_of_masked,
    set_noise_multiplier)
from tf_dpiter.federated.reports import RoundReport, RunReport, update_statistics
from tf_dpiter.federated.schedules import RoundSchedule, as_schedule, linear_schedule
from tf_dpiter.federated.server import DPServer

__all__ = [
    "DPFedAvg", "DPServer", "FederatedData", "LocalSGD", "MLP", "MedianNormClipSumQuery",
    "NOT_PRIVATE_WARNING", "QUERY_KINDS", "RoundReport", "RoundSchedule", "RunReport", "accuracy",
    "as_schedule", "default_mnist_path", "draw_example_order", "linear_schedule",
    "load_mnist", "local_sgd_one_client", "make_query", "median_of_masked",
    "partition_iid", "partition_noniid_shards", "set_noise_multiplier", "update_statistics",
]
