"""The ledger write's rare branches (a buffer grown when full, the two sets repaired after a
restore lowered one) are calls of functions marked `_noinline` (`privacy_ledger._grow_call`,
`_fix_call`): the write function, inlined into every train function, holds a call op for
each instead of their bodies; they still run when their branch is taken."""

import numpy as np
import tensorflow as tf

from tf_dpiter.dp_query import events
from tf_dpiter.ledger import privacy_ledger


def _record(ledger):
  return ledger.record_sample(1000.0, 0.01, (events.GaussianSumEvent(1.0, 1.1),))


def test_write_holds_calls_not_bodies():
  """The traced write: its conditional branches are small (a call, or a constant) and the
  called functions carry `_noinline`."""
  ledger = privacy_ledger.PrivacyLedger(initial_capacity=4)
  graph = tf.function(lambda: _record(ledger)).get_concrete_function().graph
  library = {f.signature.name: f for f in graph.as_graph_def().library.function}
  (write,) = [f for name, f in library.items() if "_append_call" in name]
  conds = [n for n in write.node_def if n.op in ("If", "StatelessIf")]
  assert len(conds) == 5   # reconcile, and each set's two buffers' growth
  branches = [library[n.attr[b].func.name] for n in conds for b in ("then_branch", "else_branch")]
  assert max(len(f.node_def) for f in branches) <= 4
  rare = {f.signature.name for f in library.values()
          if f.attr["_noinline"].b and ("_grow_call" in f.signature.name
                                         or "_fix_call" in f.signature.name)}
  assert any("_grow_call" in n for n in rare) and any("_fix_call" in n for n in rare)


def test_grow_and_repair_still_run(tmp_path):
  """Capacity 1, three writes in a graph (two growths), then a checkpoint of step 1
  restored: the next write repairs the lowered set first (4 samples, none lost)."""
  ledger = privacy_ledger.PrivacyLedger(initial_capacity=1)
  write = tf.function(lambda: _record(ledger))
  write()
  ckpt = tf.train.Checkpoint(ledger=ledger)
  path = ckpt.write(str(tmp_path / "c"))
  write()
  write()
  ckpt.read(path).assert_consumed()
  assert int(ledger._v.sample_count.numpy()) == 1   # pylint: disable=protected-access
  assert int(write().numpy()) == 4
  samples, queries = ledger.get_arrays()
  assert samples.shape == (4, 6) and queries.shape == (4, 5)
  np.testing.assert_array_equal(queries[:, 0], np.arange(4))
