"""PrivacyLedger: nothing dropped, checkpoint/restore continues, JSON round trip and refusal."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.ledger import ledger_file

from tf_dpiter import accounting
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L


def gaussian(clip, std):
  return (dq.GaussianSumEvent(clip, std),)


# 20,000 steps grow the buffers from 3 rows through 13 doublings; 100,000 (16 doublings, ~5 s
# of CPU) run with -m slow.
@pytest.mark.parametrize("steps", [20_000, pytest.param(100_000, marks=pytest.mark.slow)])
def test_record_many_steps_inside_tf_function_loses_nothing(steps):
  led = L.PrivacyLedger(initial_capacity=3)

  @tf.function
  def run(n):
    for i in tf.range(n):
      z = 1.0 + tf.cast(i % 3, tf.float32)  # three different query configurations
      led.record_sample(60000.0, 256 / 60000, (dq.GaussianSumEvent(1.0, z),
                                               dq.GaussianSumEvent(0.5, 2.0)))
    return led.sample_count

  assert int(run(tf.constant(steps, tf.int64))) == steps
  samples, queries = led.get_arrays()
  assert samples.shape == (steps, 6) and queries.shape == (2 * steps, 5)
  np.testing.assert_array_equal(queries[::2, 3], 1.0 + np.arange(steps) % 3)
  np.testing.assert_array_equal(queries[:, 0], np.repeat(np.arange(steps), 2))
  assert np.all(samples[:, 0] == 60000.0)


def make_ledger_steps(led, start, stop):
  for i in range(start, stop):
    z = 1.1 if i < 40 else 0.8
    led.record_sample(1000.0, 0.05, gaussian(1.0, z))


def test_checkpoint_restore_continue_gives_same_epsilon(tmp_path):
  full = L.PrivacyLedger(initial_capacity=2)
  make_ledger_steps(full, 0, 100)

  first = L.PrivacyLedger(initial_capacity=2)
  make_ledger_steps(first, 0, 55)
  path = tf.train.Checkpoint(ledger=first).save(os.path.join(tmp_path, "ckpt"))

  resumed = L.PrivacyLedger(initial_capacity=7)  # a fresh process, other capacity
  tf.train.Checkpoint(ledger=resumed).restore(path).assert_consumed()
  assert int(resumed.sample_count) == 55
  make_ledger_steps(resumed, 55, 100)

  for a, b in zip(full.get_arrays(), resumed.get_arrays()):
    np.testing.assert_array_equal(a, b)
  assert accounting.epsilon(resumed, 1e-5) == accounting.epsilon(full, 1e-5)


def test_query_with_ledger_records_one_sample_with_all_queries():
  inner = dq.NestedQuery([dq.GaussianSumQuery(1.0, 2.0, seed=0),
                          dq.GaussianSumQuery(3.0, 4.0, seed=0)])
  q = L.QueryWithLedger(inner, population_size=500, selection_probability=0.1)
  g = q.initial_global_state()
  tmpl = [tf.TensorSpec([2]), tf.TensorSpec([3])]

  @tf.function
  def step(g):
    s = q.accumulate_records(q.derive_sample_params(g), q.initial_sample_state(tmpl),
                             [tf.ones([5, 2]), tf.ones([5, 3])])
    return q.get_noised_result(s, g)

  step(g)
  q.set_sampling(800, 0.2)
  step(g)
  samples, queries = q.ledger.get_arrays()
  np.testing.assert_allclose(samples[:, :2], [[500, 0.1], [800, 0.2]])
  # (sample, kind, clip, noise, sensitivity): Poisson is add/remove, so sensitivity = clip
  np.testing.assert_allclose(queries, [[0, 0, 1, 2, 1], [0, 0, 3, 4, 3], [1, 0, 1, 2, 1],
                                       [1, 0, 3, 4, 3]])


def test_json_round_trip(tmp_path):
  led = L.PrivacyLedger()
  for i in range(30):
    led.record_sample(100.0, 0.1, gaussian(1.0, 1.0 + (i >= 20)))
  led.record_sample(100.0, 1.0, (dq.LaplaceSumEvent(1.0, 2.0),), policy="full")
  led.record_sample(100.0, 0.2, gaussian(1.0, 1.0), policy="fixed_size", sample_size=20)
  path = os.path.join(tmp_path, "ledger.json")
  led.save_json(path)
  d = json.load(open(path))
  assert d["format"] == "tf_dpiter.privacy_ledger" and d["version"] == 2
  assert d["digest"].startswith("sha256:")
  assert [r["relation"] for r in d["runs"]][-2:] == ["add_or_remove_one", "replace_one"]
  assert d["runs"][-1]["queries"][0]["sensitivity"] == 2.0   # replace-one: 2S
  assert [r["count"] for r in d["runs"]] == [20, 10, 1, 1]  # run-length coded
  back = L.PrivacyLedger.load_json(path)
  for a, b in zip(led.get_arrays(), back.get_arrays()):
    np.testing.assert_array_equal(a, b)
  back.record_sample(100.0, 0.1, gaussian(1.0, 1.0))  # an imported ledger keeps growing
  assert int(back.sample_count) == 33


def good_dict():
  """An unsigned v2 dict; tests sign it after mutating (only content checks are tested)."""
  return {"format": "tf_dpiter.privacy_ledger", "version": 2, "num_samples": 2, "passes": 0,
          "runs": [{"count": 2, "population_size": 100.0, "selection_probability": 0.1,
                    "sample_size": 0.0, "policy": "poisson", "relation": "add_or_remove_one",
                    "examples_per_record": 1,
                    "queries": [{"type": "gaussian", "l2_norm_clip": 1.0, "stddev": 1.0,
                                 "sensitivity": 1.0}]}]}


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d.update(version=99), "version"),
    (lambda d: d.update(num_samples=3), "num_samples"),
    (lambda d: d["runs"][0].update(count=-1), "count"),
    (lambda d: d["runs"][0].update(count=1.5), "count"),
    (lambda d: d["runs"][0].update(selection_probability=1.5), "selection_probability"),
    (lambda d: d["runs"][0].update(population_size=0), "population_size"),
    (lambda d: d["runs"][0].update(policy="sometimes"), "policy"),
    (lambda d: d["runs"][0].pop("population_size"), "population_size"),
    (lambda d: d["runs"][0]["queries"][0].update(stddev=-1.0), "noise"),
    (lambda d: d["runs"][0]["queries"][0].update(type="magic"), "type"),
    (lambda d: d["runs"][0]["queries"][0].update(stddev=float("nan")), "non-finite"),
    (lambda d: d["runs"][0].update(policy="fixed_size", relation="replace_one", sample_size=0),
     "sample_size"),
    (lambda d: d["runs"][0].update(relation="replace_one"), "relation"),
    (lambda d: d["runs"][0]["queries"][0].update(sensitivity=0.5), "sensitivity"),
    (lambda d: d["runs"][0].update(examples_per_record=4), "microbatches"),
    (lambda d: d.update(passes=-1), "passes"),
    (lambda d: d.update(version=1), "version 1"),
])
def test_malformed_json_is_refused(mutate, match):
  d = good_dict()
  L.PrivacyLedger.from_dict(ledger_file.sign(d))  # the unmutated one is accepted
  mutate(d)
  with pytest.raises(ValueError, match=match):
    L.PrivacyLedger.from_json(json.dumps(ledger_file.sign(d)))


def _saved(tmp_path, key=None):
  led = L.PrivacyLedger()
  for _ in range(5):
    led.record_sample(100.0, 0.1, gaussian(1.0, 1.1))
  led.record_sample(100.0, 0.1, gaussian(2.0, 1.1))
  path = os.path.join(tmp_path, "ledger.json")
  led.save_json(path, key=key)
  return path, json.load(open(path))


@pytest.mark.parametrize("tamper", [
    lambda d: d["runs"][0]["queries"][0].update(l2_norm_clip=0.5, sensitivity=0.5),
    lambda d: (d["runs"].pop(), d.update(num_samples=d["num_samples"] - 1)),  # run + its count
    lambda d: d.update(passes=7),
])
def test_tampered_ledger_file_is_refused(tmp_path, tamper):
  path, d = _saved(tmp_path)
  tamper(d)
  json.dump(d, open(path, "w"))
  with pytest.raises(ValueError, match="altered"):
    L.PrivacyLedger.load_json(path)
  with pytest.raises(ValueError, match="altered"):
    dp.accounting.privacy_report(d, delta=1e-5)


def test_hmac_key_is_checked(tmp_path):
  path, d = _saved(tmp_path, key="secret")
  assert d["hmac"].startswith("hmac-sha256:")
  assert int(L.PrivacyLedger.load_json(path, key="secret").sample_count) == 6
  with pytest.raises(ValueError, match="HMAC"):
    L.PrivacyLedger.load_json(path, key="other")
  # re-signed by someone without the key: the digest matches, the HMAC does not
  d["runs"][0]["count"] = 1
  d["num_samples"] = 2
  json.dump(ledger_file.sign(d), open(path, "w"))
  with pytest.raises(ValueError, match="hmac"):
    L.PrivacyLedger.load_json(path, key="secret")


def test_broken_json_file_is_refused(tmp_path):
  p = os.path.join(tmp_path, "bad.json")
  open(p, "w").write('{"format": "tf_dpiter.privacy_ledger", "runs": [')
  with pytest.raises(ValueError, match="bad.json"):
    L.PrivacyLedger.load_json(p)
  with pytest.raises(ValueError, match="could not be read"):
    L.PrivacyLedger.load_json(os.path.join(tmp_path, "missing.json"))


def test_bad_record_arguments():
  led = L.PrivacyLedger()
  with pytest.raises(ValueError, match="policy"):
    led.record_sample(10.0, 0.1, gaussian(1.0, 1.0), policy="random")
  with pytest.raises(ValueError, match="events"):
    led.record_sample(10.0, 0.1, ("not an event",))
  with pytest.raises(ValueError, match="selection_probability"):
    L.QueryWithLedger(dq.GaussianSumQuery(1.0, 1.0), 100, 0.0)
  with pytest.raises(ValueError, match="population_size"):
    L.QueryWithLedger(dq.GaussianSumQuery(1.0, 1.0), -5, 0.5)
  with pytest.raises(ValueError, match="sample_size"):
    L.QueryWithLedger(dq.GaussianSumQuery(1.0, 1.0), 100, 0.5, policy="shuffle", sample_size=0)


def test_files_of_the_first_kinds_re_save_with_the_same_digest():
  """Gaussian, Laplace and non-private rows (the kinds before issue 16) keep their file form:
  a file written by hand in that form loads and saves back to the same content and digest."""
  d = good_dict()
  d["num_samples"] = 3
  d["runs"].append({"count": 1, "population_size": 100.0, "selection_probability": 1.0,
                    "sample_size": 0.0, "policy": "full", "relation": "add_or_remove_one",
                    "examples_per_record": 1,
                    "queries": [{"type": "laplace", "l1_norm_clip": 1.0, "scale": 2.0,
                                 "sensitivity": 1.0}, {"type": "non_private"}]})
  signed = ledger_file.sign(d, key="k")
  again = L.PrivacyLedger.from_json(json.dumps(signed), key="k").to_dict(key="k")
  # the run table (`run_ids`, a field added since) is the only addition
  assert [n for _, n, _ in again.pop("run_ids")] == [3]
  assert ledger_file.sign(again, key="k") == signed
