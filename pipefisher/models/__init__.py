"""Models split into pipeline stages."""
