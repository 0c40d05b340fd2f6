"""The DP optimizer: the Keras face (`optimizers`) and the private step it holds (the query,
the clipping, the noise mechanism and the ledger write; McMahan et al., "A General Approach to
Adding Differential Privacy to Iterative Training Procedures", Section 7).
"""
