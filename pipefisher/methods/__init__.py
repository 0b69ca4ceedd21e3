"""Curvature methods: the registry and one folder per method (maths, task rules, runtime ops)."""
