"""tools/suite_tiers.py: a `SLOW_CASES` id that names no case of its module is reported."""

import importlib.util
import os
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SPEC = importlib.util.spec_from_file_location("suite_tiers",
                                               os.path.join(ROOT, "tools", "suite_tiers.py"))
suite_tiers = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(suite_tiers)


def _item(module, name):
  return types.SimpleNamespace(module=module, name=name)


def test_a_stale_slow_case_id_is_reported_and_a_matching_one_is_not():
  module = types.ModuleType("test_fake")
  module.__file__ = os.path.join(ROOT, "tests", "test_fake.py")
  module.SLOW_CASES = {"test_a[1]", "test_renamed[2]"}
  items = [_item(module, "test_a[1]"), _item(module, "test_a[2]"), _item(None, "test_doc")]
  assert suite_tiers.stale_slow_cases(items) == [("tests/test_fake.py", "test_renamed[2]")]


def test_the_nightly_only_modules_exist():
  for path in suite_tiers.NIGHTLY_ONLY:
    assert os.path.exists(os.path.join(ROOT, path)), path
