"""Cross-cutting neighbouring suites: the privacy claims, run end to end."""
