"""Diagonal GGN ("E-KFAC-lite"): pipefisher's example of a method written outside the package."""
