"""Test-only: the default tier's Grappler setting in the tests' Python subprocesses.

tests/conftest.py puts this folder on PYTHONPATH, and TF_DPITER_TEST_GRAPPLER=off in the
environment, in each process that runs tests of the default tier (its module docstring:
"Compile settings"); the subprocesses those tests start (MirroredStrategy jobs, tutorials,
workers) inherit both, as they inherit XLA_FLAGS. Python imports `sitecustomize` at every
interpreter's start (the `site` module). Grappler's switch is a per-process TensorFlow option,
not an environment variable, so this file switches Grappler's meta optimizer off right after
the process imports `tensorflow`, not at start: a subprocess that never imports TensorFlow
loads nothing more, and one that configures its devices before TensorFlow initializes (the
2 logical CPUs of a MirroredStrategy job) still can (setting the option does not initialize
the runtime). TF_DPITER_TEST_GRAPPLER=on (tests/conftest.py's `KEEP_GRAPPLER` modules) or
unset leaves TensorFlow's default.
"""

import os
import sys


def _switch_off_after_tensorflow_import():
  import importlib.abc  # pylint: disable=g-import-not-at-top
  import importlib.util  # pylint: disable=g-import-not-at-top

  class _AfterTensorFlow(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the `tensorflow` package's loader once."""

    def find_spec(self, name, path=None, target=None):  # pylint: disable=unused-argument
      if name != "tensorflow":
        return None
      sys.meta_path.remove(self)
      spec = importlib.util.find_spec(name)
      if spec is None or spec.loader is None:
        return spec
      exec_module = spec.loader.exec_module

      def exec_then_switch_off(module):
        exec_module(module)
        module.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})

      spec.loader.exec_module = exec_then_switch_off
      return spec

  sys.meta_path.insert(0, _AfterTensorFlow())


if os.environ.get("TF_DPITER_TEST_GRAPPLER") == "off" and "tensorflow" not in sys.modules:
  _switch_off_after_tensorflow_import()
