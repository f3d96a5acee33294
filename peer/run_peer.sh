#!/usr/bin/env bash
# Peer check: DeepSpeed's own ZeRO-3 unit tests, once on stock DeepSpeed and once with z3guard active in
# every process (pytest and each rank DeepSpeed's test harness starts), compared test by test.
# See docs/peer-check.md.
#
#   peer/run_peer.sh [--list] [--out DIR] [--ids FILE] [--ref TAG] [DEEPSPEED_SOURCE]
#
#   --list            only fetch DeepSpeed's tests, apply the helper edits and print how many of the ids
#                     are found in them (a download and a grep; no virtual environment, no test run).
#   --out DIR         everything the script writes goes here (default: peer-out/ in the repository root).
#   --ids FILE        test ids, relative to DeepSpeed's tests/ folder (default: peer/zero3.ids).
#   --ref TAG         the DeepSpeed git tag whose tests are used (default: v$DS_VERSION).
#   DEEPSPEED_SOURCE  optional, instead of downloading: a DeepSpeed git clone or bare mirror (its tests/
#                     at --ref are used), a DeepSpeed source tree (its tests/ folder is used as it is), or a
#                     source archive (.tar.gz) of DeepSpeed.
#
# Without DEEPSPEED_SOURCE the tests come from the package index if the DeepSpeed sdist contains them
# (`pip download --no-deps --no-binary :all: deepspeed==$DS_VERSION`); DeepSpeed's sdist has no tests/
# folder (0.19.8 has none), and then they come from GitHub's source archive of the tag:
#   https://github.com/deepspeedai/DeepSpeed/archive/refs/tags/$REF.tar.gz
#
# Environment: DS_VERSION (0.19.8), PEER_PYTHON (python3: creates the venv and runs pip download),
# PEER_TORCH_INDEX (pip --index-url for torch, e.g. https://download.pytorch.org/whl/cpu for the CPU
# build), CHUNK (70 ids per pytest process), PEER_OUT, PEER_IDS, DS_TESTS_REF (as the options).
#
# Writes, under the output folder:
#   venv/                   the virtual environment (torch, DeepSpeed built without ops, the z3guard wheel)
#   wheel/                  the z3guard wheel built from this repository and installed in venv/
#   downloads/              the sdist / source archive the tests came from
#   deepspeed-tests/tests/  DeepSpeed's tests with the helper edits applied; tests-source.txt says where from
#   stock.txt z3guard.txt   one "OUTCOME id" line per id
#   stock.log z3guard.log   raw pytest output;  stock.wall z3guard.wall: wall time and z3guard build
#   compare.txt             the ids whose outcome changed between the two runs
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
usage() { sed -n '6,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit "${1:-2}"; }

LIST=0
OUT=${PEER_OUT:-$ROOT/peer-out}
IDS=${PEER_IDS:-$ROOT/peer/zero3.ids}
DS_VERSION=${DS_VERSION:-0.19.8}
REF=${DS_TESTS_REF:-v$DS_VERSION}
SRC=
while [ $# -gt 0 ]; do
  case $1 in
    --list) LIST=1 ;;
    --out) OUT=${2:?--out needs a folder}; shift ;;
    --ids) IDS=${2:?--ids needs a file}; shift ;;
    --ref) REF=${2:?--ref needs a tag}; shift ;;
    -h|--help) usage 0 ;;
    -*) echo "unknown option $1" >&2; usage ;;
    *) [ -z "$SRC" ] || usage; SRC=$1 ;;
  esac
  shift
done
CHUNK=${CHUNK:-70}
PYTHON=${PEER_PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
IDS=$(realpath "$IDS")
[ -z "$SRC" ] || SRC=$(realpath "$SRC")
VENV=$OUT/venv
PY=$VENV/bin/python
WORK=$OUT/deepspeed-tests
DL=$OUT/downloads
TESTS_URL=https://github.com/deepspeedai/DeepSpeed/archive/refs/tags/$REF.tar.gz

say() { echo "run_peer: $*" >&2; }
die() { say "$*"; exit 1; }

# The top folder of an archive listing whose tests/unit/ is there, or nothing.
top_with_tests() { sed -n 's#^\./##; s#^\([^/]*\)/tests/unit/.*#\1#p;' "$1" | sed -n 1p; }

extract_tests() {  # archive, where it came from
  local arc=$1 what=$2 top
  tar -tzf "$arc" > "$arc.list"
  top=$(top_with_tests "$arc.list")
  [ -n "$top" ] || return 1
  tar -xzf "$arc" -C "$WORK" --strip-components=1 "$top/tests"
  echo "$what" > "$WORK/tests-source.txt"
}

# 1. DeepSpeed's tests, into $WORK/tests.
rm -rf "$WORK" && mkdir -p "$WORK" "$DL"
if [ -n "$SRC" ]; then
  if [ -f "$SRC" ]; then
    extract_tests "$SRC" "archive $SRC" || die "$SRC has no tests/unit/ folder"
  elif git -C "$SRC" rev-parse --git-dir > /dev/null 2>&1; then
    git -C "$SRC" rev-parse -q --verify "$REF^{commit}" > /dev/null ||
      die "$SRC has no $REF; name another tag with --ref (e.g. --ref v0.19.5)"
    # the tests/ tree only: a partial mirror may lack large files elsewhere
    git -C "$SRC" archive --prefix=tests/ "$REF:tests" | tar -x -C "$WORK"
    echo "git $SRC at $REF ($(git -C "$SRC" rev-parse --short=8 "$REF^{commit}"))" > "$WORK/tests-source.txt"
  elif [ -d "$SRC/tests/unit" ]; then
    cp -R "$SRC/tests" "$WORK/tests"
    echo "source tree $SRC" > "$WORK/tests-source.txt"
  else
    die "$SRC is neither a DeepSpeed archive, a git repository nor a source tree with tests/unit/"
  fi
else
  sdist_dir=$(mktemp -d "$DL/sdist.XXXXXX")
  say "downloading the deepspeed==$DS_VERSION sdist from the package index"
  DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PYTHON" -m pip download -q --no-deps --no-binary :all: \
    "deepspeed==$DS_VERSION" -d "$sdist_dir" > "$sdist_dir.log" 2>&1 ||
    { cat "$sdist_dir.log" >&2; die "pip download of the deepspeed==$DS_VERSION sdist failed"; }
  sdist=$(ls "$sdist_dir"/deepspeed-*.tar.gz)
  mv "$sdist" "$DL/" && rm -r "$sdist_dir" "$sdist_dir.log" && sdist=$DL/$(basename "$sdist")
  if extract_tests "$sdist" "sdist $(basename "$sdist") from the package index"; then
    say "using the tests in $(basename "$sdist")"
  else
    say "$(basename "$sdist") has no tests/ folder; fetching $TESTS_URL"
    arc=$DL/DeepSpeed-$REF.tar.gz
    if [ ! -s "$arc" ]; then
      curl -fsSL --retry 3 -o "$arc.part" "$TESTS_URL" ||
        die "could not download $TESTS_URL (no such tag? then name one with --ref, or pass a local checkout)"
      mv "$arc.part" "$arc"
    fi
    extract_tests "$arc" "GitHub source archive $TESTS_URL" || die "$arc has no tests/unit/ folder"
  fi
fi
say "DeepSpeed tests from: $(cat "$WORK/tests-source.txt")"

# 2. Two helper edits to that copy, each applied only where its pattern is found.
"$PYTHON" - "$WORK/tests" <<'EOF'
import pathlib, sys
t = pathlib.Path(sys.argv[1])
def edit(rel, why, old, new):
    p = t / rel
    s = p.read_text() if p.is_file() else ""
    n = s.count(old)
    if n == 1:
        p.write_text(s.replace(old, new))
        print(f"run_peer: helper edit applied to {rel}: {why}", file=sys.stderr)
    elif new in s:
        print(f"run_peer: helper edit already in place in {rel}: {why}", file=sys.stderr)
    else:
        state = "is missing" if not p.is_file() else f"has the pattern {n} times" if n else "lacks the pattern"
        print(f"run_peer: helper edit NOT applied to {rel} ({state}): {why}", file=sys.stderr)
edit("unit/checkpoint/common.py",
     "DeepSpeed 0.19.8 removed engine.sparse_tensor_module_names; compare it with getattr(..., None)",
     "assert saved_model.sparse_tensor_module_names == loaded_model.sparse_tensor_module_names",
     "assert getattr(saved_model, 'sparse_tensor_module_names', None) == "
     "getattr(loaded_model, 'sparse_tensor_module_names', None)")
edit("unit/common.py",
     "on CPU current_device() is an int and gloo rejects a 0-d tensor in all_gather_into_tensor; "
     "use current_device_name() and a 1-element tensor",
     "    device = get_accelerator().current_device()\n"
     "    tensor_flag = torch.tensor(1 if flag else 0, dtype=torch.int, device=device)",
     "    device = get_accelerator().current_device_name()\n"
     "    tensor_flag = torch.tensor([1 if flag else 0], dtype=torch.int, device=device)")
EOF

if [ "$LIST" = 1 ]; then
  # An id is found when its file exists and defines its class (if any) and its test function.
  "$PYTHON" - "$WORK/tests" "$IDS" <<'EOF'
import pathlib, re, sys
tests, ids = pathlib.Path(sys.argv[1]), sys.argv[2]
wanted = [l.strip() for l in open(ids) if l.strip() and not l.startswith("#")]
missing = []
for i in wanted:
    path, *names = i.split("::")
    f = tests / path
    src = f.read_text() if f.is_file() else None
    names = [re.sub(r"\[.*\]$", "", n) for n in names]
    pats = [rf"^\s*class {re.escape(n)}\b" for n in names[:-1]] + [rf"^\s*(async\s+)?def {re.escape(names[-1])}\b"]
    if src is None or not all(re.search(p, src, re.M) for p in pats):
        missing.append(i)
print(f"{len(wanted) - len(missing)} of {len(wanted)} ids found in the fetched tests")
for i in missing:
    print(f"  not found: {i}")
EOF
  exit 0
fi

# 3. The virtual environment: torch, DeepSpeed built without ops, the test requirements, and z3guard
#    as users get it: a wheel built from this repository (it puts the start-up hook z3guard.pth into
#    site-packages; the hook is a no-op unless Z3GUARD=1, so one venv serves both runs).
[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
ready='import deepspeed, pytest_timeout, transformers, accelerate, sys; sys.exit(deepspeed.__version__ != sys.argv[1])'
if ! DS_ACCELERATOR=cpu "$PY" -c "$ready" "$DS_VERSION" > /dev/null 2>&1; then
  "$PY" -m pip install torch==2.13.0 ${PEER_TORCH_INDEX:+--index-url "$PEER_TORCH_INDEX"}
  "$PY" -m pip install setuptools wheel
  # transformers + accelerate: test_zero_nesting_init.py / test_zeropp.py import transformers, and
  # HfDeepSpeedConfig requires accelerate. No pytest-forked/xdist/randomly: the listed ids need none.
  DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PY" -m pip install --no-build-isolation "deepspeed==$DS_VERSION" \
    "pytest>=7.2,<8.4" pytest-timeout numpy typer rich threadpoolctl transformers==5.24.0 accelerate==1.15.0
fi
rm -rf "$OUT/wheel"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT/wheel" "$ROOT"
WHEEL=$(ls "$OUT"/wheel/z3guard-*.whl)
"$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL"
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
[ -f "$SITE/z3guard.pth" ] || die "the wheel did not put z3guard.pth into $SITE"
check='import deepspeed, z3guard; print(z3guard._state["installed"], z3guard.__file__)'
on=$(cd "$OUT" && DS_ACCELERATOR=cpu Z3GUARD=1 "$PY" -c "$check" 2>/dev/null | tail -1)
off=$(cd "$OUT" && env -u Z3GUARD DS_ACCELERATOR=cpu "$PY" -c "$check" 2>/dev/null | tail -1)
case "$on|$off" in
  "True $SITE/"*"|False $SITE/"*) say "start-up hook checked: z3guard active with Z3GUARD=1 only" ;;
  *) die "z3guard start-up hook not effective in $VENV (Z3GUARD=1: '$on'; unset: '$off')" ;;
esac
BUILD="$(basename "$WHEEL") sha256 $(sha256sum "$WHEEL" | cut -c1-12) from $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo '?')"

export DS_ACCELERATOR=cpu LOCAL_SIZE=8 OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR="$OUT/torch-ext"
unset Z3GUARD

# 4. One suite: chunks of $CHUNK ids per pytest process, from tests/ so DeepSpeed's pytest.ini applies.
run_suite() {  # label, extra env assignments...
  local label=$1; shift
  local log="$OUT/$label.log" res="$OUT/$label.txt" c t0=$SECONDS
  local -a chunk
  : > "$log"
  rm -rf "$OUT/chunks" && mkdir "$OUT/chunks"
  grep -v -e '^[[:space:]]*$' -e '^#' "$IDS" | split -l "$CHUNK" - "$OUT/chunks/chunk."
  for c in "$OUT"/chunks/chunk.*; do
    mapfile -t chunk < "$c"
    (cd "$WORK/tests" && env "$@" "$PY" -m pytest --timeout=300 -p no:cacheprovider -rA "${chunk[@]}") \
      >> "$log" 2>&1 || true   # failures are recorded below, not fatal
  done
  echo "$label wall_s $((SECONDS - t0)) z3guard $BUILD; tests: $(cat "$WORK/tests-source.txt")" > "$OUT/$label.wall"
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
wanted = [l.strip() for l in open(ids) if l.strip() and not l.startswith("#")]
with open(res, "w") as f:
    for i in wanted:
        f.write(f"{got.get(i, 'NOT_RUN')} {i}\n")
print(res, dict(collections.Counter(got.get(i, "NOT_RUN") for i in wanted)))
EOF
}

run_suite stock
run_suite z3guard Z3GUARD=1

# 5. Test-by-test comparison.
"$PY" - "$OUT/stock.txt" "$OUT/z3guard.txt" > "$OUT/compare.txt" <<'EOF'
import sys
a, b = ({l.split()[1]: l.split()[0] for l in open(p)} for p in sys.argv[1:])
changed = [(i, a[i], b.get(i)) for i in a if a[i] != b.get(i)]
bad = [c for c in changed if c[1] in ("PASSED", "SKIPPED") and c[2] in ("FAILED", "ERROR", "NOT_RUN")]
print(f"ids {len(a)}  changed {len(changed)}  pass/skip->fail/error {len(bad)}")
for i, x, y in changed:
    print(f"{x} -> {y}  {i}")
EOF
cat "$OUT/stock.wall" "$OUT/z3guard.wall" "$OUT/compare.txt"
