import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter import dp_query as dpq
from tf_dpiter import federated as F
from tf_dpiter import ledger as ledger_lib


@pytest.mark.parametrize("values, mask, expected", [
    ([3.0, 1.0, 2.0], [1, 1, 1], 2.0),
    ([4.0, 1.0, 2.0, 3.0], [1, 1, 1, 1], 2.5),
    ([4.0, 100.0, 2.0, 3.0], [1, 0, 1, 1], 3.0),
    ([5.0], [0], 0.0),
])
def test_median_of_masked(values, mask, expected):
  assert float(F.median_of_masked(values, mask)) == pytest.approx(expected)


@pytest.mark.parametrize("n, d", [(7, 5), (10, 3), (51, 20)])
def test_median_clip_clips_every_update_to_the_median(n, d):
  rng = np.random.default_rng(n)
  records = (rng.normal(size=(n, d)) * rng.uniform(0.1, 10, size=(n, 1))).astype(np.float32)
  norms = np.linalg.norm(records, axis=1)
  med = np.median(norms)
  q = F.MedianNormClipSumQuery(noise_multiplier=0.0)
  clipped, s = q.clip_to_median(tf.constant(records), tf.ones([n]))
  clipped = clipped.numpy()
  new_norms = np.linalg.norm(clipped, axis=1)
  assert float(s) == pytest.approx(med, rel=1e-6)
  # Every clipped update has norm <= median; large ones are scaled DOWN to exactly the median.
  assert np.all(new_norms <= med * (1 + 1e-5))
  big = norms > med
  np.testing.assert_allclose(new_norms[big], med, rtol=1e-5)
  # Small updates are NOT scaled up (the published code's bug): unchanged.
  np.testing.assert_allclose(clipped[~big], records[~big], rtol=1e-6)
  # Direction kept.
  cos = np.sum(clipped * records, 1) / (new_norms * norms)
  np.testing.assert_allclose(cos, 1.0, rtol=1e-5)


def test_median_query_noise_free_sum_and_event_through_ledger():
  rng = np.random.default_rng(0)
  records = rng.normal(size=(9, 4)).astype(np.float32) * np.arange(1, 10)[:, None]
  med = np.median(np.linalg.norm(records, axis=1))
  inner = F.MedianNormClipSumQuery(noise_multiplier=0.0)
  query = ledger_lib.QueryWithLedger(inner, population_size=90, selection_probability=0.1,
                                     policy="fixed_size", sample_size=9)
  gs = query.initial_global_state()
  state = query.initial_sample_state(tf.TensorSpec([4], tf.float32))
  state = inner.accumulate_records(query.derive_sample_params(gs), state, records[:5])
  state2 = inner.accumulate_records((), inner.initial_sample_state(tf.TensorSpec([4])),
                                    records[5:])
  state = query.merge_sample_states(state, state2)
  result, new_gs, events = query.get_noised_result(state, gs)
  factor = np.minimum(1, med / np.linalg.norm(records, axis=1))
  np.testing.assert_allclose(result.numpy(), (records * factor[:, None]).sum(0), rtol=1e-5)
  assert float(new_gs.l2_norm_clip) == pytest.approx(med, rel=1e-6)
  assert float(events[0].l2_norm_clip) == pytest.approx(med, rel=1e-6)
  assert int(query.ledger.sample_count) == 1


def test_median_query_noise_scales_with_median():
  # stddev = z * S_t: with 200k noise draws the sample stddev is within ~0.5% (3 sigma).
  records = np.zeros((3, 200000), np.float32)
  records[:, 0] = [1.0, 2.0, 3.0]
  q = F.MedianNormClipSumQuery(noise_multiplier=0.5, seed=1)
  state = q.accumulate_records((), q.initial_sample_state(tf.TensorSpec([200000])), records)
  result, _, (event,) = q.get_noised_result(state, q.initial_global_state())
  assert float(event.stddev) == pytest.approx(1.0)
  assert float(np.std(result.numpy()[1:])) == pytest.approx(1.0, rel=0.01)


@pytest.mark.parametrize("kind", ["fixed", "quantile", "median"])
def test_set_noise_multiplier(kind):
  q = F.make_query(kind, noise_multiplier=1.0, clients_per_round=40, l2_norm_clip=2.0, seed=0)
  gs = F.set_noise_multiplier(q, q.initial_global_state(), 1.7)
  _, _, events = q.get_noised_result(q.initial_sample_state(tf.TensorSpec([3])), gs)
  z = sum((float(e.l2_norm_clip) / float(e.stddev)) ** 2 for e in events) ** -0.5
  assert z == pytest.approx(1.7, rel=1e-5)


def test_set_noise_multiplier_rejects_noise_on_nonprivate():
  with pytest.raises(ValueError, match="noise_multiplier"):
    F.set_noise_multiplier(dpq.NoPrivacySumQuery(), (), 1.0)
