#!/usr/bin/env bash
# One call on the GPU machine: install selector there (no network: wheels carried in .carry/wheels/), then
#   part1: doctor, the whole test suite on CUDA, the bench grid;   part2: generate(), quantised and hub cells.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/gpu_session.sh part1|part2
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/selector-out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
if ls .carry/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/wheels/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$LOG" 2>&1 || echo "install failed" | tee -a "$LOG"
stamp() { echo "== $(date +%T) $*" | tee -a "$LOG"; }

case "${1:-part1}" in
part1)
  stamp doctor
  (time python3 -m selector.cli doctor) 2>&1 | tee -a "$LOG"
  python3 -m selector.cli doctor --json > "$OUT/doctor.json"
  stamp tests
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -40 | tee -a "$LOG"
  stamp bench
  timeout 330 python3 -m selector.cli bench --out "$OUT/bench" --graph-max-tokens 512 2>>"$LOG" | tee -a "$LOG"
  cp "$OUT/bench/bench.json" "$OUT/bench/bench.md" "$OUT/" 2>/dev/null
  cp "$OUT/bench/bench.png" "$OUT/" 2>/dev/null; cp "$OUT/bench/tuning.json" "$OUT/" 2>/dev/null
  rm -rf "$OUT/bench"
  ;;
part2)
  for script in hf_generate quant_gpu sonicmoe_gpu; do
    if [ -f "benchmarks/$script.py" ]; then
      stamp "$script"
      timeout 200 python3 "benchmarks/$script.py" --out "$OUT/$script" 2>&1 | tail -40 | tee -a "$LOG"
      for f in "$OUT/$script"/*.json; do [ -f "$f" ] && cp "$f" "$OUT/${script}_$(basename "$f")"; done
      rm -rf "$OUT/$script"
    fi
  done
  ;;
esac
stamp done
