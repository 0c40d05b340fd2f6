"""Draw and Discard machine learning (Pihur, Korolova et al., "Differentially-Private Draw
and Discard Machine Learning"): Algorithm 1 clients (`client`, noise `calibration`), the
Section IV analyses (`privacy`), the Algorithm 2 simulation (`server`, `simulate`), and the
asynchronous HTTP service on an in-memory or Redis store (`service`; console script
`tf-dpiter-ddml` = `cli.main`) with its client library (`client_lib`). Threat model, bounds
and residual risk: docs/draw_discard_security.md.
"""

from tf_dpiter.draw_discard.acceptance import AcceptanceRule
from tf_dpiter.draw_discard.glm import FAMILIES, Feature, ModelSpec
from tf_dpiter.draw_discard.client import (
    client_update, clipped_gradient, make_tf_client_update, spec_update)
from tf_dpiter.draw_discard.server import (
    STRATEGIES, DrawDiscardServer, SpamFilter, initial_instances)
from tf_dpiter.draw_discard.privacy import (
    PrivacyStatement, discard_probability, discard_probability_chain, epsilon_adversary_one,
    epsilon_adversary_one_composed, epsilon_adversary_three, epsilon_adversary_three_accounted,
    epsilon_adversary_two, expected_epsilon_adversary_three, gaussian_sigma, init_variance,
    laplace_scale, laplace_variance, noise_std, print_privacy_statement, privacy_statement)
from tf_dpiter.draw_discard.simulate import (
    assign_clients, make_server, survival_share, train, variance_trajectory)

__all__ = [
    "AcceptanceRule",
    "FAMILIES", "Feature", "ModelSpec",
    "client_update", "clipped_gradient", "make_tf_client_update", "spec_update",
    "STRATEGIES", "DrawDiscardServer", "SpamFilter", "initial_instances",
    "PrivacyStatement", "discard_probability", "discard_probability_chain",
    "epsilon_adversary_one", "epsilon_adversary_one_composed", "epsilon_adversary_three",
    "epsilon_adversary_three_accounted", "epsilon_adversary_two",
    "expected_epsilon_adversary_three", "gaussian_sigma", "init_variance", "laplace_scale",
    "laplace_variance", "noise_std", "print_privacy_statement", "privacy_statement",
    "assign_clients", "make_server", "survival_share", "train", "variance_trajectory",
]
