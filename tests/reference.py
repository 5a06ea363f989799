"""The correctness reference: transformers in float32 on the same weights as our engine."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# Where two float32 implementations may legitimately pick different greedy tokens: only where
# the reference's top-2 logits are within this margin at the first differing position.
TOP2_MARGIN_BOUND = 1e-2

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHAT_QUESTIONS = ["What is the boiling point of water?", "Write a haiku about autumn."]


@functools.lru_cache(maxsize=1)
def model_folder() -> Path:
    from minisgl.models import resolve_model_path
    return resolve_model_path(None)


@functools.lru_cache(maxsize=1)
def hf_model():
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_folder(), dtype=torch.float32)
    return model.eval()


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_folder())


def chat_prompt(question: str) -> str:
    return tokenizer().apply_chat_template([{"role": "user", "content": question}],
                                           tokenize=False, add_generation_prompt=True)


def prompt_ids(text: str) -> list[int]:
    return tokenizer()(text)["input_ids"]


@torch.inference_mode()
def hf_logits(ids: list[int]) -> torch.Tensor:
    return hf_model()(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    out = hf_model().generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=2 if stop_at_eos else None,
                              pad_token_id=2)
    return out[0, len(ids):].tolist()


def top2_margin(ids: list[int]) -> float:
    top = hf_logits(ids)[-1].topk(2).values
    return float(top[0] - top[1])


def assert_greedy_matches(prompt: list[int], ours: list[int], ref: list[int],
                          bound: float = TOP2_MARGIN_BOUND) -> None:
    """Equal token for token, or first differing where the reference itself is undecided
    (its top-2 margin below `bound`)."""
    if ours == ref:
        return
    at = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    margin = top2_margin(prompt + ref[:at])
    assert margin < bound, (
        f"greedy outputs differ at token {at} where the reference top-2 margin is {margin:.4g} "
        f"(bound {bound}): ours {ours[at:at + 5]}, reference {ref[at:at + 5]}")
