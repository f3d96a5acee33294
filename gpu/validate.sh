#!/usr/bin/env bash
# Issue 7 on 2 GPUs: the report's crash and z3guard's fix per DeepSpeed release, a natural overflow,
# and verify-resume with offload. Results (JSON + logs) go to $RESULTS (default /tmp/gpu-validate), and
# a tarball of them plus the summary to $OUT when set (the device tool brings back few files).
set -u
RESULTS=${RESULTS:-/tmp/gpu-validate}; mkdir -p "$RESULTS"
OUT_BACK=${OUT:-}; OUT=$RESULTS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/machine.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' >> "$OUT/machine.txt"
for release in ${RELEASES:-0.19.8 0.14.4 0.9.1}; do
  ( . gpu/env.sh "$release" || exit 1
    start=$(date +%s)
    python3 -m z3guard.cli repro --device cuda --out /tmp/repro-$release --json "$OUT/repro-$release.json" \
      > "$OUT/repro-$release.log" 2>&1
    echo "repro $release exit $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
    if [ "$release" = 0.19.8 ]; then
      python3 -m z3guard.cli repro --device cuda --overflow natural --out /tmp/repro-natural \
        --json "$OUT/repro-natural-$release.json" > "$OUT/repro-natural-$release.log" 2>&1
      echo "repro --overflow natural $release exit $?" | tee -a "$OUT/summary.txt"
      python3 -m z3guard.cli verify-resume --device cuda --out /tmp/verify > "$OUT/verify-resume-$release.log" 2>&1
      echo "verify-resume $release exit $?" | tee -a "$OUT/summary.txt"
    fi )
done
for d in /tmp/repro-* /tmp/verify; do  # the ranks' own logs and results, not the checkpoints
  [ -d "$d" ] && (cd /tmp && find "$(basename "$d")" \( -name '*.log' -o -name '*.json' \) -exec cp --parents {} "$OUT" \;)
done
if [ -n "$OUT_BACK" ]; then
  tar czf "$OUT_BACK/validate.tgz" -C "$RESULTS" . && cp "$RESULTS/summary.txt" "$OUT_BACK/"
fi
