#!/usr/bin/env bash
# Everything GPU-only in one call (for a lent H200): the `gpu` tests, then the
# benchmarks, each bounded in time, results under OUT (default ./gpu_out).
#
#   tools/gpu_suite.sh [OUT] [quick]
#
# Each benchmark writes OUT/<name>.json and a markdown section OUT/<name>.md.
set -u
out=${1:-gpu_out}
mode=${2:-full}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2
    shift 2
    echo "== $name (limit ${secs}s, at +$(( $(date +%s) - t0 ))s)"
    timeout "$secs" "$@" > "$out/$name.md" 2> "$out/$name.err"
    echo "   exit $?; $(tail -1 "$out/$name.err")"
}
step gpu_tests 200 python3 -m pytest -m gpu -q --continue-on-collection-errors -p no:randomly tests/
grep -E "passed|failed" "$out/gpu_tests.md" | tail -1
grep -E "^(FAILED|ERROR)" "$out/gpu_tests.md" | head -20
step bench_engine 120 python3 -m tools.bench_engine --out "$out/bench_engine.json"
if [ "$mode" = full ]; then
    step bench_moe_cache 90 python3 -m tools.bench_moe_cache --out "$out/bench_moe_cache.json"
    step bench_kv_tiers 70 python3 -m tools.bench_kv_tiers --out "$out/bench_kv_tiers.json"
    step bench_kernels 60 python3 tools/bench_kernels.py --quick --out "$out/bench_kernels.json"
fi
echo "total $(( $(date +%s) - t0 ))s"
