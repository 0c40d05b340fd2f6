"""The TF variables of a private step, tracked by the optimizer that holds it.

The privacy ledger (McMahan et al., "A General Approach to Adding Differential Privacy to
Iterative Training Procedures", Section 6: every sampling and query event of the run), the
query's global state (a correlated mechanism's noise history, an adaptive clip), the
public expected batch size and the float16 overflow counter are variables made here and
made checkpoint dependencies of the optimizer under fixed names ("_dp_ledger",
"_dp_expected_records", "_dp_overflow_count", "_dp_global_state_<i>"), so
`tf.train.Checkpoint` and `BackupAndRestore` carry them. The query's noise generator is
deliberately NOT among them: restoring it would draw again a noise already released (and
knowing it lets whoever sees the updates subtract the noise).
"""

import numpy as np
import tensorflow as tf

from tf_dpiter import ledger as ledger_lib
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.ledger import privacy_ledger


class StepState:
  """Variables of one PrivateStep (see module docstring).

  Attributes:
    ledger: the PrivacyLedger (None until `make`).
    expected_records: float32 variable, the public expected batch size (None until `make`).
    overflow_count: int64 variable, records zeroed by a float16 overflow (None until `make`).
    restored_ledger, restored_global_state: what from_config read, applied on first use.
  """

  def __init__(self, optimizer):
    """Args:
      optimizer: the Keras optimizer whose checkpoint carries the variables."""
    self._optimizer = optimizer
    self.ledger = None
    self.expected_records = None
    self.overflow_count = None
    self.restored_ledger = None
    self.restored_global_state = None
    self._global_vars = None
    self._global_struct = None

  def _track(self, name, trackable):
    """Makes `trackable` a checkpoint dependency of the optimizer under `name`."""
    self._optimizer._track_trackable(trackable, name=name, overwrite=True)  # pylint: disable=protected-access
    return trackable

  def make(self):
    """Creates the ledger, the expected size and the overflow counter (once; call under
    tf.init_scope), and loads a ledger restored by from_config into the new ledger."""
    if self.ledger is not None:
      return
    self.expected_records = self._track("_dp_expected_records", tf.Variable(
        1.0, dtype=tf.float32, trainable=False, name="dp_expected_records"))
    self.overflow_count = self._track("_dp_overflow_count", tf.Variable(
        0, dtype=tf.int64, trainable=False, name="dp_overflowed_records"))
    self.ledger = self._track("_dp_ledger", ledger_lib.PrivacyLedger())
    if self.restored_ledger is not None:   # from from_config or adopt_ledger
      pending, self.restored_ledger = self.restored_ledger, None
      self.ledger.merge_arrays(*pending)

  def adopt_ledger(self, samples, queries, passes):
    """Merges a ledger of this run (a model file's, a checkpoint's, one supplied by hand) into
    the ledger (`PrivacyLedger.merge_arrays`: nothing recorded is ever lost), or, before the
    ledger exists, into the one `make` will start from.

    Args:
      samples: ledger sample array.
      queries: ledger query array.
      passes: int, the shuffled passes that ledger counted.
    """
    if self.ledger is not None:
      self.ledger.merge_arrays(samples, queries, passes)
    elif self.restored_ledger is None:
      self.restored_ledger = (samples, queries, int(passes))
    else:
      self.restored_ledger = privacy_ledger.merged_arrays(self.restored_ledger,
                                                      (samples, queries, int(passes)))

  @property
  def has_global_state(self):
    """True once the query's global state variables exist."""
    return self._global_vars is not None

  def make_global_state(self, initial):
    """The query's global state variables, from `initial` or the state from_config saved.

    Args:
      initial: the query's initial global state (a nest of tensors).

    Raises:
      ParameterValueError: the saved state does not match the query's (count or shapes).
    """
    init = tf.nest.map_structure(tf.convert_to_tensor, initial)
    flat, saved = tf.nest.flatten(init), self.restored_global_state
    if saved is not None:   # the config's "dp_global_state" (nested lists), e.g. an adaptive clip
      if not isinstance(saved, (list, tuple)) or len(saved) != len(flat) or any(
          tuple(np.shape(s)) != tuple(t.shape) for s, t in zip(saved, flat)):
        raise ParameterValueError(
            "the saved dp_global_state does not match the query's state (expected "
            f"{len(flat)} values of shapes {[tuple(t.shape) for t in flat]}). "
            f"Received: dp_global_state={saved!r}")
      flat = [tf.constant(np.asarray(s), dtype=t.dtype) for s, t in zip(saved, flat)]
    self.restored_global_state = None
    self.set_global_state(init, [tf.Variable(t, trainable=False, name="dp_global_state")
                                 for t in flat])

  def set_global_state(self, struct, variables):
    """Adopts `variables` (flattened like `struct`) as the query's global state."""
    self._global_struct = struct
    self._global_vars = list(variables)
    for i, v in enumerate(self._global_vars):
      self._track(f"_dp_global_state_{i}", v)

  def global_state(self):
    """The query's global state, read from its variables (inside a step)."""
    return tf.nest.pack_sequence_as(self._global_struct,
                                    [v.read_value() for v in self._global_vars])

  def assign_global_state(self, new_state):
    """Assign ops writing `new_state` (a nest like the global state) to the variables."""
    return [v.assign(t) for v, t in zip(self._global_vars, tf.nest.flatten(new_state))]

  def global_state_numpy(self):
    """The global state as numpy values (None before it exists)."""
    if self._global_vars is None:
      return None
    return tf.nest.pack_sequence_as(self._global_struct, [v.numpy() for v in self._global_vars])

  def global_state_values(self):
    """The global state as plain nested lists (for the config), else the restored one."""
    if self._global_vars is not None:
      return [v.numpy().tolist() for v in self._global_vars]
    return self.restored_global_state
