"""The parts of the planner benchmark, ``benchmarks/bench_planner.py``."""
