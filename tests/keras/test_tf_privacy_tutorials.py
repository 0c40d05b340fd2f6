"""TF Privacy's Keras MNIST tutorials and its MovieLens tutorial, rewritten by the migration
guide's rows (tutorials/mnist_keras_sequential.py, mnist_keras_model.py, mnist_vectorized.py,
movielens_dp.py), each run in this process on its --quick setting: every epsilon a tutorial
prints (TF Privacy's "For delta=..., the current epsilon is: ..." lines and the JSON summary) is
its run's ledger's, and that is dp-accounting's Poisson epsilon composed by hand for the steps
the ledger holds (q = B / n, z): with num_microbatches = batch_size the run really was Poisson
sampled, per example (add or remove one example, one example per record).

MNIST from $TF_DPITER_MNIST or /work/shared/data/mnist.npz; a synthetic keras-layout npz when
neither exists (the accounting checks do not depend on the images).
"""

import importlib.util
import json
import os
import re

import dp_accounting as dpa
import numpy as np
import pytest

import tf_dpiter as dp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRINTED = re.compile(r"^For delta=(\S+), the current epsilon is: ([0-9.]+)")


@pytest.fixture(scope="module")
def mnist_path(mnist_or_synthetic_path):
  return mnist_or_synthetic_path


def _run(name, capsys, *argv):
  """Runs tutorials/<name>.py's main(argv) here: (summary, model, printed epsilons, stdout)."""
  spec = importlib.util.spec_from_file_location(f"tutorial_{name}",
                                                os.path.join(ROOT, "tutorials", name + ".py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  capsys.readouterr()
  out, model = module.main(["--quick", "--verbose", "0", *argv])
  stdout = capsys.readouterr().out
  assert json.loads(stdout.strip().splitlines()[-1]) == out
  printed = [float(m.group(2)) for m in map(PRINTED.match, stdout.splitlines()) if m]
  return out, model, printed, stdout


def _poisson_epsilon(q, z, steps, delta):
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)),
                                      steps))
  return acc.get_epsilon(delta)


def _check_ledger_epsilon(out, model, printed, q, z, steps_per_epoch, epochs, delta):
  """The printed epsilons are the ledger's, after each epoch, and the ledger is Poisson."""
  eps = dp.accounting.epsilon(model.ledger, delta)
  assert out["epsilon"] == model.privacy_statement(delta).epsilon == eps
  assert (out["sampling"], out["relation"], out["unit"]) == (
      "poisson", "add or remove one", "example")
  assert out["steps"] == steps_per_epoch * epochs and out["q"] == pytest.approx(q)
  for run in model.ledger.to_dict()["runs"]:
    assert (run["policy"], run["examples_per_record"]) == ("poisson", 1)
    assert run["queries"][0]["sensitivity"] == run["queries"][0]["l2_norm_clip"]
  # the ledger's epsilon is dp-accounting's for the steps taken (q, z in float32: 1e-6)
  assert eps == pytest.approx(_poisson_epsilon(q, z, out["steps"], delta), rel=1e-6)
  assert len(printed) == epochs
  for epoch, value in enumerate(printed, 1):   # TF Privacy's line, rounded to 2 digits
    assert value == round(_poisson_epsilon(q, z, epoch * steps_per_epoch, delta), 2)
  assert printed[-1] == round(eps, 2)


# Default: one tutorial (the sequential MNIST one: the ledger's printed epsilon); the other
# tutorials' end-to-end runs (~45 s) with -m slow.
@pytest.mark.parametrize("name", ["mnist_keras_sequential",
                                  pytest.param("mnist_keras_model", marks=pytest.mark.slow)])
def test_keras_mnist_tutorials_print_their_ledger_epsilon(name, mnist_path, capsys):
  """num_microbatches = batch_size = 50 on 500 examples: 10 Poisson steps at q = 0.1."""
  out, model, printed, _ = _run(name, capsys, "--data_path", mnist_path)
  assert (out["batch_size"], out["microbatches"], out["train_size"]) == (50, 50, 500)
  _check_ledger_epsilon(out, model, printed, 0.1, 1.1, 10, 1, 1e-5)
  assert 0 <= out["test_accuracy"] <= 1


@pytest.mark.slow
def test_vectorized_tutorial_prints_its_ledger_epsilon_every_epoch(mnist_path, capsys):
  """The Estimator program as fit one epoch at a time: 2 x 6 Poisson steps at q = 1/6."""
  out, model, printed, _ = _run("mnist_vectorized", capsys, "--data_path", mnist_path)
  assert out["clipping"] == "vectorized" and out["microbatches"] == out["batch_size"] == 50
  _check_ledger_epsilon(out, model, printed, 50 / 300, 1.1, 6, 2, 1e-5)


@pytest.mark.slow
def test_movielens_tutorial_prints_its_ledger_epsilon(capsys):
  """NCF on 2000 synthetic ratings, DP-Adam with num_microbatches = batch_size = 100: 20
  Poisson steps at q = 0.05, z = 0.55, delta 1e-6; the GDP number beside is the ledger's
  too, and labelled an approximation."""
  out, model, printed, stdout = _run("movielens_dp", capsys)
  _check_ledger_epsilon(out, model, printed, 0.05, 0.55, 20, 1, 1e-6)
  gdp = dp.accounting.privacy_report(model.ledger, delta=1e-6, accountant="gdp")
  assert out["epsilon_gdp"] == gdp.epsilon < out["epsilon"]
  assert "an approximation" in stdout and "not an upper bound" in stdout
  assert np.isfinite(out["test_rmse"]) and 0 <= out["test_accuracy"] <= 1
