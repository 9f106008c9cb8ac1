#!/usr/bin/env bash
# Fill .gpu-deps/ (git-ignored) with what scripts/gpu_check.sh needs on a GPU machine that has torch
# but no DeepSpeed, no pydantic and no network (shared/NOTES-gpu.md): DeepSpeed's installed package
# folder, copied from this venv, and manylinux wheels of the pure dependencies for the GPU machine's
# Python, downloaded from PyPI at the versions this venv has. Run it here (with network) before a
# device session, then carry .gpu-deps with the device tool:
#   bash scripts/gpu_deps.sh [PYTHON_VERSION]      # default 3.12, the GPU machine's Python
# and on the GPU machine: bash scripts/gpu_check.sh (it installs the wheels into .gpu-deps/site).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-3.12}
dest=.gpu-deps
# find_spec, not import: importing DeepSpeed prints its accelerator warning on stdout.
ds=$(python3 -c 'import importlib.util as u, os; s = u.find_spec("deepspeed"); print(os.path.dirname(s.origin) if s else "")')
[ -n "$ds" ] || { echo "gpu_deps: run inside the project's venv (DeepSpeed not found)" >&2; exit 2; }
mkdir -p "$dest/wheels"
rm -rf "$dest/deepspeed" "$dest/site"
# DeepSpeed is pure Python (its ops build on the GPU machine); without __pycache__ it is ~11 MB.
cp -r "$ds" "$dest/deepspeed"
find "$dest/deepspeed" -name __pycache__ -prune -exec rm -rf {} +
# The exact versions this venv runs (pydantic pins its pydantic-core).
pins=()
for p in pydantic pydantic-core annotated-types typing-inspection hjson crc32c zfec megatron-core py-cpuinfo msgpack einops; do
    v=$(python3 -c "import importlib.metadata as m; print(m.version('$p'))" 2>/dev/null) || { echo "gpu_deps: $p is not installed here" >&2; exit 2; }
    pins+=("$p==$v")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d "$dest/wheels" "${pins[@]}"
du -sh "$dest"
ls "$dest/wheels"
