"""Bytes a pipelined run holds per rank: training state, activations over the schedule, curvature
captures and a refresh cycle's working set, and their peak. Pure Python: no torch."""
