#!/usr/bin/env bash
# One device call on nvidia-h200-x2: the save/load contract (tests/scripts/engine_contract.py) on 2 GPUs
# with NCCL, and `verify-resume --device cuda`, which now compares the CUDA RNG stream too (z3guard saves
# this rank's device's generator only, since the contract change).
#   bash gpu/contract.sh <call-name>
. gpu/call.sh "$@"
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
from z3guard.scenarios.launch import run_ranks
out = Path(sys.argv[1])
done = run_ranks(["tests/scripts/engine_contract.py", "/tmp/contract"], Path("/tmp/contract"), device="cuda",
                 timeout=240)
(out / "contract-launch.log").write_text(done.log[-20000:])
for r in (0, 1):
    p = Path(f"/tmp/contract/contract.rank{r}.json")
    if p.exists():
        (out / p.name).write_text(p.read_text())
print("contract exit", done.returncode)
PY
python3 -m z3guard.cli verify-resume --device cuda --out /tmp/verify > "$out/verify-resume-$call.log" 2>&1
echo "verify-resume exit $?"
tail -16 "$out/verify-resume-$call.log"
