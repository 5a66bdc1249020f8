#!/usr/bin/env bash
# The GPU run, for a machine with one CUDA GPU and a Python that has torch and pytest: the
# `cuda`-marked tests of every package, then benchmarks/bench_gpu.py, then (in what is left of
# the time) the whole gpipe-core suite with the GPU visible. Each part is bounded by `timeout`;
# every log goes to $OUT (default: gpu-out/). Wheels in .whl/ (torchgpipe, hatchling) are
# installed first when present, for a machine that reaches no package index.
#
#   bash benchmarks/gpu_run.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
start=$SECONDS

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'

if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-site .whl/*.whl
    export PYTHONPATH=/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi
installed=1
for package in microbatch checkpoint skip bn balance core; do
    "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e "packages/gpipe-$package" \
        >>"$out/install.log" 2>&1 || installed=0
done
if [ "$installed" = 0 ]; then
    echo "editable installs failed (see install.log): using the sources on PYTHONPATH"
    PYTHONPATH=$(ls -d "$PWD"/packages/*/src | paste -sd:):$PYTHONPATH
    export PYTHONPATH
fi

echo "== cuda tests"
for package in microbatch checkpoint skip bn balance core; do
    timeout 300 "$python" -m pytest "packages/gpipe-$package/tests" -m cuda -q -p no:cacheprovider \
        -o addopts="--import-mode=importlib -ra" 2>&1 | tee "$out/cuda-$package.log" | tail -25
done
echo "== bench_gpu.py ($((SECONDS - start)) s so far)"
timeout 330 "$python" benchmarks/bench_gpu.py "$@" 2>&1 | tee "$out/bench_gpu.log"

left=$((${GPU_RUN_SECONDS:-360} - (SECONDS - start)))
if [ "$left" -gt 60 ]; then
    echo "== gpipe-core's whole suite with the GPU visible (${left} s at most)"
    workers=()
    if "$python" -c "import xdist" 2>/dev/null; then workers=(-n 8); fi
    timeout "$left" "$python" -m pytest packages/gpipe-core/tests -q -p no:cacheprovider "${workers[@]}" \
        -o addopts="--import-mode=importlib -ra" --maxfail=30 >"$out/core-all.log" 2>&1
    echo "exit status $?"
    tail -30 "$out/core-all.log"
fi
echo "gpu_run.sh: $((SECONDS - start)) s"
