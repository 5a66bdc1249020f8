#!/usr/bin/env bash
# The GPU run, for a machine with one CUDA GPU and a Python that has torch and pytest: the
# `cuda`-marked tests of every package, then benchmarks/bench_gpu.py, then (in what is left of
# the time) every package's whole suite (its tests not marked `cuda` run as without a GPU).
# Each part is bounded by `timeout`;
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
        2>&1 | tee "$out/cuda-$package.log" | tail -25
done
if [ "${GPU_RUN_BENCH:-1}" != 0 ]; then
    echo "== bench_gpu.py ($((SECONDS - start)) s so far)"
    timeout 330 "$python" benchmarks/bench_gpu.py "$@" 2>&1 | tee "$out/bench_gpu.log"
    # Generation's one-process lines on the GPU (two partitions on the one device), where
    # transformers is there to run them.
    if "$python" -c "import transformers" 2>/dev/null &&
        "$python" -m pip install -q --no-index --no-deps --no-build-isolation \
            -e packages/gpipe-transformers >>"$out/install.log" 2>&1; then
        echo "== bench_generate.py --device cuda ($((SECONDS - start)) s so far)"
        timeout 200 "$python" benchmarks/bench_generate.py --device cuda --one-process 2>&1 |
            tee "$out/bench_generate.log"
    fi
fi

left=$((${GPU_RUN_SECONDS:-360} - (SECONDS - start)))
if [ "$left" -gt 60 ]; then
    echo "== every package's whole suite on a machine with a GPU (${left} s at most)"
    workers=()
    if "$python" -c "import xdist" 2>/dev/null; then workers=(-n 8); fi
    for package in microbatch checkpoint skip bn balance core; do
        timeout "$left" "$python" -m pytest "packages/gpipe-$package/tests" -q -p no:cacheprovider \
            "${workers[@]}" --maxfail=30 >"$out/all-$package.log" 2>&1
        echo "gpipe-$package: exit status $?: $(tail -1 "$out/all-$package.log")"
        left=$((${GPU_RUN_SECONDS:-360} - (SECONDS - start)))
        [ "$left" -gt 20 ] || break
    done
fi
echo "gpu_run.sh: $((SECONDS - start)) s"
