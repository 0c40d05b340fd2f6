"""Deprecated alias of `tf_dpiter.validation` (the argument checks moved there).

Kept so that `from tf_dpiter.dp_query import validation` keeps working until every module
imports `tf_dpiter.validation` (tools/convert_raises.py rewrites the import).
"""

from tf_dpiter.validation import *  # pylint: disable=wildcard-import,unused-wildcard-import
from tf_dpiter.validation import __all__  # pylint: disable=unused-import
