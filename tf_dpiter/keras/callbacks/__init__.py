"""Keras callbacks of the privacy ledger (McMahan et al., "A General Approach to Adding
Differential Privacy to Iterative Training Procedures", Section 6: accounting post hoc).

`privacy` reads the ledger, `ledger` writes it to files or checks that it covers every step,
`averaging` evaluates averaged weights (post-processing: no privacy cost).
"""

from tf_dpiter.keras.callbacks.averaging import ExponentialMovingAverage
from tf_dpiter.keras.callbacks.averaging import PolyakAveraging
from tf_dpiter.keras.callbacks.ledger import LedgerCoverage
from tf_dpiter.keras.callbacks.ledger import LedgerExport
from tf_dpiter.keras.callbacks.ledger import LedgerJournal
from tf_dpiter.keras.callbacks.privacy import PrivacyMeter
from tf_dpiter.keras.callbacks.privacy import StopAtPrivacyBudget

__all__ = ["PrivacyMeter", "StopAtPrivacyBudget", "LedgerExport", "LedgerJournal",
           "LedgerCoverage", "ExponentialMovingAverage", "PolyakAveraging"]
