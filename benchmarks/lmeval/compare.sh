#!/usr/bin/env bash
# lm-eval's local-completions through `thunder-batch serve` against lm-eval's hf model on the same fp32
# weights, on the mc40 task (benchmarks/lmeval/mc40.yaml). Run from the repository root:
#   LMEVAL=/path/to/venv-with-lm-eval/bin/lm_eval bash benchmarks/lmeval/compare.sh
set -euo pipefail
PY=${PY:-python}
LMEVAL=${LMEVAL:-lm_eval}
PORT=${PORT:-8765}
OUT=${OUT:-/tmp/mc40}
CKPT=$($PY -c "from thunder_batch.checkpoints import default_checkpoint_dir; print(default_checkpoint_dir())")
mkdir -p "$OUT"
[ -f "$OUT/hf/config.json" ] || $PY benchmarks/lmeval/export_hf.py "$CKPT" "$OUT/hf"
$PY -m thunder_batch.cli serve --checkpoint_dir "$CKPT" --compile eager --batch_size 8 --max_seq_length 256 \
  --port "$PORT" --log_level warning > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER; wait $SERVER' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
$LMEVAL --model local-completions --include_path benchmarks/lmeval --tasks mc40 \
  --model_args "model=SmolLM2-135M-Instruct,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$OUT/hf,tokenized_requests=False,num_concurrent=8,max_retries=1" \
  --output_path "$OUT/server" --log_samples 2>&1 | tee "$OUT/server.txt" | grep -E "^\|"
$LMEVAL --model hf --include_path benchmarks/lmeval --tasks mc40 --device cpu \
  --model_args "pretrained=$OUT/hf,dtype=float32" --output_path "$OUT/hf-run" --log_samples 2>&1 | tee "$OUT/hf.txt" | grep -E "^\|"
$PY benchmarks/lmeval/compare_samples.py "$OUT/server" "$OUT/hf-run"
