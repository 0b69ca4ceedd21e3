"""The torch-side primitives the executor and every method's runtime share: communication issued
in NCCL's order (`comm`), timing on the device (`clock`) and activation recomputation
(`recompute`). They import nothing above the planning layer (tests/test_layers.py)."""
