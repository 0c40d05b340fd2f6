"""Opacus DP step time on the same models, for a side-by-side with
benchmarks/fast_clipping_step_time.py (issue 6). Benchmark only: needs torch and
opacus, which tf_dpiter does not depend on.

  python -m venv /tmp/opacus_venv && /tmp/opacus_venv/bin/pip install torch opacus numpy
  /tmp/opacus_venv/bin/python benchmarks/opacus_step_time.py --steps 20 --warmup 3

Models: the same MNIST CNN (Conv 16 8x8 s2 'same', MaxPool(2, 1), Conv 32 4x4 s2
'valid', MaxPool(2, 1), Dense 32, Dense 10) and 784-512-10 MLP, batch 256, SGD,
z = 1.1, C = 1.0. Modes: nonprivate (plain torch), and each Opacus
grad_sample_mode. ms/step is the median over --steps steps after --warmup,
timed round-robin across modes like the TF script.
"""

import argparse
import statistics
import time
import warnings

import numpy as np
import torch
from torch import nn

warnings.filterwarnings("ignore")


def build(name):
  torch.manual_seed(0)
  if name == "cnn":
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))
  return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(),
                       nn.Linear(512, 10))


def make_step(name, mode, x, y):
  """Returns a closure doing one training step of `mode`."""
  from opacus import PrivacyEngine  # pylint: disable=g-import-not-at-top
  model = build(name)
  opt = torch.optim.SGD(model.parameters(), lr=0.1)
  crit = nn.CrossEntropyLoss()
  if mode == "nonprivate":
    def step():
      opt.zero_grad(set_to_none=True)
      crit(model(x), y).backward()
      opt.step()
    return step
  loader = torch.utils.data.DataLoader(
      torch.utils.data.TensorDataset(x, y), batch_size=len(x))
  engine = PrivacyEngine()
  kw = dict(module=model, optimizer=opt, data_loader=loader,
            noise_multiplier=1.1, max_grad_norm=1.0, grad_sample_mode=mode,
            poisson_sampling=False)
  if mode == "ghost":
    model, opt, crit, _ = engine.make_private(criterion=crit, **kw)
  else:
    model, opt, _ = engine.make_private(**kw)

  def dp_step():
    opt.zero_grad(set_to_none=True)
    crit(model(x), y).backward()
    opt.step()
  return dp_step


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--models", default="cnn,mlp")
  p.add_argument("--modes", default="nonprivate,hooks,ghost,functorch,ew")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--threads", type=int, default=0)
  args = p.parse_args()
  if args.threads:
    torch.set_num_threads(args.threads)
  import opacus  # pylint: disable=g-import-not-at-top
  print(f"# torch={torch.__version__} opacus={opacus.__version__} "
        f"threads={torch.get_num_threads()}")
  rng = np.random.default_rng(0)
  for name in args.models.split(","):
    shape = (args.batch, 1, 28, 28) if name == "cnn" else (args.batch, 784)
    x = torch.tensor(rng.random(shape, np.float32))
    y = torch.tensor(rng.integers(0, 10, args.batch))
    steps = {}
    for mode in args.modes.split(","):
      try:
        steps[mode] = make_step(name, mode, x, y)
        for _ in range(args.warmup):
          steps[mode]()
      except Exception as e:  # pylint: disable=broad-except
        print(f"{name:5s} {mode:10s} FAILED: {type(e).__name__}: {e}"[:300])
        steps.pop(mode, None)
    times = {m: [] for m in steps}
    for _ in range(args.steps):
      for mode, step in steps.items():
        t = time.perf_counter()
        step()
        times[mode].append(1e3 * (time.perf_counter() - t))
    base = statistics.median(times["nonprivate"]) if "nonprivate" in times else 0
    for mode, ts in times.items():
      ms = statistics.median(ts)
      ratio = f"x{ms / base:.2f}" if base else ""
      print(f"{name:5s} batch={args.batch} {mode:10s} {ms:9.2f} ms/step  {ratio}",
            flush=True)


if __name__ == "__main__":
  main()
