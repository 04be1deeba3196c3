#!/usr/bin/env bash
# GPU smoke test of the SGLang engine (one CUDA GPU; not run in CI).
#
#   deploy/gpu/smoke.sh /models/Qwen3-8B /models/Qwen3-8B-DFlash-b16
#
# Needs: sglang==0.5.23 installed, then this package with --no-deps (docs/sglang.md).
# 1. plain SGLang (no speculation) and dflash-serve --engine sglang (DFLASH_ADAPTIVE)
#    answer the same greedy requests: the outputs must be identical at the draft's
#    block and at blocks 2, 4 and 8 set through /admin/policy (each with its own
#    CUDA graphs: the log says "DFlash block b: verify replays a CUDA graph"),
#    at b = 1 (plain steps, DFLASH_SERVE_PLAIN_STEPS=1: no draft forward) and with
#    b = 1 taking turns with the draft's block (drafting after plain steps needs
#    the context those steps appended);
# 2. dflash-load at concurrency 1, 8, 32 against plain SGLang, dflash-serve with a
#    fixed block (--block-size = the draft's block, no controller) and adaptive
#    (controller on): tokens/s, TTFT, ITL and tau per level.
set -euo pipefail
TARGET=${1:?usage: smoke.sh TARGET_DIR DRAFT_DIR}
DRAFT=${2:?usage: smoke.sh TARGET_DIR DRAFT_DIR}
PLAIN_PORT=${PLAIN_PORT:-8100}
DFLASH_PORT=${DFLASH_PORT:-8200}
OUT=${OUT:-smoke-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT

wait_ready() {  # url
  for _ in $(seq 1 600); do
    curl -sf "$1" >/dev/null && return 0
    sleep 1
  done
  echo "not ready: $1" >&2
  return 1
}

stop_all() {
  kill "${PIDS[@]}" 2>/dev/null || true
  wait "${PIDS[@]}" 2>/dev/null || true
  PIDS=()
}

greedy_outputs() {  # base_url out_file
  python - "$1" "$2" <<'PY'
import json, sys
import openai
from speculative.bench.datasets import humaneval
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
model = client.models.list().data[0].id
outs = []
for p in humaneval(16):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p.text}],
                                       max_tokens=256, temperature=0)
    outs.append(r.choices[0].message.content)
json.dump(outs, open(sys.argv[2], "w"))
PY
}

echo "== plain SGLang"
python -m sglang.launch_server --model-path "$TARGET" --port "$PLAIN_PORT" --enable-metrics \
  > "$OUT/plain.log" 2>&1 &
PIDS+=($!)
wait_ready "http://127.0.0.1:$PLAIN_PORT/health"
greedy_outputs "http://127.0.0.1:$PLAIN_PORT" "$OUT/plain.json"
dflash-load --url "http://127.0.0.1:$PLAIN_PORT" --concurrency 1 8 32 | tee "$OUT/load-plain.txt"
stop_all

for mode in fixed adaptive; do
  echo "== dflash-serve --engine sglang ($mode)"
  if [ "$mode" = fixed ]; then flags=(--controller false); else flags=(--controller true --controller-interval-s 5); fi
  DFLASH_SERVE_PLAIN_STEPS=$([ "$mode" = fixed ] && echo 1 || echo 0) dflash-serve --engine sglang --device cuda --target "$TARGET" --draft "$DRAFT" --port "$DFLASH_PORT" \
    --max-batch-size 32 --admin-key smoke "${flags[@]}" > "$OUT/dflash-$mode.log" 2>&1 &
  PIDS+=($!)
  wait_ready "http://127.0.0.1:$DFLASH_PORT/ready"
  if [ "$mode" = fixed ]; then
    greedy_outputs "http://127.0.0.1:$DFLASH_PORT" "$OUT/dflash.json"
    trained=$(python -c "import sys; from speculative.config import DFlashConfig; print(DFlashConfig.from_file(sys.argv[1]).block_size)" "$DRAFT")
    for policy in b2:'"block_sizes": [2]' b4:'"block_sizes": [4]' b8:'"block_sizes": [8]' b1:'"block_sizes": [1]' \
                  b1-turns:"\"block_sizes\": [1], \"alternates\": [$trained]"; do
      curl -sf -X POST "http://127.0.0.1:$DFLASH_PORT/admin/policy" -H "Authorization: Bearer smoke" \
        -H "Content-Type: application/json" -d "{\"min_batch\": [1], ${policy#*:}}" >/dev/null
      greedy_outputs "http://127.0.0.1:$DFLASH_PORT" "$OUT/dflash-${policy%%:*}.json"
    done
    curl -sf -X POST "http://127.0.0.1:$DFLASH_PORT/admin/policy" -H "Authorization: Bearer smoke" \
      -H "Content-Type: application/json" -d "{\"min_batch\": [1], \"block_sizes\": [$trained]}" >/dev/null
  fi
  dflash-load --url "http://127.0.0.1:$DFLASH_PORT" --concurrency 1 8 32 | tee "$OUT/load-$mode.txt"
  stop_all
done

echo "== CUDA graphs per block (from the worker's log)"
grep -h "DFlash block\|captured DFlash graphs" "$OUT"/dflash-*.log | sort | uniq -c || true

python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
plain = json.load(open(f"{out}/plain.json"))
ok = True
for name in ("dflash", "dflash-b2", "dflash-b4", "dflash-b8", "dflash-b1", "dflash-b1-turns"):
    spec = json.load(open(f"{out}/{name}.json"))
    same = sum(a == b for a, b in zip(plain, spec))
    print(f"{name}: greedy outputs identical to plain SGLang: {same}/{len(plain)}")
    ok = ok and same == len(plain)
sys.exit(0 if ok else 1)
PY
