"""`--seed` (SGLang's `--random-seed`): requests without a sampling_seed draw from one generator
seeded by it, so two servers started with the same seed sample the same outputs for the same
requests run in the same batches."""

from __future__ import annotations

import torch

from minisgl import LLM
from minisgl.__main__ import _parser
from minisgl.args import ServerArgs
from minisgl.core import Req, SamplingParams
from minisgl.engine.sampler import Sampler

SAMPLED = {"max_new_tokens": 8, "temperature": 1.0}


def test_random_seed_is_seeds_spelling_in_sglang() -> None:
    for argv in (["serve", "--random-seed", "5"], ["serve", "--seed", "5"]):
        assert ServerArgs.from_cli(_parser().parse_args(argv)).seed == 5


def test_samplers_with_one_seed_draw_the_same_tokens() -> None:
    vocab = 64
    logits = torch.zeros(4, vocab)  # uniform: each draw is the generator's alone
    reqs = [Req(uid=i, rid=str(i), prompt_ids=[1], params=SamplingParams(temperature=1.0))
            for i in range(4)]

    def draws(seed: int) -> list[list[int]]:
        sampler = Sampler(vocab, torch.device("cpu"), [0], seed=seed)
        args = sampler.sampling_args(reqs, [1] * 4, [0] * 4, list(range(4)), [1] * 4)
        pool = torch.zeros(4, 8, dtype=torch.int32)
        return [sampler.sample(logits, args, pool).next_tokens.tolist() for _ in range(5)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_two_engines_with_one_seed_sample_the_same_outputs() -> None:
    def outputs(seed: int) -> list[list[int]]:
        with LLM(load_format="dummy", json_model_override_args='{"num_hidden_layers": 2}',
                 max_total_tokens=1024, seed=seed) as llm:
            return [llm.generate(input_ids=[1, 2, 3], sampling_params=SAMPLED)["output_ids"]
                    for _ in range(2)]

    first = outputs(11)
    assert first[0] != first[1]  # it really samples: the generator moves on
    assert outputs(11) == first
