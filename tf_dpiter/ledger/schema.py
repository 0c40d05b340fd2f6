"""The ledger's schema: sampling policy names and codes, relations, query kinds, columns.

A leaf module (it imports nothing from tf_dpiter), so the record modules (`records`,
`correlated_records`, `selection`), the policy objects (`policies`) and the accountant can all
import it without a cycle. The rules of each policy (relation, unit, participation, event)
live in `policies`, one object per policy; this module only names and numbers them.
"""

FORMAT_NAME = "tf_dpiter.privacy_ledger"
FORMAT_VERSION = 2

# Sampling policies (McMahan et al., "A General Approach to Adding Differential Privacy to
# Iterative Training Procedures", Section 5). Codes are the index in ALL_POLICIES.
POISSON = "poisson"            # each record joins each sample independently with probability q
FIXED_SIZE = "fixed_size"      # samples of `sample_size` records, drawn without replacement, independent
SHUFFLE = "shuffle"            # passes over a public random permutation, disjoint batches
FULL = "full"                  # every record in every sample (q = 1)
POLICIES = (POISSON, FIXED_SIZE, SHUFFLE, FULL)
# Samplings of correlated-noise training and capped batches; their sample row reuses
# `sample_size` for the one integer each needs:
CYCLIC_POISSON = "cyclic_poisson"        # b groups; step p Poisson-samples group p mod b with
                                         # probability q. sample_size = b
TRUNCATED_POISSON = "truncated_poisson"  # Poisson(q) then a uniform subset of at most B.
                                         # sample_size = B (the static cap)
EXTRA_POLICIES = (CYCLIC_POISSON, TRUNCATED_POISSON)
# User-level Poisson sampling: each *user* joins each sample with probability q; the unit of
# privacy is the user (add or remove one user with all of their examples).
USER_POISSON = "user_poisson"
POISSON_POLICIES = (POISSON, USER_POISSON)
# Balls-in-bins / random allocation: every example in one uniformly random step of each epoch
# of k steps. sample_size = k, selection_probability = 1 / k; epochs counted as `passes`.
BALLS_IN_BINS = "balls_in_bins"
# Not a sampling: the marker of a private selection (`ledger.selection`).
REPEAT_AND_SELECT = "repeat_and_select"
ALL_POLICIES = POLICIES + EXTRA_POLICIES + (USER_POISSON, BALLS_IN_BINS, REPEAT_AND_SELECT)
# Policies whose sample_size is a whole number in [1, n] (cycle length b, cap B, epoch k).
WHOLE_SIZE_POLICIES = EXTRA_POLICIES + (BALLS_IN_BINS,)
POLICY_CODE = {p: i for i, p in enumerate(ALL_POLICIES)}

# Neighbouring relations, spelled as dp-accounting's NeighboringRelation.
ADD_OR_REMOVE = "add_or_remove_one"
REPLACE_ONE = "replace_one"
RELATIONS = (ADD_OR_REMOVE, REPLACE_ONE)
RELATION_OF_POLICY = {POISSON: ADD_OR_REMOVE, FULL: ADD_OR_REMOVE, FIXED_SIZE: REPLACE_ONE,
                      SHUFFLE: REPLACE_ONE, CYCLIC_POISSON: ADD_OR_REMOVE,
                      TRUNCATED_POISSON: ADD_OR_REMOVE, USER_POISSON: ADD_OR_REMOVE,
                      BALLS_IN_BINS: ADD_OR_REMOVE}
UNIT_OF_POLICY = {p: "user" if p == USER_POISSON else "example" for p in RELATION_OF_POLICY}

# Query kinds (the rules of the correlated kinds are stated in `records`).
GAUSSIAN, LAPLACE, NON_PRIVATE = 0, 1, 2
BANDED_GAUSSIAN, TREE_GAUSSIAN, MATRIX_GAUSSIAN = 3, 4, 5
KIND_NAME = {GAUSSIAN: "gaussian", LAPLACE: "laplace", NON_PRIVATE: "non_private",
             BANDED_GAUSSIAN: "banded_gaussian", TREE_GAUSSIAN: "tree_gaussian",
             MATRIX_GAUSSIAN: "matrix_gaussian"}

SAMPLE_COLUMNS = ("population_size", "selection_probability", "sample_size", "policy",
                  "examples_per_record", "num_queries")
QUERY_COLUMNS = ("sample_index", "kind", "clip", "noise", "sensitivity")
