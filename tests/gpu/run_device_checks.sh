#!/usr/bin/env bash
# The GPU check of the FlashInfer backend: one script, no network, about 8 minutes at most.
#
# On a CUDA host (nvcc, torch, triton there), from a checkout that holds .whl/ as made by
# tests/gpu/prepare_wheels.sh where PyPI is reachable:
#     bash tests/gpu/run_device_checks.sh [OUT_DIR]        # OUT_DIR: default $OUT, else ./out
# Through the device tool: run(command="bash tests/gpu/run_device_checks.sh", carry=[".whl"]).
#
# 1. installs what the host lacks from .whl/ into /tmp/mmkv-site (put first on PYTHONPATH);
# 2. compiles FlashInfer's JIT modules in the background (bfloat16, head_dim 64 and 128);
# 3. runs the tests of tests/ that support MMKV_TEST_DEVICE=cuda with it (the oracle tests on the
#    GPU in bfloat16; the rest of tests/ is CPU-only and runs in CI) and the check of the recorded
#    FlashInfer signatures against the installed package;
# 4. runs tests/gpu: FlashInfer against the torch backend, per pattern and through the engine;
# 5. runs python -m mmkv.bench gpu --json, its JSON line to OUT_DIR/bench_gpu.json;
# then prints "N passed, N failed" over 3-5 (the benchmark is one check). Logs go to OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-out}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
command -v nvcc >/dev/null || export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"

if [ -d .whl ]; then
    site=/tmp/mmkv-site
    mkdir -p "$site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || echo "installing .whl/*.whl failed" | tee -a "$out/summary.txt"
    tar -xJf .whl/flashinfer_python-*-trimmed.tar.xz -C "$site" \
        || echo "unpacking FlashInfer failed" | tee -a "$out/summary.txt"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvcc --version | tail -1
"$py" -c "import torch, transformers, flashinfer; print('torch', torch.__version__, '| transformers',
transformers.__version__, '| flashinfer', flashinfer.__version__, '| cuda', torch.cuda.is_available())" \
    || echo "importing torch, transformers or flashinfer failed" | tee -a "$out/summary.txt"

"$py" tests/gpu/build_flashinfer_modules.py > "$out/jit_build.log" 2>&1 &
jit=$!

passed=0
failed=0
tally() {  # add the counts of a pytest log's summary line (errors count as failures)
    local summary n
    summary=$(grep -E "[0-9]+ (passed|failed|errors?|skipped)" "$1" | tail -1)
    echo "$2: ${summary:-no summary (pytest did not finish)}" | tee -a "$out/summary.txt"
    [ -z "$summary" ] && failed=$((failed + 1))
    n=$(grep -oE "[0-9]+ passed" <<<"$summary" | grep -oE "[0-9]+"); passed=$((passed + ${n:-0}))
    for word in failed error errors; do
        n=$(grep -oE "[0-9]+ $word\b" <<<"$summary" | grep -oE "[0-9]+"); failed=$((failed + ${n:-0}))
    done
}

begin=$SECONDS
MMKV_TEST_DEVICE=cuda timeout 200 "$py" -m pytest -p no:cacheprovider tests/test_engine_oracle.py \
    tests/test_flashinfer_api.py > "$out/tests_cuda.log" 2>&1
tally "$out/tests_cuda.log" "tests/ on cuda ($((SECONDS - begin)) s)"

wait "$jit" || echo "FlashInfer JIT build failed: see jit_build.log" | tee -a "$out/summary.txt"
tail -n 6 "$out/jit_build.log"
echo "JIT modules ready after $((SECONDS - begin)) s" | tee -a "$out/summary.txt"

begin=$SECONDS
timeout 150 "$py" -m pytest -s -p no:cacheprovider tests/gpu > "$out/tests_gpu.log" 2>&1
grep "token agreement" "$out/tests_gpu.log" | tee -a "$out/summary.txt"
tally "$out/tests_gpu.log" "tests/gpu ($((SECONDS - begin)) s)"

begin=$SECONDS
timeout 150 "$py" -m mmkv.bench gpu --json > "$out/bench_gpu.log" 2>&1
bench=$?
tail -n 1 "$out/bench_gpu.log" > "$out/bench_gpu.json"
if [ "$bench" -eq 0 ] && "$py" -c "import json, sys; json.load(open(sys.argv[1]))" "$out/bench_gpu.json"; then
    passed=$((passed + 1))
    echo "bench gpu: ok ($((SECONDS - begin)) s)" | tee -a "$out/summary.txt"
else
    failed=$((failed + 1))
    echo "bench gpu: exit $bench ($((SECONDS - begin)) s), see bench_gpu.log" | tee -a "$out/summary.txt"
    tail -n 5 "$out/bench_gpu.log"
fi
cat "$out/bench_gpu.json"

grep -E "^(FAILED|ERROR) " "$out/tests_cuda.log" "$out/tests_gpu.log" | head -40
echo "$passed passed, $failed failed" | tee -a "$out/summary.txt"
[ "$failed" -eq 0 ]
