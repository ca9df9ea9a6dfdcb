#!/usr/bin/env bash
# The checks that need a GPU, as one run for a lent GPU machine (docs/vllm.md, "GPU copies"):
#   1. the machine: kernel, CPUs, memory, /dev/shm, locked-memory limit, GPU, torch;
#   2. python/benchmarks/gpu_copy.py: H2D copies of items read from a store, each way
#      beside the DMA floor, and the cost of registering a heap with CUDA per GiB;
#   3. python/tests/test_cuda.py, whose GPU tests skip everywhere else;
#   4. with --scale, `shmstore bench --scale` (issue 11's rows) on the machine's memory;
#   5. with --vllm, the plugin's CUDA tests (python/tests_vllm, real CUDA) and
#      python/benchmarks/vllm_cache.py (vLLM's caches beside shmstore's, 1 to 8 workers)
#      on the machine's cores; with --vllm-tests, the tests alone.
# --no-copy leaves out steps 2 and 3 (a rerun that needs only the others).
#
# Needs torch with a GPU, the built extension (python/shmstore/_native.abi3.so: build it
# with `bash scripts/python.sh`), for --scale target/release/shmstore, and for --vllm what
# `bash scripts/gpu.sh prepare` leaves in .gpu-pkgs/: the lent machine reaches no package
# registry, and vLLM's wheel is too large to carry, so `prepare` (run here, after
# `bash scripts/vllm.sh`) packs vLLM's Python sources without its compiled kernels (the
# cache classes need none) and Python 3.12 wheels of the packages vLLM imports that the
# machine's image lacks. Writes every log and the figures under $OUT (the lent machine's
# output folder) or ./gpu-out. Each step has its own time limit, so one that hangs still
# leaves the others.
#
#   bash scripts/gpu.sh prepare              # here: fills .gpu-pkgs/ (about 30 MiB)
#   bash scripts/gpu.sh [--no-copy] [--scale] [--vllm|--vllm-tests]
#                                # there, carrying the extension, the binary and .gpu-pkgs
set -uo pipefail
cd "$(dirname "$0")/.."
pkgs=.gpu-pkgs
if [ "${1:-}" = prepare ]; then
    set -e
    site=$(python/.venv-vllm/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -rf "$pkgs" && mkdir -p "$pkgs/wheels"
    # What vLLM 0.34's cache, codec and scheduler modules import, at the versions
    # scripts/vllm.sh tests with, less what the machine's image holds (torch, numpy, ...).
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$pkgs/wheels" \
        msgspec==0.23.0 cachetools==8.0.2 pydantic==2.14.4 pydantic_core==2.50.5 \
        typing-inspection==0.4.5 annotated-types==0.8.0 pybase64==1.5.1 pyzmq==27.3.0 \
        sniffio==1.3.1 truststore==0.10.5 transformers==5.22.2 huggingface_hub==2.4.0 \
        httpx2==2.16.2 httpcore2==2.16.2 tokenizers==0.23.3
    (cd "$site" && find vllm vllm-*.dist-info -type f ! -name '*.so' ! -name '*.pyc' \
        ! -name vllm-rs ! -path '*/include/*' -size -1024k | tar -cJf - -T -) \
        > "$pkgs/vllm-src.tar.xz"
    du -sh "$pkgs"
    exit 0
fi
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
status=0

echo "== machine"
{
    uname -a
    echo "cpus: $(nproc)"
    free -g | sed -n 2p
    df -h /dev/shm | tail -1
    echo "ulimit -l: $(ulimit -l)"
    grep -E 'Hugepagesize|HugePages_Total|MemAvailable' /proc/meminfo
    cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
} 2>&1 | tee "$out/machine.txt"

case " $* " in *" --no-copy "*) ;; *)
    echo "== gpu_copy"
    timeout 300 "$py" python/benchmarks/gpu_copy.py --json "$out/gpu.json" 2>&1 | tee "$out/gpu_copy.txt" || status=1

    echo "== test_cuda"
    timeout 180 "$py" -m pytest -q -p no:cacheprovider -rs python/tests/test_cuda.py 2>&1 | tee "$out/test_cuda.txt" || status=1
esac

case " $* " in *" --scale "*)
    echo "== shmstore bench --scale"
    timeout 240 target/release/shmstore bench --scale 2>&1 | tee "$out/scale.txt" || status=1
esac

case " $* " in *" --vllm "*|*" --vllm-tests "*)
    echo "== vLLM plugin with CUDA"
    site=/tmp/gpu-site
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$pkgs"/wheels/*.whl && tar -xJf "$pkgs/vllm-src.tar.xz" -C "$site" \
        || { echo "no .gpu-pkgs: run 'bash scripts/gpu.sh prepare' here first"; exit 1; }
    # VLLM_TARGET_DEVICE=cpu: vLLM's CUDA platform loads its compiled kernels, which are
    # not carried; the cache classes and the codec run the same on either platform.
    export PYTHONPATH="$site:$PYTHONPATH" VLLM_TARGET_DEVICE=cpu
    timeout 180 "$py" -m pytest -q -p no:cacheprovider -rs python/tests_vllm/test_vllm_plugin.py \
        -k cuda 2>&1 | tee "$out/test_vllm_cuda.txt" || status=1
    case " $* " in *" --vllm "*)
        echo "== vLLM caches beside shmstore's"
        timeout 420 "$py" python/benchmarks/vllm_cache.py --workers "${GPU_VLLM_WORKERS:-1,2,4,8}" \
            2>&1 | tee "$out/vllm.txt" || status=1
    esac
esac
exit $status
