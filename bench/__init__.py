"""Benchmarks: `make bench` runs them all, `make bench BENCH=name` one. Each prints a table and writes
bench/results/<name>.json (a flat object of figure → number; ratios are named x_vs_y)."""
