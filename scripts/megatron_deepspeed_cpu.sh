#!/usr/bin/env bash
# ds-swift in the real deepspeedai/Megatron-DeepSpeed, on CPU (gloo): a tiny GPT trained twice under
# ds-swift-launch, failure-free and with one machine SIGKILLed; the final checkpoints must be bitwise
# equal. Default: pp 2 x dp 2, fp32, ZeRO-0, one rank per simulated machine and one spare, machine 3
# killed in the backward pass of iteration 5, eight iterations.
#
#   bash scripts/megatron_deepspeed_cpu.sh PATH_TO_CHECKOUT [WORK_DIR] [options]
#     --tp N --pp N --dp N --machines N --spares N     shape (ranks per machine: tp*pp*dp/machines)
#     --precision fp32|bf16|fp16 --zero 0|1             precision, ZeRO stage
#     --strategy auto|replication|logging|...           ds-swift's strategy
#     --kill-machine M --kill-iteration I --kill-phase forward|backward|step|send|recv
#     --kill-also M2                                    a second machine killed at the same instant
#     --iters N --save-interval N                       length, global checkpoint interval
#     --reference REF_WORK                              compare with REF_WORK's failure-free run (same
#                                                       shape, precision, length) instead of running one
#     --untie-embeddings                                Megatron's --untie-embeddings-and-output-weights
#     --initial-scale-power N                           fp16: first loss scale 2**N (large: skipped steps)
#     --dry-run                                         print both launch commands, run nothing
# (python -m ds_swift.megatron.cpu prepare --help lists them with their defaults.)
#
# The checkout must be at the series' commit (ds-swift megatron-patch checks it and applies the
# series). Needs Megatron-DeepSpeed's own Python deps: pip install regex nltk pybind11.
set -euo pipefail
PY=${PYTHON:-python}
case " $* " in *" -h "* | *" --help "*) exec "$PY" -m ds_swift.megatron.cpu prepare --help ;; esac
# Parses and checks the options, writes WORK/ref and WORK/kill's DeepSpeed configs, and sets CHECKOUT,
# WORK, LOCAL_SIZE, REF_CMD, KILL_CMD, FINAL_TAG, DESCRIBE, DRY_RUN and REF_WORK (shell-quoted by the helper).
assignments=$("$PY" -m ds_swift.megatron.cpu prepare "$@")
eval "$assignments"
# LOCAL_SIZE: DeepSpeed's CPU accelerator's device count per machine (Megatron: local_rank = rank % it)
export OMP_NUM_THREADS=1 LOCAL_SIZE
if [ -n "$DRY_RUN" ]; then
    printf '%s\n(cd %s && LOCAL_SIZE=%s)\nfailure-free: %s\nkill: %s\n' "$DESCRIBE" "$CHECKOUT" "$LOCAL_SIZE" "$REF_CMD" "$KILL_CMD"
    exit 0
fi

ds-swift megatron-patch "$CHECKOUT" --work "$WORK" >/dev/null
"$PY" -c "import regex, nltk, pybind11" 2>/dev/null || { echo "pip install regex nltk pybind11 (Megatron-DeepSpeed's deps)" >&2; exit 2; }
make -s -C "$CHECKOUT/megatron/data" >/dev/null  # the dataset index helpers (C++), as Megatron does at start-up

# Data: the standard library's docstrings (ds_swift.data.corpus) as bytes, in Megatron's indexed format
# through its own tools/preprocess_data.py with the NullTokenizer (space-separated token ids).
if [ ! -f "$WORK/data/stdlib_text_document.bin" ]; then
    mkdir -p "$WORK/data"
    "$PY" - "$WORK/corpus.jsonl" <<'EOF'
import json, sys
from ds_swift.data.corpus import load_corpus
data = bytes(load_corpus(max_bytes=400_000).tokens.tolist())
with open(sys.argv[1], "w") as f:
    for doc in filter(None, data.split(b"\n\n")):
        f.write(json.dumps({"text": " ".join(map(str, doc))}) + "\n")
EOF
    (cd "$CHECKOUT" && "$PY" tools/preprocess_data.py --input "$WORK/corpus.jsonl" --tokenizer-type NullTokenizer \
        --vocab-size 256 --append-eod --output-prefix "$WORK/data/stdlib" --workers 1 >/dev/null)
fi

run() {  # run NAME COMMAND: one launch from the checkout; prints its iterations and recovery lines
    rm -rf "${WORK:?}/$1/run" "$WORK/$1/ckpt" "$WORK/$1/logs"
    (cd "$CHECKOUT" && eval "$2") >"$WORK/$1/log" 2>&1 || { tail -30 "$WORK/$1/log"; exit 1; }
    "$PY" -m ds_swift.megatron.cpu summary "$WORK/$1/log"
}
echo "== $DESCRIBE"
if [ -n "$REF_WORK" ]; then
    echo "== failure-free: $REF_WORK/ref (--reference)"
else
    REF_WORK=$WORK
    echo "== failure-free"; run ref "$REF_CMD"
fi
echo "== with the kill"; run kill "$KILL_CMD"
"$PY" -W ignore -m ds_swift.megatron.cpu compare "$REF_WORK/ref/ckpt" "$WORK/kill/ckpt" "$FINAL_TAG"
