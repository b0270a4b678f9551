#!/usr/bin/env bash
# One device call that serves two issues (the H200's 15 minutes a session allow one long call).
#   - issue 17: three trainings of the embedded model's shape (6 layers, hidden 192) side by side
#     on the one GPU (each is a few MB of torch state and launch-bound, so they barely slow each
#     other), to be chosen between here by validation loss and the tuning prompts:
#       scratch    stdlib + its test suite + function documents (.devdata_base), from scratch
#       continued  the same data, from the shipped weights (jaxkv/_assets/pycoder), lr 5e-4
#       packages   .devdata: the same plus jax numpy networkx matplotlib pip torch scipy sympy, from scratch
#     Data, made here (the device's Python has another stdlib):
#       python scripts/train_embedded.py --extra-train-dirs test --function-docs --write-data .devdata_base
#       python scripts/train_embedded.py --extra-train-dirs test --extra-train-packages jax numpy \
#           networkx matplotlib pip torch scipy sympy --function-docs --write-data .devdata
#   - issue 14: meanwhile tests/test_pallas_gpu.py and tests/test_offload.py run on the same GPU
#     (JAX without preallocation; correctness only, so sharing the chip is harmless), and after
#     the trainings, with the GPU idle, the `kernels` section of bench_device.py (timings).
# At most 8 files come back from $OUT: one tar per training (model directory, training_log.json,
# training_loss.png, train.log) and checks.tar (pallas_tests.log, env.txt, device.json,
# bench_device.log).
#   device run: command "bash scripts/device_train_and_check.sh", carry [".devdata", ".devdata_base"],
#   timeout_s 540
#   MINUTES (5.5), BATCH (128), TRAIN_TIMEOUT (430 s), TEST_TIMEOUT (300 s), SECTIONS (kernels),
#   BENCH_TIMEOUT (100 s).
set -uo pipefail
out=${OUT:-/tmp/jaxkv-device}
work=/tmp/jaxkv-work
checks=$work/checks
mkdir -p "$out" "$checks"
export PYTHONUNBUFFERED=1
pack_checks() { tar -cf "$out/checks.tar" -C "$checks" . 2>/dev/null; }
(
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD" JAX_PLATFORMS=cuda timeout "${TEST_TIMEOUT:-300}" \
        python3 -m pytest -v --durations=10 -p no:cacheprovider tests/test_pallas_gpu.py tests/test_offload.py \
        > "$checks/pallas_tests.log" 2>&1
    echo "pytest exit status $?" >> "$checks/pallas_tests.log"
) &
tests=$!
train() {  # name, data directory, extra train_embedded.py options
    local name=$1 data=$2
    shift 2
    DATA="$data" ARGS="$* ${SMOKE_ARGS:-}" MINUTES="${MINUTES:-5.5}" BATCH="${BATCH:-128}" OUT="$work/$name" \
        timeout "${TRAIN_TIMEOUT:-430}" bash scripts/device_train.sh > "$work/$name.console" 2>&1
    echo "$name: exit status $?" >> "$work/$name.console"
    cp "$work/$name.console" "$work/$name/console.log"
    tar -cf "$out/$name.tar" -C "$work" "$name"
}
train scratch .devdata_base --layers 6 &
p1=$!
train continued .devdata_base --init-from jaxkv/_assets/pycoder --lr 5e-4 --warmup 100 &
p2=$!
train packages .devdata --layers 6 &
p3=$!
wait $p1 $p2 $p3
for n in scratch continued packages; do echo "== $n"; grep -E "^step|saved|rose|Error|error|exit status" "$work/$n.console" | tail -n 8; done
wait "$tests"
tail -n 25 "$checks/pallas_tests.log"
pack_checks
OUT="$checks" SKIP_TESTS=1 SECTIONS="${SECTIONS:-kernels}" BENCH_TIMEOUT="${BENCH_TIMEOUT:-100}" \
    bash scripts/device_run.sh
pack_checks
ls -la "$out"
