"""Draw and Discard machine learning (Pihur, Korolova et al., "Differentially-Private Draw
and Discard Machine Learning").

Modules by concern: `glm` (model specs) and `glm_math` (GLM mean, gradient, loss);
`calibration` (noise of Algorithm 1) and `privacy` (the Section IV analyses against
adversaries I-III); `client` (Algorithm 1, local-DP GLM clients) and `server`/`simulate`
(Algorithm 2, k instances; the paper's spam filter of Section III-D4, simulation only: it
can be gamed). The asynchronous HTTP service on an in-memory or Redis store (`store`,
`redis_store`; console script `tf-dpiter-ddml` = `cli.main`): `service` (draw and submit),
`service_status` (spec, counters, health), `snapshots` (oblivious reads), `http_io`
(weight encodings, bounded body reads), `parsing`, `admission`, `acceptance` (the
bounded-influence rule), `tickets` (every submit names the instance it was drawn from),
`influence` (the decaying per-token budget: the poisoning bound), `auth` (bearer tokens,
quotas), `web_errors`, `http_server` (TLS), `connections` (connection accounting),
`metrics` (Prometheus), `model_release` (what /v1/model reveals), `service_setup`
(initialization and join), `keys` (the secret outside the store), `store_mac` (slot
integrity tags), `redis_scripts`, `anchor` (rollback across restarts); the client library:
`client_lib`, `client_floor` (privacy floor), `client_wire` (wire format). Threat model,
bounds and residual risk: docs/draw_discard_security.md.
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
