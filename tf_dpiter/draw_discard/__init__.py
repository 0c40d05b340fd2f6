"""Draw and Discard machine learning (Pihur et al., seed 004).

k-instance server (Algorithm 2), local-DP GLM clients (Algorithm 1), spam filter
(Section III-D4), privacy analyses against adversaries I-III (Section IV), and an
asynchronous HTTP service on an in-memory or Redis store (`service`, `client_lib`).
"""

from tf_dpiter.draw_discard.glm import Feature, ModelSpec, FAMILIES
from tf_dpiter.draw_discard.client import client_update, clipped_gradient, spec_update, make_tf_client_update
from tf_dpiter.draw_discard.server import DrawDiscardServer, SpamFilter, STRATEGIES, initial_instances
from tf_dpiter.draw_discard.privacy import (
    PrivacyStatement, privacy_statement, print_privacy_statement, laplace_scale, laplace_variance,
    gaussian_sigma, noise_std, init_variance, epsilon_adversary_one, epsilon_adversary_one_composed,
    epsilon_adversary_two, epsilon_adversary_three, expected_epsilon_adversary_three,
    discard_probability, discard_probability_chain)
from tf_dpiter.draw_discard.simulate import train, make_server, assign_clients, variance_trajectory, survival_share
