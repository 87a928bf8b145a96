"""Benchmarks: figures printed and written as JSON, recorded in docs/benchmarks.md."""
