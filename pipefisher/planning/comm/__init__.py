"""Communication planning: every rank's issue order derived from a plan, its replay under NCCL's rule, and its volume."""
