#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (CI has none): CUDA staging of logged tensors (PyTorch and the
# native nvcc-built stager), a running checkpoint of a GPU state, the native writer, the GPU health
# checks against the real NVML, and the FusedAdam undo rule against DeepSpeed's real kernel.
# Run from the repository root on a machine with a GPU, torch and pynvml (ds-swift installed, or
# `pip install --no-deps --no-build-isolation -e .`):  bash scripts/gpu_check.sh [OUTDIR]
set -uo pipefail
out=${1:-/tmp/gpu-check}
mkdir -p "$out"
nvidia-smi -L | tee "$out/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' | tee -a "$out/gpu.txt"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TORCH_EXTENSIONS_DIR=/tmp/tx-gpu
# DeepSpeed's kernel sources for the FusedAdam undo test, where deepspeed itself is not installed.
[ -d .dscsrc ] && export DS_SWIFT_DEEPSPEED_CSRC=$PWD/.dscsrc
rc=0
python3 -c 'from ds_swift.cuda_ext import native_writer, native_writer_error as e; m = native_writer(); print("native writer:", "with CUDA" if getattr(m, "with_cuda", False) else "without CUDA", e() or "")' 2>&1 | tee -a "$out/gpu.txt"
python3 scripts/gpu_probe.py 2>&1 | tee "$out/probe.txt" || rc=1
python3 -m pytest -q -s -p no:cacheprovider -rs tests/gpu tests/unit/test_msglog_native.py tests/unit/test_gpu_health.py \
    "tests/unit/test_running_checkpoint.py::test_a_state_on_the_gpu_round_trips" 2>&1 | tee "$out/pytest.txt" || rc=1
exit $rc
