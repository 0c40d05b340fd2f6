"""A `setup.py` for the tools and habits that look for one; pyproject.toml is the metadata.

Every piece of metadata (name, dependencies, extras, console scripts, the version read from
`tf_dpiter.__version__`) lives in pyproject.toml alone; this file only hands over to
setuptools, which reads it. So `pip install .`, `pip install -e .` and
`python setup.py --version` all see the same project.
"""

import sys

import setuptools

# pyproject.toml's `license = "Apache-2.0"` is an SPDX expression (PEP 639): setuptools >= 77.
if int(setuptools.__version__.split(".")[0]) < 77:
  sys.exit(f"tf_dpiter's pyproject.toml needs setuptools >= 77; found "
           f"{setuptools.__version__}. Run: pip install -U 'setuptools>=77'")

setuptools.setup()
