"""The ledger's schema: sampling policy names, the selection marker's code, relations, query kinds, columns.

A leaf module (it imports nothing from tf_dpiter), so the record modules (`records`,
`correlated_records`, `selection`), the policy objects (`policies`) and the accountant can all
import it without a cycle. The rules of each policy (code, relation, unit, participation,
checks) live in `policies`, one object per policy; its dp-accounting event in
`tf_dpiter.accounting.policy_accounting`. This module only names them.
"""

FORMAT_NAME = "tf_dpiter.privacy_ledger"
FORMAT_VERSION = 2

# Sampling policy names (McMahan et al., "A General Approach to Adding Differential Privacy to
# Iterative Training Procedures", Section 5). Each policy's code in the ledger's rows, its
# relation and its unit are fields of its object (`policies`): stable numbers, never list
# positions.
POISSON = "poisson"            # each record joins each sample independently with probability q
FIXED_SIZE = "fixed_size"      # samples of `sample_size` records, drawn without replacement, independent
SHUFFLE = "shuffle"            # passes over a public random permutation, disjoint batches
FULL = "full"                  # every record in every sample (q = 1)
POLICIES = (POISSON, FIXED_SIZE, SHUFFLE, FULL)
# The other policies (their rules: the objects of `policies`); a sample row's `sample_size`
# holds the one integer each needs:
CYCLIC_POISSON = "cyclic_poisson"        # sample_size = b, the groups of the cycle
TRUNCATED_POISSON = "truncated_poisson"  # sample_size = B, the static cap
USER_POISSON = "user_poisson"            # the unit of privacy is the user
BALLS_IN_BINS = "balls_in_bins"          # sample_size = k steps per epoch, q = 1 / k; epochs
                                         # counted as `passes`
CLIENT_POISSON = "client_poisson"        # poisson, the unit of privacy a client (federated)
CLIENT_FIXED_SIZE = "client_fixed_size"  # fixed_size, the unit of privacy a client (federated)
# Not a sampling: the marker of a private selection (`ledger.selection`). Its code is reserved
# (no policy may take it); the policies' codes are 0..7, 9 and 10 (`policies`, pinned by a
# test).
REPEAT_AND_SELECT = "repeat_and_select"
REPEAT_AND_SELECT_CODE = 8
# The largest code a policy may take (the rows are float64: exact far beyond it).
MAX_POLICY_CODE = 2 ** 31 - 1

# Neighbouring relations, spelled as dp-accounting's NeighboringRelation.
ADD_OR_REMOVE = "add_or_remove_one"
REPLACE_ONE = "replace_one"
RELATIONS = (ADD_OR_REMOVE, REPLACE_ONE)
# Units of privacy a record can stand for.
UNITS = ("example", "user", "client")

# Query kinds (the rules of the correlated kinds are stated in `records`).
GAUSSIAN, LAPLACE, NON_PRIVATE = 0, 1, 2
BANDED_GAUSSIAN, TREE_GAUSSIAN, MATRIX_GAUSSIAN = 3, 4, 5
KIND_NAME = {GAUSSIAN: "gaussian", LAPLACE: "laplace", NON_PRIVATE: "non_private",
             BANDED_GAUSSIAN: "banded_gaussian", TREE_GAUSSIAN: "tree_gaussian",
             MATRIX_GAUSSIAN: "matrix_gaussian"}
# The correlated-noise row kinds a policy's `covers` names, and their query kind codes.
CORRELATED_KIND_OF_ROWS = {"banded": BANDED_GAUSSIAN, "tree": TREE_GAUSSIAN,
                           "matrix": MATRIX_GAUSSIAN}

SAMPLE_COLUMNS = ("population_size", "selection_probability", "sample_size", "policy",
                  "examples_per_record", "num_queries")
QUERY_COLUMNS = ("sample_index", "kind", "clip", "noise", "sensitivity")
