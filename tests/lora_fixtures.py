"""Tiny random Llama models and random PEFT LoRA adapters for them, built in the test (fixed
seeds, PEFT's own save format), and PEFT's merged model as the float32 reference."""

from __future__ import annotations

from pathlib import Path

import torch

# 6 query / 3 KV heads: shards over 1 and 3 ranks
TINY_LORA_BASE = dict(vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_base(path: Path) -> None:
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY_LORA_BASE, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)


def save_adapter(base: Path, path: Path, seed: int, rank: int = 8, alpha: int = 16,
                 targets: list[str] | None = None, **extra) -> None:
    """A PEFT LoRA adapter with random A and B (init_lora_weights=False), B scaled up so the
    adapter visibly changes greedy outputs."""
    import peft
    import transformers
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                             init_lora_weights=False, **extra)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    peft_model.save_pretrained(path)


def merged_greedy(base: Path, adapter: Path | None, prompts: list[list[int]],
                  new_tokens: int) -> list[list[int]]:
    """Greedy continuations by PEFT's merged model in float32 (the base alone: None)."""
    import peft
    import transformers
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
                for ids in prompts]
