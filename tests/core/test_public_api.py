"""The public API: every name in a package's `__all__` resolves and is documented."""

import importlib
import inspect
import os
import subprocess
import sys

import pytest

import tf_dpiter

PACKAGES = ["tf_dpiter", "tf_dpiter.errors", "tf_dpiter.dp_query", "tf_dpiter.ledger",
            "tf_dpiter.federated", "tf_dpiter.federated.flower", "tf_dpiter.accounting",
            "tf_dpiter.accounting.lookahead",
            "tf_dpiter.auditing", "tf_dpiter.keras", "tf_dpiter.keras.compat", "tf_dpiter.data",
            "tf_dpiter.draw_discard", "tf_dpiter.tuning", "tf_dpiter.compat"]


def _documented(obj):
  """A class or function carries its own docstring; constants and modules need none here."""
  if inspect.isclass(obj):
    return bool(obj.__dict__.get("__doc__"))
  if inspect.isfunction(obj) or inspect.isbuiltin(obj):
    return bool(obj.__doc__)
  return True


@pytest.mark.parametrize("package", PACKAGES)
def test_all_names_resolve_and_have_docstrings(package):
  module = importlib.import_module(package)
  assert module.__doc__, f"{package} has no docstring"
  names = module.__all__
  assert len(names) == len(set(names)), f"{package}.__all__ repeats a name"
  missing = [n for n in names if not hasattr(module, n)]
  assert not missing, f"{package}.__all__ names missing attributes: {missing}"
  undocumented = [n for n in names if not _documented(getattr(module, n))]
  assert not undocumented, f"{package}: no docstring for {undocumented}"


@pytest.mark.parametrize("package", [p for p in PACKAGES if p.count(".") <= 1])
def test_every_public_attribute_of_a_package_is_listed_in_all(package):
  module = importlib.import_module(package)
  public = {n for n, v in vars(module).items()
            if not n.startswith("_") and not inspect.ismodule(v)}
  assert public <= set(module.__all__), f"{package}: not in __all__: {public - set(module.__all__)}"


SUBPACKAGES = {"dp_query", "ledger", "accounting", "keras", "data", "federated",
               "draw_discard", "auditing", "tuning"}


def test_root_lists_the_subpackages():
  assert SUBPACKAGES <= set(dir(tf_dpiter))
  assert SUBPACKAGES <= set(tf_dpiter.__all__)
  assert "importlib" not in dir(tf_dpiter)


def test_every_subpackage_of_the_source_tree_is_reachable_from_the_root():
  root = os.path.dirname(tf_dpiter.__file__)
  on_disk = {d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "__init__.py"))}
  assert on_disk == SUBPACKAGES
  for name in sorted(on_disk):
    assert inspect.ismodule(getattr(tf_dpiter, name)), name


def test_root_all_is_curated():
  """17 names: 10 namespaces (9 subpackages + compat), errors, its 5 exceptions, __version__."""
  assert sorted(tf_dpiter.__all__) == sorted(
      SUBPACKAGES | {"compat", "errors", "DPiterError", "ParameterTypeError",
                     "ParameterValueError", "PrivacyConfigError", "BudgetConfigError",
                     "__version__"})
  assert len(tf_dpiter.__all__) == 17
  import tf_dpiter.errors as errors_module  # pylint: disable=g-import-not-at-top
  for name in errors_module.__all__:  # the whole family, at the root
    assert getattr(tf_dpiter, name) is getattr(errors_module, name)


def test_keras_namespace_has_one_way_per_task_and_keeps_old_names():
  from tf_dpiter import keras as dpk  # pylint: disable=g-import-not-at-top
  for name in ["DPKerasSGDOptimizer", "DPKerasAdamOptimizer", "DPKerasAdamWOptimizer",
               "DPKerasAdagradOptimizer", "DPKerasRMSpropOptimizer", "DPOptimizer",
               "from_budget", "make_private", "make_private_with_epsilon", "DPSequential",
               "DPModel"]:
    assert name in dpk.__all__, name
  for name in dpk._KEPT:  # pylint: disable=protected-access
    assert name not in dpk.__all__ and getattr(dpk, name) is not None, name
  assert dpk.VectorizedDPKerasSGDOptimizer is tf_dpiter.compat.VectorizedDPKerasSGDOptimizer
  assert tf_dpiter.compat.DPSequential is dpk.DPSequential
  with pytest.raises(AttributeError, match="no attribute 'nothing'"):
    dpk.nothing  # pylint: disable=pointless-statement


def test_from_budget_calibrates_a_copy_of_any_keras_optimizer():
  import keras  # pylint: disable=g-import-not-at-top
  from tf_dpiter.accounting import dp_sgd  # pylint: disable=g-import-not-at-top
  opt = tf_dpiter.keras.from_budget(keras.optimizers.Adam(1e-3, epsilon=1e-6), 3.0, 1e-5, 2,
                                    256, 60000, l2_norm_clip=1.0)
  assert isinstance(opt, keras.optimizers.Adam) and opt.epsilon == 1e-6
  z = opt.calibration["noise_multiplier"]
  eps_at_z = tf_dpiter.accounting.compute_dp_sgd_privacy(60000, 256, z, 2, 1e-5).epsilon
  eps_below = tf_dpiter.accounting.compute_dp_sgd_privacy(60000, 256, 0.98 * z, 2, 1e-5).epsilon
  assert eps_at_z <= 3.0 < eps_below
  assert opt.calibration["steps"] == dp_sgd.dp_sgd_steps(60000, 256, 2)
  with pytest.raises(ValueError, match="Received: optimizer="):
    tf_dpiter.keras.from_budget(opt, 3.0, 1e-5, 2, 256, 60000, l2_norm_clip=1.0)


def test_dp_query_exposes_classes_and_functions_not_modules():
  from tf_dpiter import dp_query  # pylint: disable=g-import-not-at-top
  dp_query.GaussianSumQuery  # pylint: disable=pointless-statement  (loads every module)
  shown = dir(dp_query)
  assert set(shown) == set(dp_query.__all__)
  modules = [n for n in shown if inspect.ismodule(getattr(dp_query, n))]
  assert not modules


def test_import_tf_dpiter_does_not_import_tensorflow():
  code = "import sys, tf_dpiter; print('tensorflow' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == "False"


def test_error_families():
  from tf_dpiter import errors  # pylint: disable=g-import-not-at-top
  from tf_dpiter import validation  # pylint: disable=g-import-not-at-top
  assert issubclass(errors.ParameterTypeError, TypeError)
  assert issubclass(errors.PrivacyConfigError, ValueError)
  assert issubclass(errors.BudgetConfigError, errors.PrivacyConfigError)
  with pytest.raises(TypeError, match="`l2_norm_clip` must be .*Received: l2_norm_clip='one'"):
    validation.check_nonnegative("l2_norm_clip", "one")
  with pytest.raises(errors.PrivacyConfigError, match="noise_multiplier.*Received: .*=-1"):
    validation.check_nonnegative("noise_multiplier", -1)
  with pytest.raises(TypeError, match="SumAggregationDPQuery"):
    tf_dpiter.dp_query.NestedQuery([object()])
