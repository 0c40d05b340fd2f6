"""The privacy ledger (seed 002, Section 6): sampling and sum-query events in TF variables."""

from tf_dpiter.ledger.privacy_ledger import FIXED_SIZE
from tf_dpiter.ledger.privacy_ledger import FULL
from tf_dpiter.ledger.privacy_ledger import POISSON
from tf_dpiter.ledger.privacy_ledger import POLICIES
from tf_dpiter.ledger.privacy_ledger import SHUFFLE
from tf_dpiter.ledger.privacy_ledger import PrivacyLedger
from tf_dpiter.ledger.privacy_ledger import run_length_encode
from tf_dpiter.ledger.query_with_ledger import QueryWithLedger
