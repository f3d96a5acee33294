"""Test shim for DeepSpeed 0.10-0.13 on CPU: their CPU accelerator imports Intel's oneCCL bindings at start,
though the tests' ranks talk over gloo (`init_distributed(dist_backend="gloo")`). Only on the tests'
PYTHONPATH for those releases (tests/releases.py); never installed."""
