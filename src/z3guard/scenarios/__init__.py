"""Models and scenarios shared by `z3guard repro`, `verify-resume`, the tests and the benchmarks."""
