#!/usr/bin/env bash
# Everything GPU-only in one call (for a lent H200): the `gpu` tests, then the
# benchmarks, each bounded in time. Results land in OUT as they finish (at most
# 8 files: gpu_tests.txt, suite.log and <bench>.md / <bench>.json), so a run cut
# short still returns what it measured.
#
#   tools/gpu_suite.sh [OUT] [quick|full]
set -u
out=${1:-gpu_out}
mode=${2:-full}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log="$out/suite.log"
t0=$(date +%s)
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2
    shift 2
    echo "== $name (limit ${secs}s, at +$(( $(date +%s) - t0 ))s)" | tee -a "$log"
    timeout "$secs" "$@" 2>> "$log"
    echo "   $name exit $?" | tee -a "$log"
}
step gpu_tests 150 python3 -m pytest -m gpu -q --continue-on-collection-errors -p no:randomly \
    -o addopts="" tests/ > "$out/gpu_tests.txt"
grep -E "passed|failed" "$out/gpu_tests.txt" | tail -1
grep -E "^(FAILED|ERROR)" "$out/gpu_tests.txt" | head -30
step bench_engine 90 python3 -m tools.bench_engine --budget-s 70 --out "$out/bench_engine.json" > "$out/bench_engine.md"
if [ "$mode" = full ]; then
    step bench_moe_cache 70 python3 -m tools.bench_moe_cache --budget-s 50 --out "$out/bench_moe_cache.json" \
        > "$out/bench_moe_cache.md"
    step bench_kv_tiers 50 python3 -m tools.bench_kv_tiers --out "$out/bench_kv_tiers.json" \
        > "$out/bench_kv_tiers.md"
fi
echo "total $(( $(date +%s) - t0 ))s" | tee -a "$log"
