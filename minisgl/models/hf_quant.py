"""Quantized Hugging Face checkpoints (config.json's `quantization_config`) read tensor by
tensor, never as a dense weight: into layers.gguf_weight blocks for the AVX2 kernel on CPU, and
on CUDA into layers.gpu_blocks' forms (int4 as the same blocks, fp8 as it is stored). Every
linear takes them, experts too (per expert and part, layers.moe).

Layouts (w[o, i] is the Hugging Face weight; an int32 word holds 8 codes, code j at bits 4j):
- `awq` (AutoAWQ, version "gemm"): qweight [in, out / 8], the word's codes along the outputs
  in the order 0 2 4 6 1 3 5 7; qzeros [in / g, out / 8] likewise; scales [in / g, out];
  w = (q - z) * s.
- `gptq` (desc_act false): qweight [in / 8, out], codes along the inputs; qzeros [in / g,
  out / 8] along the outputs, holding z - 1 (checkpoint_format "gptq", AutoGPTQ's) or z
  ("gptq_v2"); scales [in / g, out].
- `compressed-tensors`, format "pack-quantized", int4, strategy group or channel:
  weight_packed [out, in / 8] along the inputs, holding q + 8 when symmetric (w = q * s), the
  code itself when not, with weight_zero_point [out / 8, in / g] packed along the outputs.
- `fp8` (e4m3): weight [out, in] with weight_scale_inv [out / 128, in / 128] (block-wise,
  `weight_block_size` [128, 128]) or weight_scale (per tensor or [out, 1]): w = q * scale.
  The CPU kernel has no float8 path: each group of 32 inputs is re-encoded as Q8_0 blocks
  (int8 codes, float16 scale max |w| / 127), so each weight moves by at most half a step,
  max |w| / 254 of its group (for block-wise checkpoints, one in 254 of the group's largest).
  On CUDA the codes and scales stay as they are.
- `mxfp4` (gpt-oss's experts): stacked `{name}_blocks` [E, out, in / 32, 16] (byte k of a
  group: value 2k in its low nibble, 2k + 1 in its high one, an E2M1 index) and
  `{name}_scales` [E, out, in / 32] (e8m0: 2^(s - 127)): per expert MXFP4 blocks, exact; on
  CUDA, for want of a kernel there, dequantized to the model's dtype.
Int4 groups (32 .. any multiple of 32, or the whole row) keep their codes, scales (float16:
exact) and zero points: the kernel's super-blocks hold the group's scale, its 32-input groups
the zero point (layers.gguf_weight "W4").
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from minisgl.layers.gguf_weight import GROUP, GgufBlocks
from minisgl.layers.gpu_blocks import Fp8Blocks
from minisgl.models.gguf_decode import mxfp4_blocks

METHODS = ("awq", "gptq", "compressed-tensors", "fp8", "mxfp4")
INT4_METHODS = METHODS[:3]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column of each code in an AWQ word
SUFFIXES = {"awq": ("qweight", "qzeros", "scales"),
            "gptq": ("qweight", "qzeros", "scales", "g_idx"),
            "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point",
                                   "weight_shape"),
            "fp8": ("weight", "weight_scale_inv", "weight_scale", "input_scale"),
            "mxfp4": ("blocks", "scales")}  # name_blocks, name_scales
# method -> the suffixes that mark a weight as quantized (one of them is there)
MARKS = {"awq": {"qweight"}, "gptq": {"qweight"}, "compressed-tensors": {"weight_packed"},
         "fp8": {"weight_scale_inv", "weight_scale"}, "mxfp4": {"blocks"}}
FP8_BLOCK = 128


@dataclass(frozen=True)
class QuantSpec:
    method: str
    group: int = 0  # int4: inputs per scale; -1: the whole row
    symmetric: bool = False
    zero_stored_minus_one: bool = False  # AutoGPTQ's v1 format


def quant_spec(config: dict) -> QuantSpec | None:
    """What a checkpoint's `quantization_config` asks for; ValueError (one line, naming what
    is supported) for any method or layout the kernel cannot run."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    supported = ("supported: awq (gemm, 4-bit), gptq (4-bit, desc_act false, gptq or gptq_v2 "
                 "format), "
                 "compressed-tensors (pack-quantized int4), fp8 (e4m3, block-wise or "
                 "per-channel), mxfp4 (gpt-oss's experts)")
    if method not in METHODS:
        raise ValueError(f"checkpoint quant_method {method!r} cannot be loaded; {supported}")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and list(block) != [FP8_BLOCK, FP8_BLOCK]:
            raise ValueError(f"fp8 weight_block_size {block} cannot be loaded; {supported}")
        return QuantSpec(method)
    if method == "compressed-tensors":
        return _compressed_tensors_spec(qc, supported)
    if method == "mxfp4":
        return QuantSpec(method)
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    problems = []
    if bits != 4:
        problems.append(f"bits {bits}")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        problems.append(f"AWQ version {qc.get('version')!r}")
    if method == "gptq" and qc.get("desc_act"):
        problems.append("desc_act true (act-order)")
    if method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        problems.append(f"checkpoint_format {qc.get('checkpoint_format')!r}")
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % GROUP)):
        problems.append(f"group_size {group}")
    if problems:
        raise ValueError(f"{method} checkpoint with {', '.join(problems)} cannot be loaded; "
                         f"{supported}")
    return QuantSpec(method, group, bool(qc.get("sym", qc.get("zero_point") is False)),
                     method == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq")


def _compressed_tensors_spec(qc: dict, supported: str) -> QuantSpec:
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if qc.get("format") != "pack-quantized" or len(weights) != 1:
        raise ValueError(f"compressed-tensors format {qc.get('format')!r} with {len(weights)} "
                         f"config groups cannot be loaded; {supported}")
    w = weights[0]
    strategy = w.get("strategy")
    group = w.get("group_size") if strategy == "group" else -1
    if w.get("num_bits") != 4 or w.get("type") != "int" or strategy not in ("group", "channel") \
            or (group != -1 and (not isinstance(group, int) or group % GROUP)) \
            or w.get("actorder") not in (None, False, "static"):
        raise ValueError(f"compressed-tensors weights {w} cannot be loaded; {supported}")
    return QuantSpec("compressed-tensors", group, bool(w.get("symmetric", True)))


def _unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., 8 n]: code j of each word at position 8 * word + j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 15).to(torch.uint8).flatten(-2)


def int4_blocks(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> GgufBlocks:
    """codes [out, in] (0..15), scales and zero points [out, in / g]: w = (q - z) * s."""
    out, in_features = codes.shape
    group = in_features // scales.shape[1]
    s = scales.to(torch.float16).float()
    per_group = zeros.to(torch.int16).repeat_interleave(group // GROUP, dim=1)
    subs = torch.stack([torch.ones_like(per_group), per_group], dim=-1)
    return GgufBlocks("W4", codes, torch.stack([s, -s], dim=-1), subs)


def read_int4(spec: QuantSpec, get: dict[str, torch.Tensor]) -> GgufBlocks:
    """One linear weight's blocks from its checkpoint tensors (`get`: by suffix)."""
    if spec.method == "awq":
        order = torch.tensor(AWQ_ORDER).argsort()  # position in the word of column j
        def columns(words: torch.Tensor) -> torch.Tensor:
            unpacked = _unpack(words).view(words.shape[0], -1, 8)
            return unpacked[..., order].flatten(1)
        codes, zeros = columns(get["qweight"]).t(), columns(get["qzeros"]).t()
        scales = get["scales"].t()
    elif spec.method == "gptq":
        if "g_idx" in get:
            want = torch.arange(get["g_idx"].numel()) // (
                get["g_idx"].numel() // get["scales"].shape[0])
            if not torch.equal(get["g_idx"].long(), want):
                raise ValueError("gptq g_idx is not in order (act-order): cannot be loaded")
        codes = _unpack(get["qweight"].t()).contiguous()  # [out, in]
        zeros = (_unpack(get["qzeros"]).to(torch.int16) + spec.zero_stored_minus_one).t()
        scales = get["scales"].t()
    else:  # compressed-tensors
        codes = _unpack(get["weight_packed"])
        out = codes.shape[0]
        if "weight_shape" in get:
            codes = codes[:, :int(get["weight_shape"][1])]
        scales = get["weight_scale"]
        if spec.symmetric:
            zeros = torch.full(scales.shape, 8, dtype=torch.int16)
        else:
            zeros = _unpack(get["weight_zero_point"].t())[:, :out].t()
    return int4_blocks(codes.contiguous(), scales.contiguous(), zeros.contiguous())


def read_fp8(get: dict[str, torch.Tensor], rows_at_once: int = 256) -> GgufBlocks:
    """Q8_0 blocks of an fp8 weight (see the module's note on the rounding), `rows_at_once`
    rows widened at a time."""
    weight = get["weight"]
    out, in_features = weight.shape
    scale = get.get("weight_scale_inv", get.get("weight_scale"))
    codes = torch.empty(out, in_features, dtype=torch.int8)
    d = torch.empty(out, in_features // GROUP)
    for start in range(0, out, rows_at_once):
        rows = weight[start:start + rows_at_once].float()
        if "weight_scale_inv" in get:  # [ceil(out / 128), ceil(in / 128)]
            block = scale[start // FP8_BLOCK:][:(rows.shape[0] + FP8_BLOCK - 1) // FP8_BLOCK]
            per_row = block.float().repeat_interleave(FP8_BLOCK, dim=0)[:rows.shape[0]]
            rows *= per_row.repeat_interleave(FP8_BLOCK, dim=1)[:, :in_features]
        else:
            rows *= scale.float().reshape(-1, 1)[start:start + rows.shape[0]] if \
                scale.numel() > 1 else scale.float()
        groups = rows.view(rows.shape[0], -1, GROUP)
        step = (groups.abs().amax(dim=-1) / 127).half().float()
        q = (groups / step.clamp_min(1e-30)[..., None]).round().clamp(-127, 127)
        codes[start:start + rows.shape[0]] = q.to(torch.int8).view(rows.shape[0], -1)
        d[start:start + rows.shape[0]] = step
    return GgufBlocks("Q8_0", codes, torch.stack([d, torch.zeros_like(d)], dim=-1), None)


def read_mxfp4(get: dict[str, torch.Tensor]) -> list[GgufBlocks]:
    """Stacked experts' MXFP4 tensors as one GgufBlocks per expert."""
    packed, exponents = get["blocks"], get["scales"]
    experts, out = packed.shape[:2]
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(experts, out, -1)
    return [mxfp4_blocks(codes[e].contiguous(), exponents[e].contiguous())
            for e in range(experts)]


def fp8_blocks(get: dict[str, torch.Tensor]) -> Fp8Blocks:
    """An fp8 weight as the checkpoint stores it (for CUDA): block scales expanded to rows."""
    weight = get["weight"]
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 weights of dtype {weight.dtype} cannot be loaded; supported: "
                         "float8_e4m3fn")
    out = weight.shape[0]
    if "weight_scale_inv" in get:
        scales = get["weight_scale_inv"].float().repeat_interleave(FP8_BLOCK, dim=0)[:out]
        return Fp8Blocks(weight, scales.contiguous(), FP8_BLOCK)
    scale = get["weight_scale"].float().reshape(-1)
    return Fp8Blocks(weight, (scale.expand(out) if scale.numel() == 1 else scale).contiguous())


class QuantizedReader:
    """A quantized checkpoint's linear weights as blocks, read one weight at a time when the
    loader takes it (`read`), so that only one whole weight's unpacked codes exist at once
    beside the shards the model keeps. A context manager: the files stay open inside it."""

    def __init__(self, folder: Path, spec: QuantSpec, device: torch.device) -> None:
        self.folder, self.spec, self.device = folder, spec, device
        self.parts: dict[str, dict[str, tuple]] = {}  # HF weight name -> {suffix: (file, key)}
        self.used: set[str] = set()  # the checkpoint tensors they come from
        self._files = ExitStack()

    def __enter__(self) -> QuantizedReader:
        from safetensors import safe_open

        method = self.spec.method
        stacked = method == "mxfp4"  # `{name}_blocks`: `name` is the dense experts' stack's
        by_prefix: dict[str, dict[str, tuple]] = {}
        for file in sorted(self.folder.glob("*.safetensors")):
            f = self._files.enter_context(safe_open(str(file), framework="pt"))
            for key in f.keys():
                prefix, _, suffix = key.rpartition("_" if stacked else ".")
                if suffix in SUFFIXES[method]:
                    by_prefix.setdefault(prefix, {})[suffix] = (f, key)
        for prefix, parts in by_prefix.items():
            if MARKS[method] & set(parts):
                self.parts[prefix if stacked else f"{prefix}.weight"] = parts
                self.used.update(key for _, key in parts.values())
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.close()

    def read(self, name: str) -> GgufBlocks | Fp8Blocks | list[GgufBlocks]:
        get = {suffix: f.get_tensor(key) for suffix, (f, key) in self.parts[name].items()}
        if self.spec.method == "mxfp4":
            return read_mxfp4(get)
        if self.spec.method != "fp8":
            return read_int4(self.spec, get)
        return read_fp8(get) if self.device.type == "cpu" else fp8_blocks(get)
