#!/usr/bin/env bash
# Issue 14's prepared accelerator run, one call of the device tool on the H200 (at most
# 120 s of tests + 420 s of benchmarks; run it with timeout_s 600). Sections run in priority
# order and $OUT/device.json is rewritten after each, so a cut-short run keeps what it did.
# A section that is missing or failed (device.json "errors"): rerun at once, while the
# machine is warm (a new start costs minutes), with timeout_s = what is left, e.g.
#
#   bash scripts/device_run.sh                                  # everything, results under $OUT
#   SKIP_TESTS=1 SECTIONS=generate bash scripts/device_run.sh   # a rerun of what is missing
#
# then give the machine back.
#   SKIP_TESTS=1 ...                              # no pytest part
#   TEST_TIMEOUT=100 SECTIONS=xla,sweep BENCH_ARGS="--sweep-set splits --sweep-seconds 120" ...
#                                                 # the next run to make (about 8 minutes: timeout_s 600):
#                                                 # the Pallas tests compiled; section xla: the 1B step of both
#                                                 # layouts under XLA options side by side (dynamic-slice fusion:
#                                                 # does XLA:GPU read the scan's weight slices in place? the scanned
#                                                 # step was ~1 ms slower than per-layer; command buffers with the
#                                                 # loop inside: is the per-layer step's 2x its floor launch cost?
#                                                 # no autotuning: how much of the first call is XLA's autotuner?);
#                                                 # the splits sweep: more programs per SM than the default 512
#                                                 # (and 2 warps): is the kernel short of memory-level parallelism?
#   BENCH_ARGS=--quick ...                        # small sizes (the CPU smoke run of this script)
#
# 1. tests/test_pallas_gpu.py on the GPU (the kernels compiled by Triton, not interpreted),
#    against the float64 reference;
# 2. benchmarks/bench_device.py: decode attention kernels, capacity independence, bandwidth,
#    the donated loop, generate, and the 1B-shape model against its read floor and
#    transformers (bench_llama1b.py). Tables go to the log, figures to $OUT/device.json.
# Uses what the device image has (jax[cuda], flax, torch, transformers, pytest, chex,
# hypothesis): nothing is installed, the repository is put on PYTHONPATH.
set -uo pipefail
out=${OUT:-/tmp/jaxkv-device}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$out/env.txt"
import jax, sys
print(sys.version.split()[0], "jax", jax.__version__, jax.devices())
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$out/env.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
    JAX_PLATFORMS=cuda timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -v --durations=10 -p no:xdist -p no:cacheprovider \
        tests/test_pallas_gpu.py tests/test_offload.py 2>&1 | tee "$out/pallas_tests.log"
fi
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench_device.py ${BENCH_ARGS:-} \
    --sections "${SECTIONS:-kernels,llama1b,capacity,loop,bandwidth,generate}" --json "$out/device.json" 2>&1 \
    | tee "$out/bench_device.log"
