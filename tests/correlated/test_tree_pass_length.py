"""noise="tree": restart_every R must divide the steps of a shuffled pass as the data makes
them (Tree.check_sampling's steps_per_pass), floor(n / B) with drop_remainder.

Relation: replace one example (shuffled passes, no amplification; a leaf's sensitivity 2S).
With n = 50, B = 6 and drop_remainder a pass is floor(50 / 6) = 8 steps: R = 8 keeps every
tree inside one pass and is accepted, R = 3 is refused naming the parameter and its value.
Without a stated pass length the check keeps ceil(n / B) (9 here), as for data declared by
hand.
"""

import pytest

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras import noise
from tf_dpiter.ledger import records

N, B = 50, 6


def test_restart_every_dividing_the_stated_pass_length_is_accepted():
  noise.Tree(8).check_sampling(records.SHUFFLE, N, B, steps_per_pass=8)
  noise.Tree(4).check_sampling(records.SHUFFLE, N, B, steps_per_pass=8)
  noise.Tree(9).check_sampling(records.SHUFFLE, N, B)   # ceil(50 / 6) = 9, nothing stated


@pytest.mark.parametrize("restart_every,steps_per_pass,match", [
    (3, 8, r"`restart_every` must divide the steps of a shuffled pass .*a pass of this dataset "
           r"is 8 steps \(its steps_per_pass\) \(e.g. restart_every=8\)\. Received: "
           r"restart_every=3$"),
    (8, None, r"a pass here is ceil\(n / B\) = ceil\(50 / 6\) = 9 steps .*Received: "
              r"restart_every=8$"),
])
def test_restart_every_not_dividing_the_pass_is_refused_naming_it(restart_every,
                                                                 steps_per_pass, match):
  with pytest.raises(PrivacyConfigError, match=match):
    noise.Tree(restart_every).check_sampling(records.SHUFFLE, N, B,
                                             steps_per_pass=steps_per_pass)


def test_a_bad_steps_per_pass_is_refused_naming_it():
  with pytest.raises(PrivacyConfigError, match=r"steps_per_pass=0"):
    noise.Tree(2).check_sampling(records.SHUFFLE, N, B, steps_per_pass=0)


def test_other_mechanisms_take_the_keyword_and_ignore_it():
  noise.IID().check_sampling(records.POISSON, N, B, steps_per_pass=7)
