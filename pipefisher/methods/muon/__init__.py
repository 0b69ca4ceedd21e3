"""Muon (Jordan et al. 2024): momentum orthogonalised by Newton–Schulz every step, for the 2-D
weights of linear layers. The declaration (`pipefisher.methods.muon.method`) is torch-free; the
maths are in `newton_schulz`, the per-matrix state in `engine`, the executor's side in `runtime`."""
