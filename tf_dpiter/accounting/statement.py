"""TF Privacy's `compute_dp_sgd_privacy_statement`, in tf_dpiter's terms (relation and unit).

Example level, as TF Privacy: the conservative number (each example once per epoch, policy
"shuffle": replace one, sensitivity 2C, no amplification) and the Poisson one (add or remove
one, sensitivity C; not claimed with microbatches). User level, with k =
`max_examples_per_user`: group privacy (Vadhan, "The Complexity of Differential Privacy",
Lemma 2.3): (e, d)-DP per example gives (k e, k e^((k-1) e) d) for k examples, d the largest
per-example delta within `delta`.
"""

import contextlib
import math
import warnings

from tf_dpiter import validation
from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.accounting import dp_sgd
from tf_dpiter.accounting import search

_LOG_DELTA_REL_TOL = 1e-9   # relative to |log d| (>= 11 for d <= 1e-5): ~1e-8 in log d


def group_epsilon(epsilon_at, k, delta):
  """Epsilon (a float; inf when no d exists in the range) of a group of k >= 1 examples at
  the group's delta in (0, 1) by group privacy (TF Privacy's user-level statement): the
  smallest k epsilon_at(d) with k exp((k-1) epsilon_at(d)) d <= delta, epsilon_at the
  per-example epsilon as a decreasing function of the per-example delta, by bisection on
  log d down to delta e^-40."""
  if k == 1:
    return epsilon_at(delta)

  def at(log_d):
    e = epsilon_at(math.exp(log_d))
    return k * math.exp(min((k - 1) * e, 700.0)) * math.exp(log_d) <= delta, k * e

  lo, hi = math.log(delta) - 40.0, math.log(delta / k)
  feasible = lambda log_d: at(log_d)[0]
  if feasible(hi):
    return at(hi)[1]
  if not feasible(lo):
    return math.inf   # group privacy gives no finite bound at this delta
  # feasible at lo, not at hi: the largest feasible log d, to ~1e-8 (about 32 halvings)
  return at(search.bisect(feasible, hi, lo, rel_tol=_LOG_DELTA_REL_TOL))[1]


@contextlib.contextmanager
def _delta_warned():
  """Within the block the delta >= 1/n warning (already given by the caller) is not repeated."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"delta=.* is >= 1/n", category=UserWarning)
    yield


def _line(label, value, accountant="rdp"):
  """One statement line; a GDP number says on its own line that it is approximate."""
  if not isinstance(value, float):
    return f"    {label}: {value}"
  if accountant == "gdp":
    return f"    {label}: ~{value:.4g} (GDP: approximate, not an upper bound)"
  return f"    {label}: {value:.4g}"


def _user_lines(n, batch_size, noise_multiplier, epochs, delta, k, accountant, microbatches):
  if k is None:
    return ["No user-level guarantee is given: it needs a bound on the number of examples "
            "per user (max_examples_per_user)."]
  lines = [f"User-level DP (a user is up to {k} examples; group privacy over {k} examples) "
           f"at delta = {delta:g}:"]

  def eps(sampling):
    steps = dp_sgd.dp_sgd_steps(n, batch_size, epochs)
    groups = dp_sgd.dp_sgd_groups(n, batch_size, noise_multiplier, steps, sampling)
    return accountant_lib.epsilon_function(groups, accountant)

  lines.append(_line("Epsilon with each example once per epoch",
                     group_epsilon(eps("shuffle"), k, delta), accountant))
  if not microbatches:
    lines.append(_line("Epsilon assuming Poisson sampling (*)",
                       group_epsilon(eps("poisson"), k, delta), accountant))
  return lines


def compute_dp_sgd_privacy_statement(number_of_examples, batch_size, num_epochs,
                                     noise_multiplier, delta, used_microbatching=True,
                                     max_examples_per_user=None, accountant="rdp"):
  """A multi-line privacy statement for DP-SGD, as TF Privacy's function of the same name.

  Args:
    number_of_examples: n, records in the training set.
    batch_size: B (expected batch size for Poisson).
    num_epochs: passes over the data (steps = ceil(epochs n / B)).
    noise_multiplier: z, noise stddev over the clip C.
    delta: in (0, 1).
    used_microbatching: True if gradients were clipped per microbatch (TF Privacy's default).
    max_examples_per_user: k, or None (no user-level number).
    accountant: "rdp", "pld" or "gdp" (an approximation; see accounting.gdp).

  Returns:
    str: the statement, naming the relation and the unit of each number.

  Warns:
    UserWarning: delta >= 1 / number_of_examples (`accountant.warn_if_delta_too_large`).

  Raises:
    ParameterValueError: a bad argument (named).
  """
  if max_examples_per_user is not None:
    validation.check_integer("max_examples_per_user", max_examples_per_user, 1)
  accountant_lib.warn_if_delta_too_large(delta, number_of_examples, stacklevel=3)
  n, b, z = number_of_examples, batch_size, noise_multiplier
  with _delta_warned():   # warned above, once
    shuffled = dp_sgd.compute_dp_sgd_privacy(n, b, z, num_epochs, delta,
                                             accountant=accountant, sampling="shuffle")
  head = (f"DP-SGD over {n} examples with {b} examples per step, noise multiplier {z:g}, for "
          f"{num_epochs:g} epochs ({shuffled.steps} steps), "
          f"{'with' if used_microbatching else 'without'} microbatching, and "
          + ("no bound on the number of examples per user." if max_examples_per_user is None
             else f"at most {max_examples_per_user} examples per user."))
  lines = [head, "",
           "The guarantee covers every model checkpoint released during training, not only "
           "the final model.", "",
           f"Example-level DP at delta = {delta:g}, {accountant.upper()} accountant"
           + (" (an approximation, not an upper bound)" if accountant == "gdp" else "") + ":",
           _line("Epsilon with each example once per epoch (replace-one adjacency, "
                 "sensitivity 2C, no amplification)", shuffled.epsilon, accountant)]
  if used_microbatching:
    lines.append(_line("Epsilon assuming Poisson sampling (*)",
                       "not given: with microbatches, removing an example re-deals the "
                       "others among microbatches"))
  else:
    with _delta_warned():
      poisson = dp_sgd.compute_dp_sgd_privacy(n, b, z, num_epochs, delta,
                                              accountant=accountant)
    lines.append(_line("Epsilon assuming Poisson sampling (*) (add/remove-one adjacency, "
                       "sensitivity C)", poisson.epsilon, accountant))
  lines += [""] + _user_lines(n, b, z, num_epochs, delta, max_examples_per_user, accountant,
                              used_microbatching)
  lines += ["", "(*) tf_dpiter's fit(x, y, batch_size=B) on arrays samples by Poisson, so this "
            "number holds for it; a pipeline that shuffles and cuts batches gets the first "
            "number."]
  return "\n".join(lines)
