"""tutorials/keras_hub_dp_finetune.py runs at its CI size (--tiny), in full and with LoRA.

The tutorial builds a keras_hub BertTextClassifier from a config (no download), lets keras_hub
compile it, recompiles it with Adam and calls `make_private(task, l2_norm_clip=...,
noise_multiplier=...)`. Each run must train with the DP copy of that Adam (the ledger holds one
sample per step), print the ε its ledger gives (recomputed here from the ledger file it
wrote), and LoRA must train fewer parameters than full fine-tuning. Skipped without keras_hub
(`pip install -e ".[test]"` installs it).
"""

import importlib.util
import json
import os

import pytest

import tf_dpiter as dp

# Nightly tier (-m slow): the pretraining run without LoRA (the LoRA run stays).
SLOW_CASES = {
    "test_tutorial_tiny_prints_the_ledgers_epsilon[0-1]"}

pytest.importorskip("keras_hub", reason="keras_hub is not installed (pip install -e "
                    "'.[test]' installs it)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tutorial():
  spec = importlib.util.spec_from_file_location(
      "keras_hub_dp_finetune", os.path.join(ROOT, "tutorials", "keras_hub_dp_finetune.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.filterwarnings("ignore:Layer .* does not support masking")
# the LoRA run skips the public pretraining (a plain Keras fit the full run covers): the
# default suite's time goes to the DP steps
@pytest.mark.parametrize("lora,pretrain_epochs", [(0, 1), (2, 0)])
def test_tutorial_tiny_prints_the_ledgers_epsilon(lora, pretrain_epochs, tmp_path, capsys):
  ledger_path = str(tmp_path / "ledger.json")
  summary = _tutorial().main(["--tiny", "--lora", str(lora), "--verbose", "0",
                              "--pretrain_epochs", str(pretrain_epochs),
                              "--ledger_path", ledger_path])
  out = capsys.readouterr().out
  printed = json.loads(out.strip().splitlines()[-1])
  assert printed == summary
  assert printed["mode"] == ("full" if lora == 0 else f"lora{lora}")
  assert printed["pretrain_epochs"] == pretrain_epochs
  with open(ledger_path) as f:
    ledger_json = f.read()
  assert json.loads(ledger_json)["num_samples"] == printed["steps"] > 0
  assert printed["epsilon"] == dp.accounting.epsilon(ledger_json, printed["delta"])
  assert 0 < printed["epsilon"] < float("inf")
  assert "optimizer DPKerasAdamOptimizer" in out
  assert "(RDP accountant" in out and "test accuracy" in out and "offline:" in out
  assert 0.0 <= printed["test_accuracy"] <= 1.0
  assert printed["clipping"] == "fast"   # keras_hub's BERT layers are on the allowlist
  # full fine-tuning trains every weight; LoRA the adapters and the head only
  if lora:
    assert 0 < printed["trainable_params"] < printed["total_params"] / 3, printed
  else:
    assert printed["trainable_params"] == printed["total_params"], printed
