#!/usr/bin/env bash
# Issue 17's prepared training run for the embedded model on the H200, one call of the device
# tool. The accelerator's Python (3.12) has another stdlib than this machine's (3.11), so the
# token streams and the tokenizer are made here and carried:
#
#   .venv/bin/python scripts/train_embedded.py --extra-train-dirs test \
#       --extra-train-packages jax numpy networkx matplotlib pip --function-docs --write-data .devdata
#
# (24.8M training tokens, 15.8 MB with the validation stream, zlib-compressed: the working tree
# (18 MB) and the carry must stay under 64 MiB together, which the 49.9 MB of uncompressed
# streams did not. A batch
# of 64 x 512 tokens on the H200 sees the stdlib alone, 7.9M tokens, dozens of times in 7 minutes.)
#   device run: command "bash scripts/device_train.sh", carry [".devdata"], timeout_s 600
#
# It writes $OUT/pycoder (the HF directory, model.safetensors under the 16 MiB a returned file
# may have), $OUT/training_log.json, $OUT/training_loss.png and $OUT/train.log: the 8 files that
# may come back. Here, copy $OUT/pycoder to jaxkv/_assets/pycoder and the two docs files to docs/, then
# measure with scripts/eval_embedded.py and tests/test_embedded.py.
#
#   MINUTES=7          training wall clock (the cosine decay runs over it)
#   ARGS="..."         more train_embedded.py options: the architecture (--hidden, --layers, ...),
#                      --init-from jaxkv/_assets/pycoder to continue the shipped model, --lr
#   CONTEXT=512, BATCH=64  training window and rows per step
# The defaults: train_embedded.py's architecture (4 layers, hidden 192) from scratch, batch 64 x 512
# tokens. The shipped model (run 10, 2026-12-04) came from this script on the H200, with the data
# made by the command above plus "torch scipy sympy" in --extra-train-packages:
#   DATA=.devdata ARGS="--layers 6" MINUTES=4.6 BATCH=128 bash scripts/device_train.sh
# (8530 steps, 32 ms each alone on the GPU; README "The embedded model").
#   DATA=...           the --write-data directory (default .devdata)
set -uo pipefail
out=${OUT:-/tmp/jaxkv-train}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1
"${PYTHON:-python3}" scripts/train_embedded.py --data "${DATA:-.devdata}" --device "${DEVICE:-cuda}" --bf16 \
    --train-minutes "${MINUTES:-7}" --steps 10000000 --batch "${BATCH:-64}" --context "${CONTEXT:-512}" --warmup 300 \
    --eval-every 500 --log-every 100 --out "$out/pycoder" --docs "$out" ${ARGS:-} 2>&1
} | tee "$out/train.log"
