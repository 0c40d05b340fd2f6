"""The Keras internals the other tf_dpiter.keras sub-packages share (the lowest of them).

`keras_internals` wraps the private Keras and TensorFlow APIs the library relies on (one place
to adapt to a new version); `batch_independence` probes whether a model mixes the records of
a batch; `per_example` holds which layers act per example (declared or known); `runtime`
says where a step runs (oneDNN, XLA) and the float16 loss scale. They import nothing from the
other sub-packages (`layers`, `fast_clipping`, `optimizer`, `callbacks`, `model`), which
all build on them; `tf_dpiter.keras` (the package root) registers the per-example classes the
upper sub-packages define (`per_example.add_class_source`).
"""
