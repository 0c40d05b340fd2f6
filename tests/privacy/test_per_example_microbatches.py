"""TF Privacy's `num_microbatches = batch_size` (one example per microbatch) is per-example
clipping: `fit` samples by Poisson and accounts exactly as with `num_microbatches=None`.

Neighbouring relation and unit checked: add or remove one example (policy "poisson",
sensitivity S, one example per record), in the ledger, the statement and the log line. The
join checks use the one-hot probe model of tests/privacy/matrix_runs.py (noise 0, example i
moves w[i] only, by exactly lr * S / B when it is clipped alone), so the joins and the
records' sizes are measured on real steps, not read from the sampler.
"""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.errors import PrivacyConfigError
from tests.keras import dp_keras_helpers as helpers
from tests.privacy import matrix_runs
from tests.privacy import privacy_joins

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

# Nightly (`-m slow`): the jit_compile=True case. Which records a step forms
# (num_microbatches = B as one example per record) is decided by the same Python at trace time
# in both modes: [False] asserts it by default on the same probe model, Poisson batches larger
# than B included (max(sizes) > b). The XLA side is asserted by default elsewhere:
# tests/keras/test_step_oracle.py covers num_microbatches=B with jit=True
# ([model=conv-clipping=vectorized-jit=True-micro=8-...]) and with padded Poisson rows
# ([model=conv-clipping=fast-jit=False-micro=8-physical=None-padding=True-policy=poisson-...]),
# each step equal to the per-record reference; tests/privacy/test_policy_matrix.py::
# test_participations_never_exceed_the_ledgers_claim[poisson-xla_compiled_draw] the Poisson
# joins under XLA with the noise drawn inside the program.
SLOW_CASES = {"test_steps_join_examples_as_poisson_one_record_each[True]"}


def _fit_small(microbatches, batch_size=16, **fit_kwargs):
  """A short Poisson-or-not fit of the small model: (model, ledger dict)."""
  model = helpers.small_seq()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, microbatches,
                                                       learning_rate=0.1), loss=LOSS)
  x, y = helpers.small_data(64)
  fit_kwargs.setdefault("verbose", 0)
  model.fit(x, y, batch_size=batch_size, epochs=1, **fit_kwargs)
  return model, model.ledger.to_dict()


def test_microbatches_equal_to_batch_size_account_as_none(capsys):
  m_model, m_led = _fit_small(16, verbose=2)
  (line,) = [l for l in capsys.readouterr().out.splitlines()
             if l.startswith("tf_dpiter DP-SGD")]
  for part in ("Poisson sampling", "add/remove-one adjacency, sensitivity S",
               "num_microbatches=16 = batch_size: one example per microbatch"):
    assert part in line, (part, line)
  n_model, n_led = _fit_small(None)
  assert m_led["runs"] == n_led["runs"]   # policy, relation, q, n, k, queries, counts
  (run,) = m_led["runs"]
  assert (run["policy"], run["relation"], run["examples_per_record"]) == (
      "poisson", "add_or_remove_one", 1)
  assert run["queries"][0]["sensitivity"] == 1.0
  assert run["count"] == round(64 / 16)
  eps_m = dp.accounting.epsilon(m_model.ledger, 1e-5)
  assert eps_m == dp.accounting.epsilon(n_model.ledger, 1e-5)
  st = m_model.privacy_statement(1e-5)
  assert (st.epsilon, st.unit, st.relation, st.policy) == (
      eps_m, "example", "add or remove one", "poisson")
  assert st.epsilon_if_poisson is None
  assert not any("NOT this run's epsilon" in note for note in st.notes)


def test_explicit_poisson_accepted_and_several_examples_per_microbatch_keep_shuffle():
  _, led = _fit_small(16, sampling="poisson")
  assert led["runs"][0]["policy"] == "poisson"
  _, led = _fit_small(8)                                  # microbatches of 2 examples
  (run,) = led["runs"]
  assert (run["policy"], run["relation"], run["examples_per_record"]) == (
      "shuffle", "replace_one", 2)
  with pytest.raises(PrivacyConfigError, match="num_microbatches. must be None or equal to "
                     "batch_size=16 with sampling='poisson' .num_microbatches=8"):
    _fit_small(8, sampling="poisson")


def test_custom_loop_declared_poisson_with_microbatches_equal_to_sample_size():
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, 16, learning_rate=0.1)
  opt.set_sampling(64, 0.25, "poisson", 16)
  assert opt.private_step.record_microbatches is None
  assert opt.ledger.to_dict()["num_samples"] == 0   # declared, nothing charged yet
  with pytest.raises(PrivacyConfigError, match="num_microbatches=8 cannot be used"):
    dp.keras.DPKerasSGDOptimizer(1.0, 1.1, 8, learning_rate=0.1).set_sampling(
        64, 0.25, "poisson", 16)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_steps_join_examples_as_poisson_one_record_each(jit_compile):
  """Each step's examples are a Poisson sample (sizes vary; a pass is no partition) and
  each example is its own record even in a batch larger than num_microbatches: a joined
  example's row moves by exactly lr * S / B (a microbatch of two would move it by half)."""
  n, b = matrix_runs.N, matrix_runs.BATCH
  net = matrix_runs.model(jit_compile=jit_compile)
  keras.utils.set_random_seed(0)
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 0.0, b, learning_rate=1.0)
  if jit_compile:
    opt.private_step.set_flags(compiled_noise=True)   # the noise drawn inside the XLA program
  net.compile(optimizer=opt, loss=matrix_runs.first_output, jit_compile=jit_compile)
  x, y = np.eye(n, dtype=np.float32), np.zeros((n, 1), np.float32)
  joined, moves = [], []

  class Moves(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
      self.before = self.model.trainable_variables[0].numpy()[:, 0].copy()

    def on_train_batch_end(self, batch, logs=None):
      moved = self.before - self.model.trainable_variables[0].numpy()[:, 0]
      moves.extend(moved[np.abs(moved) > 1e-6].tolist())

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # noise 0: not private, on purpose
    net.fit(x, y, batch_size=b, epochs=8, verbose=0,
            callbacks=[privacy_joins.JoinRecorder(joined), Moves()])
  (run,) = net.ledger.to_dict()["runs"]
  assert (run["policy"], run["examples_per_record"], run["count"]) == ("poisson", 1, 8 * 5)
  sizes = [len(s) for s in joined]
  assert len(sizes) == 40 and len(set(sizes)) > 2 and max(sizes) > b, sizes
  # shuffled passes would make every 5 consecutive steps a partition of the 24 examples
  assert any(set().union(*joined[e * 5:(e + 1) * 5]) != set(range(n)) or
             sum(sizes[e * 5:(e + 1) * 5]) != n for e in range(8))
  # each move is one clipped record / b, times the pinned sum's clip shrink 1 / (1 + eta)
  # (dp_query/summation; eta < 1e-3 here)
  assert np.all(np.asarray(moves) <= 1.0 / b * (1 + 1e-6))
  np.testing.assert_allclose(moves, 1.0 / b, rtol=1e-3)
