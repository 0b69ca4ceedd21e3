"""Optimizers: first-order rules (`first_order`: SGD, AdamW, LAMB), the composite of a curvature run
(`composite`: its method's rule and a first-order rule for the rest), learning-rate schedules and
the run file's optimizer section (`settings`). Importing this package does not import torch (the
section is read by the torch-free configuration); the run's optimizer is built from its
configuration in `pipefisher.runtime.training.optimizer`."""
