#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what tests/gpu/run_device_checks.sh installs on a GPU host that
# has no network (Python 3.12, x86-64, torch, triton, nvcc, jinja2, requests, nvidia-ml-py and
# cuda-python already there). Run it where PyPI is reachable, from anywhere in the repository:
#   bash tests/gpu/prepare_wheels.sh
# It brings flashinfer-python 0.7.4 trimmed to what its JIT builds need (all its Python files,
# data/include, data/cccl, data/cutlass/{include,tools/util/include}, data/spdlog/include, the
# top-level data/csrc files, its dist-info: an xz tarball of about 17 MB instead of a 101 MB
# wheel), apache-tvm-ffi, and what mmkv needs that the host lacks or has at another version
# (open_clip_torch and its ftfy/wcwidth; transformers as tested here, and the regex it checks).
# With the repository (about 12 MB) that stays under the 64 MiB a device call carries.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
rm -rf .whl && mkdir -p .whl/download
platforms=()
for n in 2_28 2_27 2_24 2_17 2014 1; do
    case $n in 2014) platforms+=(--platform manylinux2014_x86_64) ;; 1) platforms+=(--platform manylinux1_x86_64) ;;
                     *) platforms+=(--platform "manylinux_${n}_x86_64") ;; esac
done
download() {
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$1" "${@:2}"
}
download .whl apache-tvm-ffi==0.1.15.post2 open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.9.4 \
    transformers==5.24.0 regex==2026.11.19
download .whl/download flashinfer-python==0.7.4
wheel=$(ls .whl/download/flashinfer_python-0.7.4-*.whl)
stage=.whl/download/stage
"$PYTHON" - "$wheel" "$stage" <<'PY'
import sys, zipfile
wheel, stage = sys.argv[1:]
keep_dirs = ("flashinfer/data/include/", "flashinfer/data/cccl/", "flashinfer/data/cutlass/include/",
             "flashinfer/data/cutlass/tools/util/include/", "flashinfer/data/spdlog/include/")
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist()
             if n.endswith(".py") or ".dist-info/" in n or n.startswith(keep_dirs)
             or (n.startswith("flashinfer/data/csrc/") and n.count("/") == 3)]
    z.extractall(stage, names)
print(f"kept {len(names)} files of {wheel}")
PY
XZ_OPT=-9T0 tar -cJf .whl/flashinfer_python-0.7.4-trimmed.tar.xz -C "$stage" .
rm -rf .whl/download
du -sh .whl/* | sed 's/^/  /'
echo "ready: carry .whl to the GPU host and run: bash tests/gpu/run_device_checks.sh"
