"""Files and cross-file hops a noise multiplier passes through, from the optimizer's keyword
to dp-accounting's GaussianDpEvent.

Method: `sys.settrace` over one run of (construct `DPKerasSGDOptimizer(l2_norm_clip=S,
noise_multiplier=z)`; compile a DPSequential; fit one step on arrays (Poisson); epsilon of its
ledger by `dp.accounting.epsilon`). At every Python call in a tf_dpiter file, the frame's
arguments are scanned for the value: z, or sigma = z S (relative tolerance 1e-6), as a Python
or numpy float, in a float numpy array of at most 4096 elements, or held by an argument
(attribute, dict value, list item) up to `--depth` levels down. Counted, up to the first call of
dp_accounting's `GaussianDpEvent.__init__`:

* files: the distinct tf_dpiter files with a call that carries the value;
* hops: the changes of file between consecutive value-carrying calls.

`--depth 0` also counts a frame whose locals hold the value when it returns (a value computed
there). Values inside traced TensorFlow graphs are symbolic and not seen (the ledger's write);
the epsilon printed must be the same for two checkouts compared.

Usage (PYTHONPATH selects the checkout; it must hold the imported tf_dpiter):
  PYTHONPATH=ROOT python tools/value_hops.py ROOT [--depth 0|1|2]
"""

import argparse
import os
import sys

import numpy as np

Z, S = 1.37, 0.83
TARGETS = (Z, Z * S)


def _is_value(v):
  """True for a float equal to a target, or a small float array holding one."""
  if isinstance(v, (float, np.floating)):
    return any(abs(float(v) - t) <= 1e-6 * t for t in TARGETS)
  if isinstance(v, np.ndarray) and v.dtype.kind == "f" and 0 < v.size <= 4096:
    return any(bool(np.any(np.abs(v - t) <= 1e-6 * t)) for t in TARGETS)
  return False


def _holds(v, depth):
  """True if v is the value, or holds it within `depth` levels of attributes/items."""
  if _is_value(v):
    return True
  if depth == 0:
    return False
  try:
    if isinstance(v, dict):
      return any(_holds(x, depth - 1) for x in list(v.values())[:50])
    if isinstance(v, (list, tuple)):
      return any(_holds(x, depth - 1) for x in v[:50])
    d = getattr(v, "__dict__", None)
    if isinstance(d, dict):
      return any(_holds(x, depth - 1) for x in list(d.values())[:60])
    fields = getattr(v, "_fields", None) or getattr(v, "__dataclass_fields__", None)
    if fields:
      return any(_holds(getattr(v, f), depth - 1) for f in fields)
  except (TypeError, ValueError, AttributeError, RuntimeError):
    return False
  return False


def main(argv=None):
  """Runs the traced program and prints the files (first-seen order), the hop and file counts.

  Args:
    argv: command-line arguments (ROOT, --depth).
  """
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("root")
  parser.add_argument("--depth", type=int, default=1)
  args = parser.parse_args(argv)
  root = os.path.abspath(args.root)
  import keras  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  pkg = os.path.join(root, "tf_dpiter")
  if not dp.__file__.startswith(pkg):
    raise SystemExit(f"tf_dpiter was imported from {dp.__file__}, not {pkg}: set PYTHONPATH")
  files, seq, done = [], [], [False]

  def note(frame):
    rel = os.path.relpath(frame.f_code.co_filename, root)
    if rel not in files:
      files.append(rel)
      print(len(files), rel, frame.f_code.co_name)
    if not seq or seq[-1] != rel:
      seq.append(rel)

  def local(frame, event, arg):
    if event == "return" and not done[0] and (
        _holds(arg, 0) or any(_holds(v, 0) for v in list(frame.f_locals.values()))):
      note(frame)
    return local

  def tracer(frame, event, arg):
    del arg
    if done[0] or event != "call":
      return None
    fn = frame.f_code.co_filename
    if (frame.f_code.co_name == "__init__" and "dp_accounting" in fn
        and type(frame.f_locals.get("self")).__name__ == "GaussianDpEvent"):
      done[0] = True
      return None
    if fn.startswith(pkg):
      if any(_holds(v, args.depth) for v in list(frame.f_locals.values())):
        note(frame)
      elif args.depth == 0:
        frame.f_trace_lines = False
        return local
    return None

  rng = np.random.default_rng(0)
  x = rng.random((64, 4)).astype("float32")
  y = (x.sum(1) > 2).astype("int32")
  sys.settrace(tracer)
  try:
    opt = dp.keras.DPKerasSGDOptimizer(l2_norm_clip=S, noise_multiplier=Z, learning_rate=0.1)
    model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=1, verbose=0)
    eps = dp.accounting.epsilon(model.ledger, delta=1e-5)
  finally:
    sys.settrace(None)
  print(f"epsilon {eps!r}; GaussianDpEvent reached: {done[0]}")
  print(f"depth {args.depth}: files {len(files)}, cross-file hops {len(seq) - 1}")


if __name__ == "__main__":
  main()
