"""benchmarks/step_call_walk.py's counting: calls, files, returns to a file left, stays."""

from benchmarks import step_call_walk


def test_counts_of_a_known_walk():
  calls = [("a.py", "f"), ("b.py", "g"), ("b.py", "h"), ("a.py", "f2"), ("c.py", "k"),
           ("b.py", "g2"), ("a.py", "f3")]
  files = {f for f, _ in calls}
  summary = step_call_walk.summarize(calls)
  assert summary["calls"] == len(calls) and summary["files"] == len(files)
  # a -> b -> a (1), a -> c -> b (b was left: 2), b -> a (a was left: 3)
  assert summary["returns"] == 3
  stays = step_call_walk.stays(calls)
  assert [f for f, _ in stays] == ["a.py", "b.py", "a.py", "c.py", "b.py", "a.py"]
  assert [n for _, names in stays for n in names] == [n for _, n in calls]


def test_a_walk_in_one_file_never_returns():
  calls = [("a.py", str(i)) for i in range(5)]
  assert step_call_walk.summarize(calls) == {"calls": 5, "files": 1, "returns": 0}
  assert step_call_walk.stays(calls) == [("a.py", [str(i) for i in range(5)])]


def test_the_train_function_entry_is_fits_step_without_train_on_batchs_guards():
  calls = step_call_walk.walk("vectorized", "train_function")
  # entered where fit enters (Keras' train function), not in train_on_batch's guards
  # (models.py, saved_ledger.py), and through the whole step: ledger write and update
  assert calls[0] == ("keras/model/train_step.py", "guarded")
  files = {f for f, _ in calls}
  assert not files & {"keras/model/models.py", "keras/optimizer/saved_ledger.py"}
  assert ("ledger/privacy_ledger.py", "append_sample") in calls
  assert ("keras/optimizer/optimizers.py", "apply_private_gradients") in calls
  # the step owns its variables (no state module of its own), and what it knows of its
  # query's class is read once per query, not at every step
  assert not any(f.endswith("step_state.py") for f in files)
  assert ("dp_query/gaussian_query.py", "adds_scaled_noise") not in calls


def test_the_fast_step_reads_per_layer_facts_once():
  calls = step_call_walk.walk("fast", "train_function")
  # the Dense rule reads which of W and b are trained itself, once per call; the records
  # context is entered once for all the layers' norms
  assert ("keras/fast_clipping/algebra.py", "trainable") not in calls
  assert calls.count(("keras/fast_clipping/registry.py", "__enter__")) == 1
  assert ("keras/fast_clipping/rules/dense.py", "dense_norm_fn") in calls
