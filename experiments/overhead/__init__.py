"""The parts of `experiments/bench_overhead.py`: the workloads and their run settings
(`workloads`), the one-stage arms (`one_stage`), the two-stage arms (`two_stage`), model FLOPs
and peak rates (`flops`), and the tables (`report`)."""
