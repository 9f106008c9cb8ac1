#!/usr/bin/env bash
# The multi-rank NCCL checks (issue 49) for a machine with 2 GPUs or more: what the CPU stand-in for
# NCCL's semantics (ds_swift/testing/nccl_standin.py) assumes, checked on real NCCL, with strict
# transport on. tests/gpu/test_nccl_multi_gpu.py:
#   1 GPU:   ds-swift's NCCL settings in effect on an eager non-blocking world; an abort from another
#            thread reaching a communicator still waiting for a peer (also run by gpu_check.sh);
#   2 GPUs:  a reduce whose peer died returns to the host, the abort releases it, the step is refused;
#   4 GPUs:  the tiny GPT (pp 2 x dp 2, bf16 + ZeRO-1) through ds-swift-launch: a machine killed in the
#            gradient reduce, and a replacement killed while generation 1 creates its communicators,
#            each bitwise equal to the failure-free run.
# Usage (repository root, torch with CUDA, DeepSpeed; .gpu-deps as for gpu_check.sh):
#   bash scripts/gpu_multi_check.sh [OUTDIR]      run them (about 10 minutes with 4 GPUs)
#   bash scripts/gpu_multi_check.sh --dry-run     print what would run and check its files exist
set -uo pipefail
export PYTHONUNBUFFERED=1
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out=${1:-/tmp/gpu-multi-check}
files=(tests/gpu/test_nccl_multi_gpu.py tests/gpu/workers/gpu_by_rank_worker.py examples/pretrain_gpt.py
    configs/gpt_tiny_pp2_dp2_bf16_zero1.json ds_swift/transport/nccl.py ds_swift/transport/communicators.py
    patches/step_guard.py)
missing=0
for f in "${files[@]}"; do
    if [ ! -f "$f" ]; then echo "missing: $f"; missing=1; fi
done
[ "$missing" = 0 ] || exit 2
cmd=(python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_nccl_multi_gpu.py)
if [ "$dry" = 1 ]; then
    echo "files present: ${files[*]}"
    echo "would run (in $out, with SWIFT_STRICT_TRANSPORT=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}):"
    echo "  nvidia-smi -L > $out/gpu.txt"
    echo "  ${cmd[*]} 2>&1 | tee $out/tests.txt"
    exit 0
fi
mkdir -p "$out"
arch_list=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_CUDA_ARCH_LIST=$(printf '%s' "$arch_list" | sed -E 's/([0-9]+\.[0-9]+)[a-z]+/\1/g')
if [ -d .gpu-deps ] && ! python3 -c 'import deepspeed, pydantic' 2>/dev/null; then
    site=$PWD/.gpu-deps/site
    if [ ! -d "$site" ] && [ -d .gpu-deps/wheels ]; then
        python3 -m pip install -q --no-index --no-deps --target "$site" .gpu-deps/wheels/*.whl
    fi
    export PYTHONPATH=$site:$PWD/.gpu-deps${PYTHONPATH:+:$PYTHONPATH}
    python3 -c 'import ds_swift.cuda_ext' 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
fi
nvidia-smi -L | tee "$out/gpu.txt"
gpus=$(nvidia-smi -L | grep -c '^GPU')
[ "$gpus" -ge 2 ] || echo "only $gpus GPU(s): the 2- and 4-GPU checks are skipped (the 1-GPU ones run)" | tee -a "$out/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())' | tee -a "$out/gpu.txt"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} SWIFT_STRICT_TRANSPORT=1
"${cmd[@]}" 2>&1 | tee "$out/tests.txt"
exit "${PIPESTATUS[0]}"
