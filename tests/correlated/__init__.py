"""Tests of the correlated-noise mechanisms across dp_query, ledger, accounting and keras."""
