"""Parallel layouts over a stage's replicas: ZeRO-1 shards and KAISA's gradient workers."""
