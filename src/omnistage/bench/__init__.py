"""Benchmarks: the read-aloud load generator, its metrics and report, and the transformers peer."""
