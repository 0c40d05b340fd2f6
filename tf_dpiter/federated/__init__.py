"""Client-level DP federated averaging (seed 003) on the privacy core (seed 002).

A record is one client's flattened model update; a sample is the set of clients of a round.
"""

from tf_dpiter.federated.client import LocalSGD
from tf_dpiter.federated.client import draw_example_order
from tf_dpiter.federated.client import local_sgd_one_client
from tf_dpiter.federated.data import FederatedData
from tf_dpiter.federated.data import default_mnist_path
from tf_dpiter.federated.data import load_mnist
from tf_dpiter.federated.data import partition_iid
from tf_dpiter.federated.data import partition_noniid_shards
from tf_dpiter.federated.dpfedavg import DPFedAvg
from tf_dpiter.federated.dpfedavg import DPServer
from tf_dpiter.federated.dpfedavg import QUERY_KINDS
from tf_dpiter.federated.dpfedavg import RoundReport
from tf_dpiter.federated.dpfedavg import RunReport
from tf_dpiter.federated.dpfedavg import as_schedule
from tf_dpiter.federated.dpfedavg import linear_schedule
from tf_dpiter.federated.dpfedavg import make_query
from tf_dpiter.federated.dpfedavg import update_statistics
from tf_dpiter.federated.model import MLP
from tf_dpiter.federated.model import accuracy
from tf_dpiter.federated.queries import NOT_PRIVATE_WARNING
from tf_dpiter.federated.queries import MedianNormClipSumQuery
from tf_dpiter.federated.queries import median_of_masked
from tf_dpiter.federated.queries import set_noise_multiplier
