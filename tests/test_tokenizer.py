"""Loading the tokenizer: the folder's own tokenizer as AutoTokenizer picks it, without
importing the model's config class where the folder names transformers' generic fast tokenizer
(the bundled model's converted folder does)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from minisgl.models import resolve_model_path
from minisgl.runtime.tokenizer import IncrementalDetokenizer, Tokenizer, rust_decode
from tests.conftest import REPO_ROOT

TEXTS = ["The capital of France is", "<|im_start|>user\nhi<|im_end|>", "  spaces\tand\nlines ",
         "naïve café 東京 🙂"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def tokenizer_folder(tmp_path: Path, **changes: str) -> Path:
    """The bundled model's tokenizer files, with `changes` to config.json's model_type
    (`model_type`) or tokenizer_config.json (any other key)."""
    source = resolve_model_path(None)
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    if "model_type" in changes:
        config["model_type"] = changes.pop("model_type")
    (folder / "config.json").write_text(json.dumps(config))
    declared = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**declared, **changes}))
    return folder


@pytest.mark.parametrize("changes", [{}, {"model_type": "qwen2"}, {"model_type": "mistral"},
                                     {"tokenizer_class": "GPT2Tokenizer"}],
                         ids=["bundled", "incorrect-hub-class-type", "mistral", "gpt2-declared"])
def test_the_tokenizer_is_auto_tokenizers(tmp_path, changes: dict[str, str]) -> None:
    folder = tokenizer_folder(tmp_path, **changes)
    ours, auto = Tokenizer.load(folder).hf, AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    assert ours(TEXTS)["input_ids"] == auto(TEXTS)["input_ids"]
    assert ours.special_tokens_map == auto.special_tokens_map
    assert (ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
    ids = auto(TEXTS[3])["input_ids"]
    assert ours.decode(ids) == auto.decode(ids)


def test_the_bundled_tokenizer_loads_without_the_model_config_class() -> None:
    code = ("import sys; from minisgl.models import resolve_model_path; "
            "from minisgl.runtime.tokenizer import Tokenizer; "
            "Tokenizer.load(resolve_model_path(None)); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models.llama')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("clean_up", [False, True], ids=["as-shipped", "clean-up-spaces"])
def test_streamed_text_is_the_tokenizers_own_decode(tmp_path, clean_up: bool) -> None:
    """The detokenizer's decode (the Rust tokenizer's own where it gives the same text) against
    transformers' decode, for every window it decodes: a prompt's tokens, a stream's growing
    output split mid-character, special tokens skipped or kept."""
    folder = tokenizer_folder(tmp_path, clean_up_tokenization_spaces=clean_up)
    hf = Tokenizer.load(folder).hf
    detokenizer = IncrementalDetokenizer(hf)
    assert (rust_decode(hf) is None) == clean_up
    ids = [i for text in TEXTS + [" , . ! ? 's n't"] for i in hf(text)["input_ids"]]
    windows = [ids[start:end] for start in range(0, len(ids), 3)
               for end in range(start, len(ids) + 1, 2)]
    for skip in (True, False):
        kwargs = {"skip_special_tokens": skip, "spaces_between_special_tokens": True}
        assert (detokenizer._batch_decode(windows, **kwargs)
                == [hf.decode(w, skip_special_tokens=skip) for w in windows])
