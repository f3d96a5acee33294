# Sourced at the top of each one-call script: `. gpu/call.sh "$@"` (first argument: the call's name).
# Sets `call` and `out` (the device tool's $OUT, else /tmp/out), loads DeepSpeed 0.19.8 (gpu/env.sh),
# and defines bit_identity.
set -u
call=${1:-call}
out=${OUT:-/tmp/out}
mkdir -p "$out"
. gpu/env.sh 0.19.8 || exit 1

# bit_identity [label [steady_state.py options ...]]: gpu/steady_state.py's 52-step runs (5 skipped),
# stock vs z3guard, into $out (steady-<call>[-label].log, steady_state-<call>[-label].json).
bit_identity() {
  local name=$call${1:+-$1}
  python3 gpu/steady_state.py --device cuda --steps 0 --out /tmp/steady-$name "${@:2}" > "$out/steady-$name.log" 2>&1
  cp /tmp/steady-$name/steady_state.json "$out/steady_state-$name.json"
  tail -8 "$out/steady-$name.log"
}
