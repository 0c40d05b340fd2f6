"""A reference computation shared by the federated tests."""

import numpy as np
import tensorflow as tf

from tf_dpiter import federated as F


def plain_fedavg(model, fd, w0, rounds, clients, denominator, lr=0.2, examples=20):
  """Reference federated averaging: full-batch local steps of `clients`, sum / denominator.

  Batch = the client's `examples`, so local SGD does not depend on the example order and is
  exactly comparable with any implementation's. Returns w_T as a list of tensors.
  """
  w = [tf.constant(p) for p in w0]
  for _ in range(rounds):
    deltas = [F.local_sgd_one_client(model, w, *fd.client_examples(k),
                                     np.arange(examples)[None], examples, lr)
              for k in clients]
    w = [p + sum(d[i] for d in deltas) / denominator for i, p in enumerate(w)]
  return w
