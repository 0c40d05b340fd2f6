"""The DP plan as a value: `dp.keras.DPConfig` (frozen, validated once, equality,
get_config/from_config) and `dp.keras.PerformanceFlags` kept apart from it; the optimizers
build the plan from their keywords or take it (`dp_config=` / `plan=`), and their Keras
config round-trips, including a config saved by the previous version (flat keywords).
"""

import dataclasses
import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_the_plan_is_a_frozen_validated_value():
  plan = dp.keras.DPConfig(l2_norm_clip=1.0, noise_multiplier=1.1,
                           noise=dp.keras.noise.BLT(num_steps=8, min_separation=2))
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.noise_multiplier = 0.5
  assert plan == dp.keras.DPConfig.from_config(plan.get_config())
  assert plan != plan.replace(noise_multiplier=1.2)
  assert hash(plan) == hash(dp.keras.DPConfig.from_config(plan.get_config()))
  assert dp.keras.DPConfig(l2_norm_clip=1, noise_multiplier=1, noise="iid").noise == \
      dp.keras.noise.IID()
  with pytest.raises(dp.PrivacyConfigError, match=r"`l2_norm_clip` must be .*l2_norm_clip=-1"):
    dp.keras.DPConfig(l2_norm_clip=-1.0, noise_multiplier=1.0)
  with pytest.raises(dp.PrivacyConfigError,
                     match=r"`sampling` must be 'cyclic_poisson' \(or None\) for noise='blt'"):
    plan.replace(sampling="poisson")
  with pytest.raises(dp.PrivacyConfigError, match=r"`accountant` must be one of .*'gdp'"):
    plan.replace(accountant="gdp")
  with pytest.raises(TypeError, match="final"):
    type("Sub", (dp.keras.DPConfig,), {})


def test_performance_flags_are_not_part_of_the_plan():
  flags = dp.keras.PerformanceFlags(max_physical_batch_size=8, clipping="vectorized")
  assert flags.replace(skip_padding_tail=False).get_config() == {
      "max_physical_batch_size": 8, "clipping": "vectorized", "compiled_noise": None,
      "skip_padding_tail": False}
  assert {f.name for f in dataclasses.fields(dp.keras.DPConfig)}.isdisjoint(
      f.name for f in dataclasses.fields(dp.keras.PerformanceFlags))
  with pytest.raises(ValueError, match=r"`clipping` must be one of .*Received: clipping='x'"):
    dp.keras.PerformanceFlags(clipping="x")
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, max_physical_batch_size=8, learning_rate=0.1)
  assert opt.flags.max_physical_batch_size == 8 and opt.max_physical_batch_size == 8
  new = opt.private_step.set_flags(skip_padding_tail=False)
  assert opt.flags is new and opt.private_step.skip_padding_tail is False
  with pytest.raises(AttributeError):
    opt.private_step.skip_padding_tail = True   # only the step writes its fields


def test_the_keywords_and_the_plan_build_the_same_optimizer():
  plan = dp.keras.DPConfig(l2_norm_clip=0.8, noise_multiplier=1.3, num_microbatches=4,
                           noise=dp.keras.noise.Tree(restart_every=4))
  by_plan = dp.keras.DPKerasSGDOptimizer(dp_config=plan, learning_rate=0.1, name="o")
  by_alias = dp.keras.DPKerasSGDOptimizer(plan=plan, learning_rate=0.1, name="o")
  by_keywords = dp.keras.DPKerasSGDOptimizer(0.8, 1.3, 4, noise="tree", restart_every=4,
                                             learning_rate=0.1, name="o")
  by_object = dp.keras.DPKerasSGDOptimizer(0.8, 1.3, 4, noise=dp.keras.noise.Tree(4),
                                           learning_rate=0.1, name="o")
  assert by_plan.dp_config is plan
  assert by_plan.dp_config == by_alias.dp_config == by_keywords.dp_config == by_object.dp_config
  assert by_plan.get_config() == by_keywords.get_config() == by_object.get_config()
  assert by_plan.noise == "tree" and by_plan.noise_params == {"restart_every": 4}
  with pytest.raises(dp.PrivacyConfigError,
                     match=r"`noise_multiplier` must be left out when dp_config= is given"):
    dp.keras.DPKerasSGDOptimizer(dp_config=plan, noise_multiplier=2.0, learning_rate=0.1)
  with pytest.raises(dp.PrivacyConfigError, match=r"`restart_every` must be left out"):
    dp.keras.DPKerasSGDOptimizer(dp_config=plan, restart_every=2, learning_rate=0.1)


def test_config_of_the_previous_version_still_loads():
  """A config with the flat keywords, as the previous version saved it (no new keys)."""
  # DPKerasSGDOptimizer(1.0, 1.1, max_physical_batch_size=16, noise="band_mf", num_bands=2,
  # num_steps=8, learning_rate=0.5).get_config() of 7ec3ad6 (before the plan object)
  old = {"name": "dp_keras_sgd_optimizer", "learning_rate": 0.5, "weight_decay": None,
         "clipnorm": None, "global_clipnorm": None, "clipvalue": None, "use_ema": False,
         "ema_momentum": 0.99, "ema_overwrite_frequency": None, "loss_scale_factor": None,
         "gradient_accumulation_steps": None, "momentum": 0.0, "nesterov": False,
         "l2_norm_clip": 1.0, "noise_multiplier": 1.1, "num_microbatches": None,
         "max_physical_batch_size": 16, "clipping": "auto", "normalize": True, "seed": None,
         "ledger_journal": None, "secure_mode": False, "noise": "band_mf", "num_bands": 2,
         "num_steps": 8, "band_strategy": "toeplitz"}
  opt = dp.keras.DPKerasSGDOptimizer.from_config(old)
  assert opt.dp_config == dp.keras.DPConfig(
      l2_norm_clip=1.0, noise_multiplier=1.1,
      noise=dp.keras.noise.BandMF(num_bands=2, num_steps=8, strategy="toeplitz"))
  assert opt.flags.max_physical_batch_size == 16
  assert opt.get_config() == old


def test_plan_sampling_and_accountant_round_trip_and_are_enforced():
  x = np.random.RandomState(0).randn(32, 4).astype("float32")
  y = np.arange(32) % 2
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, sampling="shuffle", accountant="pld",
                                     learning_rate=0.1)
  config = opt.get_config()
  assert (config["sampling"], config["accountant"]) == ("shuffle", "pld")
  assert dp.keras.DPKerasSGDOptimizer.from_config(config).dp_config == opt.dp_config
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(optimizer=opt, loss=LOSS)
  with pytest.raises(dp.PrivacyConfigError, match=r"`policy` must be 'shuffle', the plan's "
                                                  r"sampling .*Received: policy='poisson'"):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, sampling="shuffle")
  assert int(model.ledger.sample_count) == 4
  assert opt.dp_config.epsilon(model.ledger, 1e-5) == pytest.approx(
      dp.accounting.epsilon(model.ledger, 1e-5, accountant="pld"), rel=1e-12)


def test_dp_optimizer_and_make_private_take_the_plan():
  plan = dp.keras.DPConfig(l2_norm_clip=0.5, noise_multiplier=1.4)
  flags = dp.keras.PerformanceFlags(max_physical_batch_size=4)
  opt = dp.keras.DPOptimizer(keras.optimizers.Adam(1e-3), dp_config=plan, flags=flags)
  assert opt.dp_config is plan and opt.flags is flags and opt.learning_rate.numpy() == \
      pytest.approx(1e-3)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  dp.keras.make_private(model, plan=plan)
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
  assert model.optimizer.dp_config == plan


def test_the_no_noise_warning_points_at_the_users_line():
  with pytest.warns(UserWarning, match="adds no noise") as record:
    dp.keras.DPKerasSGDOptimizer(1.0, 0.0, learning_rate=0.1)
  with pytest.warns(UserWarning, match="adds no noise") as record_plan:
    dp.keras.DPConfig(l2_norm_clip=1.0, noise_multiplier=0.0)
  assert [w.filename for w in record] == [w.filename for w in record_plan] == [__file__]


def test_no_module_but_private_step_writes_the_steps_fields():
  """`step.x = ...` / `opt.private_step.x = ...` (and `step.state.x = ...`) appear only in
  keras/optimizer/private_step.py: the step is the one owner of its fields."""
  import ast  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top

  def is_step(node):
    return ((isinstance(node, ast.Name) and node.id in ("step", "private_step"))
            or (isinstance(node, ast.Attribute) and node.attr == "private_step"))

  package = pathlib.Path(dp.__file__).parent
  found = []
  for path in sorted(package.rglob("*.py")):
    if path.name == "private_step.py":
      continue
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      targets = (node.targets if isinstance(node, ast.Assign) else
                 [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
      for t in targets:
        if isinstance(t, ast.Attribute) and (
            is_step(t.value) or (isinstance(t.value, ast.Attribute) and is_step(t.value.value))):
          found.append(f"{path.relative_to(package)}:{node.lineno}")
  assert found == []
