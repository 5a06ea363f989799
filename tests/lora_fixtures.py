"""Tiny random Llama models and random PEFT LoRA adapters for them, built in the test (fixed
seeds, saved by PEFT itself), and PEFT's merged model in float32 as the reference."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tests.reference import TOP2_MARGIN_BOUND

# 6 query / 3 KV heads: shards over 1 and 3 ranks
TINY_LORA_BASE = dict(vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_base(path: Path, family: str = "Llama", **overrides) -> None:
    """A tiny random base of `family` (Llama, Phi3: transformers' class name prefix)."""
    import transformers
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**{**TINY_LORA_BASE, **overrides},
                                                      tie_word_embeddings=False)
    getattr(transformers, f"{family}ForCausalLM")(config).eval().save_pretrained(path)


def _base_model(base: Path, layers: int | None):
    import transformers
    extra = {} if layers is None else {"num_hidden_layers": layers}
    return transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **extra)


def save_adapter(base: Path, path: Path, seed: int, rank: int = 8, alpha: int = 16,
                 targets: list[str] | None = None, layers: int | None = None,
                 b_scale: float = 4.0, **extra) -> Path:
    """A PEFT LoRA adapter with random A and B (init_lora_weights=False), B scaled by `b_scale`
    so that the adapter visibly changes greedy outputs. `layers`: of a reduced-depth base."""
    import peft
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                             init_lora_weights=False, **extra)
    peft_model = peft.get_peft_model(_base_model(base, layers), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    peft_model.save_pretrained(path)
    return path


@functools.lru_cache(maxsize=8)
def merged_model(base: Path, adapter: Path | None, layers: int | None = None):
    """PEFT's merged model in float32 (the base alone for None)."""
    import peft
    model = _base_model(base, layers)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


@torch.inference_mode()
def merged_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], new_tokens: int,
                  layers: int | None = None) -> list[list[int]]:
    model = merged_model(base, adapter, layers)
    outputs = []
    for ids in prompts:
        prompt = torch.tensor([ids])  # NOTE: the mask given: a prompt may hold the pad id
        outputs.append(model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist())
    return outputs


@torch.inference_mode()
def assert_lora_greedy(base: Path, adapter: Path | None, prompt: list[int], ours: list[int],
                       ref: list[int], layers: int | None = None) -> None:
    """Equal to the reference token for token, or first differing where the reference's
    top-2 logit margin is below TOP2_MARGIN_BOUND."""
    if ours == ref:
        return
    at = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    logits = merged_model(base, adapter, layers)(torch.tensor([prompt + ref[:at]])).logits[0, -1]
    top = logits.float().topk(2).values
    margin = float(top[0] - top[1])
    assert margin < TOP2_MARGIN_BOUND, (
        f"adapter {adapter}: greedy outputs differ at token {at} (reference top-2 margin "
        f"{margin:.4g}): ours {ours[at:at + 5]}, reference {ref[at:at + 5]}")


def assert_within_margin_of_merged(base: Path, adapters: dict[str, Path],
                                   prompts: list[list[int]], names: list[str | None],
                                   outs: list[dict], margin: float) -> None:
    """Each greedy token of `outs` within `margin` (logit units) of the argmax of PEFT's merged
    float32 model for its row's adapter, teacher-forced on our tokens."""
    for prompt, name, out in zip(prompts, names, outs):
        model = merged_model(base, None if name is None else adapters[name])
        ids = prompt + out["output_ids"]
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1].float()
        chosen = logits[torch.arange(len(out["output_ids"])), torch.tensor(out["output_ids"])]
        assert (logits.max(dim=-1).values - chosen).max() <= margin, name


def assert_adapter_and_base_rows_match_peft(base: Path, adapter: Path, targets: list[str],
                                            prompts: list[list[int]], new_tokens: int = 8
                                            ) -> None:
    """Each prompt served twice in one batch, with the adapter and without, greedy: each row
    equal to PEFT's merged model (or its base) within assert_lora_greedy's margin, and the
    adapter changes the outputs."""
    from minisgl.llm import LLM
    names = [name for _ in prompts for name in ("adapter", None)]
    rows = [prompt for prompt in prompts for _ in range(2)]
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    with LLM(model=str(base), dtype="float32", max_total_tokens=2048,
             lora_paths=[f"adapter={adapter}"], lora_target_modules=targets) as llm:
        outs = [r["output_ids"] for r in llm.generate(input_ids=rows, sampling_params=params,
                                                      lora_path=names)]
        llm.check_integrity()
    refs = {name: merged_greedy(base, None if name is None else adapter, prompts, new_tokens)
            for name in ("adapter", None)}
    for i, (name, prompt, ours) in enumerate(zip(names, rows, outs)):
        assert_lora_greedy(base, None if name is None else adapter, prompt, ours,
                           refs[name][i // 2])
    assert refs["adapter"] != refs[None]
