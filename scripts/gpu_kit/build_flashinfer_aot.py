"""How .gpu/flashinfer-aot-sm90a.tar.xz was made (off-GPU, 2 cores, ~25 min): FlashInfer 0.6.1's
JIT modules that minisgl's GPU tests use, compiled for sm_90a with nvcc 13.0.88, packed as
<name>/<name>.so for flashinfer/data/aot (flashinfer loads them there instead of compiling).

    export CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/fiws
    export FLASHINFER_EXTRA_CUDAFLAGS="-isystem /tmp/cuinc" FLASHINFER_EXTRA_CFLAGS="-isystem /tmp/cuinc"
    export FLASHINFER_EXTRA_LDFLAGS="-L/tmp/stubs"   # a stub libcuda.so (soname libcuda.so.1)
    # /tmp/cuinc: links to the cublas*/curand*/... headers of the nvidia/cu13 pip package
    # (this machine's CUDA toolkit lacks them); flashinfer 0.6.1 + apache-tvm-ffi 0.1.15.post2
    # On 2026-11-28: pip install --target /tmp/fisite --no-deps flashinfer-python==0.6.1 click
    #   einops ninja tabulate nvidia-ml-py nvidia-cublas nvidia-curand; PYTHONPATH=/tmp/fisite;
    #   headers: for f in /tmp/fisite/nvidia/cu13/include/*: link those absent from
    #   /usr/local/cuda/include; stub: echo 'void cuGetErrorString(void){}' > s.c && gcc -shared
    #   -fPIC -Wl,-soname,libcuda.so.1 -o /tmp/stubs/libcuda.so s.c (+ a libcuda.so.1 link)
    python build_flashinfer_aot.py small decode prefill
    cd /tmp/fiws/.cache/flashinfer/0.6.1/90a/cached_ops && tar -cf - */*.so | xz -9e > flashinfer-aot-sm90a.tar.xz

Modules: norm, rope, silu_and_mul, gelu_tanh_and_mul; batch decode (CUDA cores) and batch prefill
(fa2; also tensor-core decode) for bf16 / int32 indptr / no RoPE at head_dim 128 (Qwen3, Llama
8B, Qwen3-MoE), 256 with window + soft-cap and 256 soft-cap only (the Gemma window shape), and 64
(SmolLM2). Set DRY=1 to print the names only.
"""
import os, sys, time, torch
from flashinfer.jit.norm import gen_norm_module
from flashinfer.jit.rope import gen_rope_module
from flashinfer.jit.activation import gen_act_and_mul_module
from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
bf = torch.bfloat16; i32 = torch.int32
def specs(which):
    out = []
    if "small" in which:
        out += [gen_norm_module(), gen_rope_module(), gen_act_and_mul_module("silu"), gen_act_and_mul_module("gelu_tanh")]
    for hd, win, cap in [(128, False, False), (256, True, True), (256, False, True), (64, False, False)]:
        if f"decode{hd}" in which or "decode" in which:
            out.append(gen_batch_decode_module(bf, bf, bf, i32, hd, hd, 0, win, cap))
        if f"prefill{hd}" in which or "prefill" in which:
            out.append(gen_batch_prefill_module("fa2", bf, bf, bf, i32, hd, hd, 0, win, cap, False))
    return out
which = sys.argv[1:]
for s in specs(which):
    print(s.name, flush=True)
    if os.environ.get("DRY"): continue
    t = time.time(); s.build(verbose=False); print(f"  built in {time.time()-t:.0f}s -> {s.jit_library_path} {s.jit_library_path.stat().st_size/1e6:.1f} MB", flush=True)
