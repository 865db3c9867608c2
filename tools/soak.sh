#!/usr/bin/env bash
# Agentic soak: start ftserve at a real MoE shape (dummy weights) on this
# machine's GPU, wait for it, then run tools.loadgen --soak against it.
#
#   tools/soak.sh OUT_DIR DURATION_S [extra loadgen flags...]
#
# Environment: SOAK_PRESET (qwen3-30b-a3b), SOAK_LAYERS (8), SOAK_MAX_LEN
# (131072), SOAK_SESSIONS (8), SOAK_CONTEXT (100000), SOAK_PORT (8321).
# Everything talks to 127.0.0.1 only and stops by itself after DURATION_S.
set -euo pipefail
out=${1:?usage: tools/soak.sh OUT_DIR DURATION_S [loadgen flags]}
duration=${2:?usage: tools/soak.sh OUT_DIR DURATION_S [loadgen flags]}
shift 2
preset=${SOAK_PRESET:-qwen3-30b-a3b}
layers=${SOAK_LAYERS:-8}
max_len=${SOAK_MAX_LEN:-131072}
port=${SOAK_PORT:-8321}
mkdir -p "$out"
model_dir=$(mktemp -d)
python3 - "$preset" "$model_dir" "$layers" "$max_len" <<'PY'
import sys
from ftserve.models.checkpoint import write_checkpoint
preset, out, layers, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
write_checkpoint(preset, out, layers=layers, config_only=True,
                 overrides={"max_position_embeddings": max_len})
PY
python3 -m ftserve serve --model "$model_dir" --load-format dummy --port "$port" \
    --served-model-name soak > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1; then break; fi
    if ! kill -0 $server 2>/dev/null; then echo "server died"; tail -30 "$out/server.log"; exit 1; fi
    sleep 1
done
set +e
python3 -m tools.loadgen --url "http://127.0.0.1:$port" --profile agentic \
    --sessions "${SOAK_SESSIONS:-8}" --max-context "${SOAK_CONTEXT:-100000}" \
    --duration "$duration" --soak --server-pid "$server" --no-progress --out "$out" "$@" \
    > "$out/loadgen.txt" 2>&1
rc=$?
set -e
kill -TERM $server 2>/dev/null || true
wait $server 2>/dev/null || true
echo "loadgen exit code $rc" | tee -a "$out/loadgen.txt"
exit $rc
