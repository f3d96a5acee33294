#!/usr/bin/env bash
# Ran at ecd7ea8 (b20); the staged fetch was removed after b23, so `fast_staged_fetch` is no longer an
# option: check out that commit to re-run.
# Issue 8, one device call on nvidia-h200-x2: b19's GPU bit-identity failed (first differences at
# step 10 / 21) with the staged fetch and the post-b18 review fixes both new on a GPU. Which one:
# each pair again with the staged fetch off, both offloads with it on once more, and stock against stock.
#   bash gpu/bisect.sh <call-name>
. gpu/call.sh "$@"
one() {  # <label> <steady_state.py options...>
  bit_identity "$@" > /dev/null
  python3 -c "import json,sys; [print('$1', r['run'], r.get('fast_paths'), r.get('first_difference'), r.get('error', '')[-300:]) for r in json.load(open(sys.argv[1]))['bit_identity']]" "$out/steady_state-$call-$1.json"
}
one po-nostaged --only DeepSpeedCPUAdam --options '{"fast_staged_fetch": false}'
one p-nostaged --only offload_param --options '{"fast_staged_fetch": false}'
one po-staged --only DeepSpeedCPUAdam
one po-control --only DeepSpeedCPUAdam --control
