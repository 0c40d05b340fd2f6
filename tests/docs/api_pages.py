"""Writes docs/api/<namespace>.md from each namespace's `__all__` (run after changing `__all__`).

    python -m tests.docs.api_pages

Classes and functions are rendered by mkdocstrings from their defining module; constants and
submodules are listed in a table. tests/docs/test_docs_names.py checks that every `__all__`
name of every namespace appears on its page.
"""

import importlib
import inspect
import os

from . import docs_support as S

# Docstrings that are not in Google style (their modules belong to other work in progress):
# rendered as plain Markdown, so that `mkdocs build --strict` does not stop on them.
PLAIN_DOCSTRINGS = {"tf_dpiter.federated.server.DPServer"}

NAMESPACES = ["keras", "dp_query", "ledger", "accounting", "data", "federated", "draw_discard",
              "auditing", "tuning", "compat", "errors"]

_TITLES = {
    "keras": "DP optimizers, DP models and privacy callbacks for Keras 3.",
    "dp_query": "Privacy mechanisms: DPQuery objects that clip records and add noise.",
    "ledger": "The privacy ledger: sampling and sum-query events, the relation and the unit.",
    "accounting": "Accountants on the ledger, calibration, and the command-line tools.",
    "data": "Samplers that record their sampling policy in the ledger.",
    "federated": "Client-level DP federated averaging, in simulation and on Flower.",
    "draw_discard": "Draw and Discard: local-DP GLMs with a k-instance server.",
    "auditing": "Empirical privacy auditing: attacks and sound lower bounds on epsilon.",
    "tuning": "Private hyperparameter selection.",
    "compat": "TF Privacy's and Opacus' spellings (see the migration guides).",
    "errors": "The exception family.",
}


def page(namespace):
  module = importlib.import_module(f"tf_dpiter.{namespace}")
  lines = [f"# tf_dpiter.{namespace}", "", _TITLES[namespace], "",
           f"::: tf_dpiter.{namespace}", "    options:", "      members: false",
           "      show_root_heading: false", ""]
  others = []
  for name in module.__all__:
    obj = getattr(module, name)
    if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__name__ != name:
      others.append(f"| `{name}` | alias of `{obj.__name__}` |")
    elif inspect.isclass(obj) or inspect.isfunction(obj):
      path = f"{obj.__module__}.{obj.__qualname__}"
      lines += [f"::: {path}", "    options:", "      heading_level: 2",
                "      show_root_full_path: false", ""]
      if path in PLAIN_DOCSTRINGS:
        lines[-1:-1] = ["      docstring_style: null"]
      if namespace == "keras" and name.startswith("DPKeras"):
        lines[-5:-1] = [f"::: {obj.__module__}.{obj.__qualname__}", "    options:",
                        "      heading_level: 2", "      show_root_full_path: false",
                        "      members: false"]
    else:
      kind = "module" if inspect.ismodule(obj) else type(obj).__name__
      others.append(f"| `{name}` | {kind} |")
  if others:
    lines += ["## Other names", "", "| name | kind |", "|---|---|"] + others + [""]
  return "\n".join(lines)


def main():
  for namespace in NAMESPACES:
    with open(os.path.join(S.DOCS, "api", f"{namespace}.md"), "w", encoding="utf-8") as f:
      f.write(page(namespace))


if __name__ == "__main__":
  main()
