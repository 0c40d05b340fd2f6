import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402

from tf_dpiter.dp_query import NotPrivateSeedWarning  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_seed_warnings():
  # Tests fix seeds on purpose (reproducible, hence not private).
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NotPrivateSeedWarning)
    yield
