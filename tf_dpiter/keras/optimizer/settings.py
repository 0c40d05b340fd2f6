"""Checks of the DP optimizer settings (McMahan et al. 2018, Section 2: clip S and noise multiplier z).

S: L2 clipping norm per record (loss-gradient units); z: noise stddev over S (the noise on a
clipped sum is N(0, (z S)^2)); M: microbatches per batch; P: examples per physical chunk.
"""

import math
import warnings

from tf_dpiter import dp_query as dp_query_lib

CLIPPING_MODES = ("auto", "vectorized", "fast")


def check_args(l2_norm_clip, noise_multiplier, num_microbatches, dp_query,
               max_physical_batch_size, clipping):
  """Checks a DP optimizer's settings (see DPOptimizerMixin.__init__).

  Warns:
    UserWarning: noise_multiplier=0 (the optimizer adds no noise: its ledger reports
      epsilon = inf), naming the value and what to do.

  Raises:
    ValueError: naming the first bad parameter and its value (S must be > 0, z finite >= 0,
      S = inf only with z = 0, M and P positive integers or None, clipping a known mode,
      dp_query a DPQuery given instead of, not with, (S, z)).
  """
  if dp_query is not None:
    if not isinstance(dp_query, dp_query_lib.DPQuery):
      raise ValueError(f"dp_query must be a tf_dpiter DPQuery, got {dp_query!r}")
    if l2_norm_clip is not None or noise_multiplier is not None:
      raise ValueError("give either dp_query or (l2_norm_clip, noise_multiplier), not both; got "
                       f"l2_norm_clip={l2_norm_clip!r}, noise_multiplier={noise_multiplier!r}")
  else:
    if l2_norm_clip is None or noise_multiplier is None:
      raise ValueError("l2_norm_clip and noise_multiplier are required without dp_query; got "
                       f"l2_norm_clip={l2_norm_clip!r}, noise_multiplier={noise_multiplier!r}")
    try:
      c = float(l2_norm_clip)
    except (TypeError, ValueError):
      raise ValueError(f"l2_norm_clip must be a positive number, got {l2_norm_clip!r}") from None
    if not c > 0 or math.isnan(c):
      raise ValueError(f"l2_norm_clip must be > 0 (inf allowed with noise 0), got {l2_norm_clip!r}")
    try:
      z = float(noise_multiplier)
    except (TypeError, ValueError):
      raise ValueError(f"noise_multiplier must be a number >= 0, got {noise_multiplier!r}") from None
    if not z >= 0 or math.isinf(z):
      raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    if math.isinf(c) and z > 0:
      raise ValueError(f"l2_norm_clip=inf needs noise_multiplier=0 (noise z*S would be infinite), "
                       f"got noise_multiplier={noise_multiplier!r}")
    if z == 0:
      warnings.warn(
          f"noise_multiplier={noise_multiplier!r}: this DP optimizer adds no noise, so its "
          "training is NOT differentially private (the ledger reports epsilon = inf). Use "
          "noise_multiplier > 0 (about 1.0 is usual), or from_budget(epsilon, delta, ...) / "
          "make_private_with_epsilon to calibrate it; noise 0 is for tests only",
          UserWarning, stacklevel=3)
  if num_microbatches is not None and (
      isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int)
      or num_microbatches < 1):
    raise ValueError(f"num_microbatches must be None or a positive integer, got {num_microbatches!r}")
  if max_physical_batch_size is not None and (
      isinstance(max_physical_batch_size, bool) or not isinstance(max_physical_batch_size, int)
      or max_physical_batch_size < 1):
    raise ValueError("max_physical_batch_size must be None or a positive integer, got "
                     f"{max_physical_batch_size!r}")
  if clipping not in CLIPPING_MODES:
    raise ValueError(f"clipping must be one of {CLIPPING_MODES}, got {clipping!r}")
