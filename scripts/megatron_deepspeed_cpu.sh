#!/usr/bin/env bash
# ds-swift in the real deepspeedai/Megatron-DeepSpeed, on CPU (gloo): a tiny GPT (pp 2 x dp 2, one
# rank per simulated machine, one spare) trained twice under ds-swift-launch, failure-free and with
# machine 3 SIGKILLed in the backward pass of iteration 5; the final checkpoints must be bitwise equal.
#
#   bash scripts/megatron_deepspeed_cpu.sh PATH_TO_CHECKOUT [WORK_DIR]
#
# The checkout must be at the series' commit (ds-swift megatron-patch checks it and applies the
# series). Needs Megatron-DeepSpeed's own Python deps: pip install regex nltk pybind11.
set -euo pipefail
CHECKOUT=$(cd "${1:?usage: $0 PATH_TO_CHECKOUT [WORK_DIR]}" && pwd)
mkdir -p "${2:-megatron-swift-run}"
WORK=$(cd "${2:-megatron-swift-run}" && pwd)
PY=${PYTHON:-python}
export OMP_NUM_THREADS=1 LOCAL_SIZE=1  # LOCAL_SIZE: DeepSpeed's CPU accelerator's device count per machine

ds-swift megatron-patch "$CHECKOUT" --work "$WORK" >/dev/null
"$PY" -c "import regex, nltk, pybind11" 2>/dev/null || { echo "pip install regex nltk pybind11 (Megatron-DeepSpeed's deps)" >&2; exit 2; }
make -s -C "$CHECKOUT/megatron/data" >/dev/null  # the dataset index helpers (C++), as Megatron does at start-up

# Data: the standard library's docstrings (ds_swift.corpus) as bytes, in Megatron's indexed format
# through its own tools/preprocess_data.py with the NullTokenizer (space-separated token ids).
if [ ! -f "$WORK/data/stdlib_text_document.bin" ]; then
    mkdir -p "$WORK/data"
    "$PY" - "$WORK/corpus.jsonl" <<'EOF'
import json, sys
from ds_swift.corpus import load_corpus
data = bytes(load_corpus(max_bytes=400_000).tokens.tolist())
with open(sys.argv[1], "w") as f:
    for doc in filter(None, data.split(b"\n\n")):
        f.write(json.dumps({"text": " ".join(map(str, doc))}) + "\n")
EOF
    (cd "$CHECKOUT" && "$PY" tools/preprocess_data.py --input "$WORK/corpus.jsonl" --tokenizer-type NullTokenizer \
        --vocab-size 256 --append-eod --output-prefix "$WORK/data/stdlib" --workers 1 >/dev/null)
fi
cat >"$WORK/ds_config.json" <<'EOF'
{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000000,
 "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0,
 "swift": {"enabled": true, "machines": {"gpus_per_node": 1, "rank_order": "tp-dp-pp"}, "strategy": "auto",
           "watchdog": {"poll_interval_s": 0.1, "heartbeat_timeout_s": 10.0, "op_timeout_s": 60.0}}}
EOF

run() {  # run NAME [--kill]: the launch command ds-swift megatron-patch prints
    rm -rf "${WORK:?}/$1"; mkdir -p "$WORK/$1"
    local argv
    argv=$("$PY" -c "import shlex, sys; from pathlib import Path; from ds_swift.megatron_patch import launch_command
print(shlex.join(launch_command(Path(sys.argv[1]), Path(sys.argv[2]), kill=sys.argv[3] == 'kill')))" \
        "$CHECKOUT" "$WORK" "$1")
    (cd "$CHECKOUT" && eval "$argv") >"$WORK/$1/log" 2>&1 || { tail -30 "$WORK/$1/log"; exit 1; }
    grep -E "lm loss|\[ds-swift\] recovery of|job finished" "$WORK/$1/log" | sed -E 's/ \| consumed tokens.*lm loss:/ | lm loss:/; s/ \| num zeros.*//'
}
echo "== failure-free"; run ref
echo "== machine 3 killed in the backward pass of iteration 5"; run kill
"$PY" - "$WORK" <<'EOF'
import sys
from ds_swift.testing.checkpoints import compare_checkpoints
diff = compare_checkpoints(f"{sys.argv[1]}/ref/ckpt/global_step8", f"{sys.argv[1]}/kill/ckpt/global_step8")
print(f"global_step8: {diff.tensors} tensors compared, {len(diff.differing)} differ, {len(diff.only_in_one)} in one only")
sys.exit(0 if not diff.differing and not diff.only_in_one else 1)
EOF
