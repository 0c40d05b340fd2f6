"""DP Keras models: `DPSequential`, `DPModel`, `make_private`, the DP train step and the
sampling `fit` performs (McMahan et al., "A General Approach to Adding Differential Privacy to
Iterative Training Procedures", Section 7; Abadi et al., "Deep Learning with Differential
Privacy", Section 3.1).
"""
