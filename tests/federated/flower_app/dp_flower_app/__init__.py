"""A minimal Flower App running tf_dpiter's DP federated averaging (tests only)."""
