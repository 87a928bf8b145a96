"""One-off analyses behind figures in docs/ (run by path, e.g. ``python benchmarks/experiments/widening.py``);
nothing in the benchmarks' entry points imports them."""
