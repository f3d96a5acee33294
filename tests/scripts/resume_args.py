"""The command line both integration scripts take (Trainer and accelerate): one run phase of a
save / resume / skipped-step scenario, stock or with z3guard installed."""
from __future__ import annotations

import argparse
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--phase", choices=["straight", "first", "resume"], required=True)
    parser.add_argument("--guard", action="store_true")
    parser.add_argument("--skip-at", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (Trainer)")
    parser.add_argument("--config-from-launcher", action="store_true",
                        help="the DeepSpeed config comes from the launcher (accelerate launch --config_file)")
    return parser.parse_args()
