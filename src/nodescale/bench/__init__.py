"""Benchmarks: collective bandwidth (comm) and training scaling."""
