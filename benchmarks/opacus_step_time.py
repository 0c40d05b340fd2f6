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

--models bert: the BERT-base encoder of benchmarks/transformer_step_time.py (issue 42), full
fine-tuning, against Opacus' ghost clipping (grad_sample_mode="ghost": Li, Tramer, Liang,
Hashimoto, "Large Language Models Can Be Strong Differentially Private Learners", section 4,
the norms from activations and output gradients without per-example gradients, then a second
backward pass of the loss reweighted by the clipping factors) and its per-example gradient
hooks ("hooks"):

  /tmp/opacus_venv/bin/python benchmarks/opacus_step_time.py --models bert --seqs 32,128
  /tmp/opacus_venv/bin/python benchmarks/opacus_step_time.py --models bert --seqs 32 \
      --ours-python .venv/bin/python    # ours --pair, Opacus' modes, ours --pair: one window

The encoder is keras_hub's BertBackbone(vocabulary 30522, 12 layers, hidden 768, 12 heads,
intermediate 3072, max sequence 512, 2 segments, dropout 0.1) rebuilt from nn.Embedding,
nn.Linear and nn.LayerNorm (the layers Opacus' ghost clipping has norm samplers or per-example
gradient samplers for): token + position + segment embeddings, LayerNorm (eps 1e-12),
dropout; 12 post-norm blocks of self-attention written from Q/K/V/O nn.Linear (softmax of
QK^T / sqrt(64), dropout 0.1 on the probabilities), dropout, residual, LayerNorm, then
768-3072-768 with tanh-approximated GELU, dropout, residual, LayerNorm; the [CLS] vector ->
Linear 768 tanh (keras_hub's pooled_dense) -> Linear 2. 109,483,778 parameters, as
keras_hub's backbone + Dense(2) (the padding mask is all ones in both: not applied here).
Batch 4 of random token ids, segment ids 0; mean cross entropy, SGD lr 0.01, C = 1.0,
z = 1.1 (ours), fixed-size batches (poisson_sampling=False), torch threads 2 unless --threads.
nn.Embedding's gradient is dense here (sparse=False: Opacus takes no sparse gradients), so the
non-private torch step updates all 23.4M token-embedding weights where Keras' SGD updates only
the batch's rows; both DP steps noise every weight.
Each (mode, seq) runs in its own process (like ours), so its peak RSS (ru_maxrss) is its own;
non-private first. One JSON line per (mode, seq): ms_per_step (median of --steps steps after
--warmup, default 5 and 1), cpu_ms_per_step (the process's CPU ms, all threads: steadier than
wall time on a loaded machine), first_step_s and first_step_cpu_s, peak_rss_mib,
rss_after_build_mib, and the ratios of ms, CPU ms, first step and peak RSS to the non-private
run of the same seq. With --ours-python, one more line per seq: our --pair run before and
after Opacus' modes and the figures side by side.
"""

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
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


BERT_BASE = dict(vocabulary_size=30522, num_layers=12, num_heads=12, hidden_dim=768,
                 intermediate_dim=3072, max_sequence_length=512, num_segments=2, dropout=0.1)
ARCH = "torch BERT-base encoder (keras_hub BertBackbone's shape, random weights)"


class _SelfAttention(nn.Module):
  """softmax(Q K^T / sqrt(d)) V from four nn.Linear (Vaswani et al., "Attention Is All You
  Need", section 3.2.2), d = hidden / heads: no nn.MultiheadAttention, which ghost clipping
  cannot take (Opacus would need its DPMultiheadAttention)."""

  def __init__(self, c):
    super().__init__()
    dim = c["hidden_dim"]
    self.heads = c["num_heads"]
    self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
    self.drop = nn.Dropout(c["dropout"])

  def forward(self, h):
    b, t, dim = h.shape
    split = lambda z: z.view(b, t, self.heads, dim // self.heads).transpose(1, 2)
    q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dim // self.heads), -1)
    return self.o((self.drop(probs) @ v).transpose(1, 2).reshape(b, t, dim))


class _Block(nn.Module):
  """keras_hub's TransformerEncoder (post-norm): LN(h + drop(attn(h))), then
  LN(h + drop(W2 gelu(W1 h)))."""

  def __init__(self, c):
    super().__init__()
    dim, inner = c["hidden_dim"], c["intermediate_dim"]
    self.attn = _SelfAttention(c)
    self.ln1 = nn.LayerNorm(dim, eps=1e-12)
    self.ffn_in, self.ffn_out = nn.Linear(dim, inner), nn.Linear(inner, dim)
    self.gelu = nn.GELU(approximate="tanh")
    self.ln2 = nn.LayerNorm(dim, eps=1e-12)
    self.drop = nn.Dropout(c["dropout"])

  def forward(self, h):
    h = self.ln1(h + self.drop(self.attn(h)))
    return self.ln2(h + self.drop(self.ffn_out(self.gelu(self.ffn_in(h)))))


class BertClassifier(nn.Module):
  """The encoder of keras_hub's BertBackbone with its pooled output -> Linear(2)."""

  def __init__(self, c=None):
    super().__init__()
    c = c or BERT_BASE
    dim = c["hidden_dim"]
    self.token = nn.Embedding(c["vocabulary_size"], dim)
    self.position = nn.Embedding(c["max_sequence_length"], dim)
    self.segment = nn.Embedding(c["num_segments"], dim)
    self.ln = nn.LayerNorm(dim, eps=1e-12)
    self.drop = nn.Dropout(c["dropout"])
    self.blocks = nn.ModuleList(_Block(c) for _ in range(c["num_layers"]))
    self.pooled = nn.Linear(dim, dim)
    self.head = nn.Linear(dim, 2)
    for m in self.modules():   # keras_hub's BERT initializer: truncated normal, stddev 0.02
      if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.trunc_normal_(m.weight, std=0.02, a=-0.04, b=0.04)
      if isinstance(m, nn.Linear):
        nn.init.zeros_(m.bias)

  def forward(self, ids, segments):
    positions = torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)  # per example, batch first
    h = self.drop(self.ln(self.token(ids) + self.position(positions) + self.segment(segments)))
    for block in self.blocks:
      h = block(h)
    return self.head(torch.tanh(self.pooled(h[:, 0])))


def bert_one(a):
  """One (mode, seq) of the BERT encoder in this process: one JSON line (module docstring)."""
  from opacus import PrivacyEngine  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  rng = np.random.RandomState(0)
  ids = torch.tensor(rng.randint(1, 30522, (a.batch, a.seq)), dtype=torch.long)
  segments = torch.zeros_like(ids)
  y = torch.tensor(rng.randint(0, 2, a.batch), dtype=torch.long)
  model = BertClassifier()
  params = sum(p.numel() for p in model.parameters())
  model.train()   # dropout on, as keras' train_on_batch
  opt = torch.optim.SGD(model.parameters(), lr=0.01)
  crit = nn.CrossEntropyLoss()
  if a.mode != "nonprivate":
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(ids, segments, y), batch_size=a.batch)
    kw = dict(module=model, optimizer=opt, data_loader=loader, noise_multiplier=a.noise,
              max_grad_norm=1.0, grad_sample_mode=a.mode, poisson_sampling=False)
    if a.mode == "ghost":   # the criterion runs both backward passes in loss.backward()
      model, opt, crit, _ = PrivacyEngine().make_private(criterion=crit, **kw)
    else:
      model, opt, _ = PrivacyEngine().make_private(**kw)
  rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  times, cpu = [], []
  for i in range(a.warmup + a.steps):
    t0, c0 = time.perf_counter(), time.process_time()
    opt.zero_grad(set_to_none=True)
    crit(model(ids, segments), y).backward()
    opt.step()
    if i == 0:
      first = (time.perf_counter() - t0, time.process_time() - c0)
      rss_first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if i >= a.warmup:
      times.append(1e3 * (time.perf_counter() - t0))
      cpu.append(1e3 * (time.process_time() - c0))
  import opacus  # pylint: disable=g-import-not-at-top
  print(json.dumps({
      "framework": f"torch {torch.__version__} opacus {opacus.__version__}", "arch": ARCH,
      "params": params, "mode": a.mode, "batch": a.batch, "seq": a.seq,
      "noise_multiplier": a.noise if a.mode != "nonprivate" else None,
      "threads": torch.get_num_threads(),
      "ms_per_step": round(statistics.median(times), 1), "ms_all": [round(t) for t in times],
      "cpu_ms_per_step": round(statistics.median(cpu), 1),
      "first_step_s": round(first[0], 2), "first_step_cpu_s": round(first[1], 2),
      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
      "rss_after_build_mib": round(rss_built),
      "peak_rss_after_first_step_mib": round(rss_first),
      "load_avg": os.getloadavg()}), flush=True)


def _run_json(cmd):
  """The last JSON line `cmd` prints, or its failure (stderr's last lines) as a dict."""
  r = subprocess.run(cmd, capture_output=True, text=True, check=False)
  lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
  return json.loads(lines[-1]) if lines else {
      "failed": r.stderr.strip().splitlines()[-3:], "returncode": r.returncode}


_RATIO_KEYS = ("ms_per_step", "cpu_ms_per_step", "first_step_s", "first_step_cpu_s",
               "peak_rss_mib")


def _ratios(run, base):
  return {k: round(run[k] / base[k], 3) for k in _RATIO_KEYS if k in run and k in base}


def _ours(a, seq):
  """Our transformer_step_time.py --pair (non-private, DP) at `seq`, run by --ours-python."""
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_step_time.py")
  return _run_json([a.ours_python, script, "--pair", "--batch", str(a.batch), "--seq",
                    str(seq), "--steps", str(a.steps), "--warmup", str(a.warmup)])


def bert(a):
  """Per seq: each mode in its own child process, non-private first (module docstring)."""
  modes = [m for m in a.modes.split(",") if m != "nonprivate"]
  for seq in (int(s) for s in a.seqs.split(",")):
    before = _ours(a, seq) if a.ours_python else None
    runs = {}
    for mode in ["nonprivate"] + modes:
      runs[mode] = _run_json([sys.executable, os.path.abspath(__file__), "--bert-one", mode,
                              "--seq", str(seq), "--batch", str(a.batch), "--steps",
                              str(a.steps), "--warmup", str(a.warmup), "--threads",
                              str(a.threads or 2), "--noise", str(a.noise)])
      runs[mode].setdefault("mode", mode)
      runs[mode].setdefault("seq", seq)
      if mode != "nonprivate":
        runs[mode]["ratios_to_nonprivate"] = _ratios(runs[mode], runs["nonprivate"])
      print(json.dumps(runs[mode]), flush=True)
    if before is None:
      continue
    after = _ours(a, seq)
    ours = {f"ours_{w}": {m: {k: r.get("results", {}).get(m, {}).get(k)
                              for k in ("ms_per_step", "peak_rss_mib", "first_step_s")}
                          for m in ("nonprivate", "dp")} | {
                              "ratios": r.get("results", {}).get("ratios"),
                              "params": r.get("runs", {}).get("dp", {}).get("params"),
                              "failed": r.get("failed")}
            for w, r in (("before", before), ("after", after))}
    opacus_side = {m: {k: r.get(k) for k in ("ms_per_step", "cpu_ms_per_step", "peak_rss_mib",
                                             "first_step_s", "ratios_to_nonprivate", "params",
                                             "failed")}
                   for m, r in runs.items()}
    print(json.dumps({"side_by_side": True, "batch": a.batch, "seq": seq, **ours,
                      "opacus": opacus_side, "load_avg": os.getloadavg()}), flush=True)
  return 0


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--models", default="cnn,mlp", help="cnn,mlp or bert (alone)")
  p.add_argument("--modes", default=None,
                 help="default nonprivate,hooks,ghost,functorch,ew; bert: nonprivate,ghost,hooks")
  p.add_argument("--steps", type=int, default=None, help="default 20; bert: 5")
  p.add_argument("--warmup", type=int, default=None, help="default 3; bert: 1")
  p.add_argument("--batch", type=int, default=None, help="default 256; bert: 4")
  p.add_argument("--threads", type=int, default=0, help="torch threads (bert: 2 if 0)")
  p.add_argument("--seqs", default="32,128", help="bert: sequence lengths")
  p.add_argument("--noise", type=float, default=1.1, help="bert: noise multiplier z")
  p.add_argument("--ours-python", default=None,
                 help="bert: the python of tf_dpiter's venv: our --pair before and after")
  p.add_argument("--bert-one", default=None, help=argparse.SUPPRESS)   # child: one mode
  p.add_argument("--seq", type=int, default=32, help=argparse.SUPPRESS)
  args = p.parse_args()
  is_bert = args.models == "bert" or args.bert_one
  for key, cnn, big in (("modes", "nonprivate,hooks,ghost,functorch,ew",
                         "nonprivate,ghost,hooks"),
                        ("steps", 20, 5), ("warmup", 3, 1), ("batch", 256, 4)):
    if getattr(args, key) is None:
      setattr(args, key, big if is_bert else cnn)
  if args.threads or is_bert:
    torch.set_num_threads(args.threads or 2)
  if args.bert_one:
    args.mode = args.bert_one
    return bert_one(args)
  if is_bert:
    return bert(args)
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
  sys.exit(main())
