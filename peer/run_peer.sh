#!/usr/bin/env bash
# Peer check: DeepSpeed's own ZeRO-3 unit tests, once on stock DeepSpeed and once with z3guard
# installed in every process (pytest and each forkserver rank), compared test by test.
#
#   peer/run_peer.sh DEEPSPEED_GIT_DIR [IDS_FILE]
#
# DEEPSPEED_GIT_DIR: a DeepSpeed clone or bare mirror that has the v0.19.5 tag.
# IDS_FILE: test ids relative to tests/ (default: ../shared/notes/peer-z3.ids beside this repo).
# Env overrides: PEER_VENV (/tmp/peer-venv), PEER_WORK (/tmp/ds-peer), PEER_OUT (/tmp), CHUNK (70).
# Writes $PEER_OUT/peer-{stock,z3guard}.txt ("OUTCOME id" per line), .log (raw pytest output)
# and peer-compare.txt. Runs everything sequentially (the machine has 2 cores).
set -euo pipefail

DS_GIT=${1:?usage: $0 DEEPSPEED_GIT_DIR [IDS_FILE]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
IDS=$(realpath "${2:-$ROOT/../shared/notes/peer-z3.ids}")
VENV=${PEER_VENV:-/tmp/peer-venv}
WORK=${PEER_WORK:-/tmp/ds-peer}
OUT=${PEER_OUT:-/tmp}
CHUNK=${CHUNK:-70}
PY=$VENV/bin/python

# 1. DeepSpeed's tests at v0.19.5 (no v0.19.8 tag exists) run against the installed 0.19.8.
rm -rf "$WORK" && mkdir -p "$WORK"
for d in tests requirements; do  # tree by tree: a mirror may lack large files elsewhere (blogs/ images)
  git -C "$DS_GIT" archive --prefix=$d/ v0.19.5:$d | tar -x -C "$WORK"
done

# 2. Two helper edits needed on 0.19.8 / CPU (in the extracted copy only).
python3 - "$WORK/tests" <<'EOF'
import pathlib, sys
t = pathlib.Path(sys.argv[1])
def edit(rel, old, new):
    p = t / rel
    s = p.read_text()
    assert s.count(old) == 1, (rel, old)
    p.write_text(s.replace(old, new))
# 0.19.8 removed engine.sparse_tensor_module_names
edit("unit/checkpoint/common.py",
     "assert saved_model.sparse_tensor_module_names == loaded_model.sparse_tensor_module_names",
     "assert getattr(saved_model, 'sparse_tensor_module_names', None) == "
     "getattr(loaded_model, 'sparse_tensor_module_names', None)")
# current_device() is an int on CPU and gloo rejects a 0-d tensor in all_gather_into_tensor
edit("unit/common.py",
     "    device = get_accelerator().current_device()\n"
     "    tensor_flag = torch.tensor(1 if flag else 0, dtype=torch.int, device=device)",
     "    device = get_accelerator().current_device_name()\n"
     "    tensor_flag = torch.tensor([1 if flag else 0], dtype=torch.int, device=device)")
EOF

# 3. The virtual environment (torch CPU, DeepSpeed without prebuilt ops, z3guard editable).
[ -x "$PY" ] || python3 -m venv "$VENV"
if ! DS_ACCELERATOR=cpu "$PY" -c "import deepspeed, pytest_timeout, transformers, accelerate, z3guard" 2>/dev/null; then
  "$VENV/bin/pip" install torch==2.13.0 setuptools wheel
  # transformers + accelerate: test_zero_nesting_init.py / test_zeropp.py import transformers, and
  # HfDeepSpeedConfig requires accelerate. No pytest-forked/xdist/randomly: the listed ids need none.
  DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$VENV/bin/pip" install --no-build-isolation deepspeed==0.19.8 \
    "pytest>=7.2,<8.4" pytest-timeout numpy typer rich transformers==5.24.0 accelerate==1.15.0
  "$VENV/bin/pip" install --no-deps --no-build-isolation -e "$ROOT"
fi
# Start-up hook: the one a wheel install puts in site-packages (an editable install does not); a no-op
# unless Z3GUARD=1, so one venv serves both runs.
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -f "$SITE/z3guard_autoinstall.pth"
cp "$ROOT/src/z3guard.pth" "$SITE/z3guard.pth"
check='import deepspeed, z3guard; print(z3guard._state["installed"])'
[ "$(cd /tmp && DS_ACCELERATOR=cpu Z3GUARD=1 "$PY" -c "$check" 2>/dev/null | tail -1)" = True ] &&
[ "$(cd /tmp && DS_ACCELERATOR=cpu "$PY" -c "$check" 2>/dev/null | tail -1)" = False ] ||
  { echo "z3guard start-up hook not effective in $VENV" >&2; exit 1; }

export DS_ACCELERATOR=cpu LOCAL_SIZE=8 OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR="$WORK/torch-ext"
unset Z3GUARD

# 4. One suite: chunks of $CHUNK ids per pytest call, from tests/ so its pytest.ini applies.
run_suite() {  # label, extra env assignments...
  local label=$1; shift
  local log="$OUT/peer-$label.log" res="$OUT/peer-$label.txt"
  : > "$log"
  rm -f "$WORK"/chunk.*; split -l "$CHUNK" "$IDS" "$WORK/chunk."
  local t0=$SECONDS src0; src0=$(git -C "$ROOT" describe --always --dirty)
  for c in "$WORK"/chunk.*; do
    (cd "$WORK/tests" && env "$@" "$PY" -m pytest --timeout=300 -p no:cacheprovider -rA $(cat "$c")) \
      >> "$log" 2>&1 || true   # failures are recorded below, not fatal
  done
  echo "$label wall_s $((SECONDS - t0)) z3guard_src $src0 .. $(git -C "$ROOT" describe --always --dirty)" \
    > "$OUT/peer-$label.wall"   # z3guard is editable: note the source it ran against
  # Outcome per id from pytest's verbose lines ("ID PASSED [ n%]"); the worst one wins
  # (a teardown ERROR after PASSED counts as ERROR); ids with no line are NOT_RUN.
  "$PY" - "$log" "$IDS" "$res" <<'EOF'
import re, sys, collections
log, ids, res = sys.argv[1:]
rank = {"PASSED": 0, "XFAIL": 0, "SKIPPED": 1, "XPASS": 2, "FAILED": 3, "ERROR": 4}
text = re.sub(r"\x1b\[[0-9;]*m", "", open(log, errors="replace").read())
got = {}
for m in re.finditer(r"(unit/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", text):
    i, o = m.groups()
    if i not in got or rank[o] > rank[got[i]]:
        got[i] = o
wanted = [l.strip() for l in open(ids) if l.strip()]
with open(res, "w") as f:
    for i in wanted:
        f.write(f"{got.get(i, 'NOT_RUN')} {i}\n")
print(res, dict(collections.Counter(got.get(i, "NOT_RUN") for i in wanted)))
EOF
}

run_suite stock
run_suite z3guard Z3GUARD=1

# 5. Test-by-test comparison.
"$PY" - "$OUT/peer-stock.txt" "$OUT/peer-z3guard.txt" > "$OUT/peer-compare.txt" <<'EOF'
import sys
a, b = ({l.split()[1]: l.split()[0] for l in open(p)} for p in sys.argv[1:])
changed = [(i, a[i], b.get(i)) for i in a if a[i] != b.get(i)]
bad = [c for c in changed if c[1] in ("PASSED", "SKIPPED") and c[2] in ("FAILED", "ERROR", "NOT_RUN")]
print(f"ids {len(a)}  changed {len(changed)}  pass/skip->fail/error {len(bad)}")
for i, x, y in changed:
    print(f"{x} -> {y}  {i}")
EOF
cat "$OUT/peer-stock.wall" "$OUT/peer-z3guard.wall" "$OUT/peer-compare.txt"
