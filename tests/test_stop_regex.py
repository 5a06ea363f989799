"""`sampling_params.stop_regex` (SGLang's): a real server with the bundled model, greedy. Each
pattern is derived from an unstopped run's text, and the stopped run must give that text cut
at the end of the first match (the match stays in the text), finish_reason
{"type": "stop", "matched": pattern}."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT
from tests.test_server import assert_error, generate, get, post, stream

PROMPT = "Once upon a time"
NEW_TOKENS = 24
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
SGLANG_PYTHON = Path(os.environ.get("MINISGL_SGLANG_PYTHON",
                                    REPO_ROOT / ".venv-sglang/bin/python"))


def run(server: Any, **sampling: Any) -> dict[str, Any]:
    return generate(server, {"text": PROMPT, "sampling_params": {**GREEDY, **sampling}})


@pytest.fixture(scope="module")
def free(minisgl_server) -> dict[str, Any]:
    """The unstopped greedy run every pattern is derived from."""
    return run(minisgl_server)


def word_patterns(text: str) -> list[tuple[str, int]]:
    """(pattern, end of its first match) for each distinct word followed by a non-word
    character, in order of that first match. A pattern of fixed length without end-of-text
    assertions matches in the text generated so far exactly where it matches in the whole."""
    seen, out = set(), []
    for m in re.finditer(r"\b([A-Za-z]{3,})\W", text):
        if m.group(1) not in seen:
            seen.add(m.group(1))
            pattern = rf"\b{m.group(1)}\W"
            out.append((pattern, re.search(pattern, text).end()))
    return out


def assert_stopped(out: dict[str, Any], free: dict[str, Any], text: str, matched: str) -> None:
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": matched}
    assert out["text"] == text
    ids = out["output_ids"]
    assert 0 < len(ids) < len(free["output_ids"]) and ids == free["output_ids"][:len(ids)]


def test_stops_at_the_end_of_the_first_match_and_keeps_it(minisgl_server, free):
    patterns = word_patterns(free["text"])
    assert len(patterns) >= 3, free["text"]
    pattern, end = patterns[1]
    out = run(minisgl_server, stop_regex=pattern)
    assert_stopped(out, free, free["text"][:end], pattern)
    # streaming: the same final text, and the text only grows
    chunks = stream(minisgl_server, {"text": PROMPT, "sampling_params": {
        **GREEDY, "stop_regex": pattern}})
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
    assert texts[-1] == out["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == out["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_a_list_stops_at_the_match_that_ends_first(minisgl_server, free):
    patterns = word_patterns(free["text"])
    (early, end), (late, _) = patterns[1], patterns[-1]
    never = r"\d{7}zq"
    out = run(minisgl_server, stop_regex=[never, late, early])
    assert_stopped(out, free, free["text"][:end], early)
    unmatched = run(minisgl_server, stop_regex=[never])
    assert unmatched["text"] == free["text"] and unmatched["output_ids"] == free["output_ids"]
    assert unmatched["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
    # an empty list asks for nothing (SGLang's frontend sends one with every gen)
    few = run(minisgl_server, stop_regex=[], max_new_tokens=3)
    assert few["output_ids"] == free["output_ids"][:3]


def test_stop_strings_and_regexes_whichever_ends_first(minisgl_server, free):
    text = free["text"]
    patterns = word_patterns(text)
    (early, early_end), (late, late_end) = patterns[1], patterns[-1]
    late_word = re.match(r"\\b(\w+)", late).group(1)
    early_word = re.match(r"\\b(\w+)", early).group(1)
    # the regex ends first: its match is kept
    assert early_end < text.find(" " + late_word) + len(late_word) + 1
    out = run(minisgl_server, stop_regex=early, stop=" " + late_word)
    assert_stopped(out, free, text[:early_end], early)
    # the stop string ends first: trimmed as usual
    at = text.find(early_word)
    assert at + len(early_word) < late_end
    out = run(minisgl_server, stop_regex=late, stop=early_word)
    assert_stopped(out, free, text[:at], early_word)
    chunks = stream(minisgl_server, {"text": PROMPT, "sampling_params": {
        **GREEDY, "stop_regex": late, "stop": early_word}})
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == text[:at]


def test_openai_completions_stop_regex(minisgl_server, free):
    pattern, end = word_patterns(free["text"])[1]
    r = post(minisgl_server, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
        "stop_regex": pattern})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == free["text"][:end]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == pattern


def test_bad_stop_regex_is_a_400_naming_it(minisgl_server):
    for value, contains in (("(", "missing )"), ("a{2,1}", "min repeat greater than max repeat"),
                            ("(?<=a+)b", "look-behind"), (5, "stop_regex"), ([""], "stop_regex"),
                            (["ok", 3], "stop_regex"), ("(?:a{100}){100}", "expand"),
                            (["x"] * 65, "--max-stop-strings"),
                            ("y" * 1025, "--max-stop-string-length")):
        error = assert_error(post(minisgl_server, "/generate", {
            "text": PROMPT, "sampling_params": {"stop_regex": value}}), 400, contains)
        assert "stop_regex" in error["message"], error
    error = assert_error(post(minisgl_server, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 4, "stop_regex": "(a"}), 400, "stop_regex")
    assert "missing )" in error["message"]


def test_a_pattern_that_takes_too_long_aborts_only_its_request(minisgl_server):
    token = generate(minisgl_server, {"text": "a", "sampling_params": {"max_new_tokens": 0},
                                      "return_prompt_token_ids": True})["prompt_token_ids"]
    assert len(token) == 1  # "a": forced below, so the text is "aaaa..."
    began = time.monotonic()
    out = generate(minisgl_server, {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 64, "temperature": 0, "ignore_eos": True,
        "logit_bias": {str(token[0]): 100}, "stop_regex": r"(a|a)+b"}})  # exponential
    assert time.monotonic() - began < 60
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "stop_regex" in reason["message"], reason
    assert "took too long" in reason["message"]
    assert set(out["text"]) == {"a"} and len(out["output_ids"]) < 64
    assert get(minisgl_server, "/health").status_code == 200
    assert run(minisgl_server, max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def test_llm_generate_stop_regex():
    from minisgl import LLM
    from minisgl.errors import InvalidRequest

    with LLM(dtype="float32", json_model_override_args='{"num_hidden_layers": 2}') as llm:
        free = llm.generate(prompt=PROMPT, sampling_params=GREEDY)
        pattern, end = word_patterns(free["text"])[0]
        out = llm.generate(prompt=PROMPT, sampling_params={**GREEDY, "stop_regex": [pattern]})
        assert_stopped(out, free, free["text"][:end], pattern)
        with pytest.raises(InvalidRequest, match="stop_regex"):
            llm.generate(prompt=PROMPT, sampling_params={"stop_regex": "["})


SGL_PROGRAM = """
import json, sys
import sglang as sgl

url, prompt, pattern, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

@sgl.function
def answer(s):
    s += prompt
    s += sgl.gen("x", stop_regex=pattern, max_tokens=tokens, temperature=0)

state = answer.run(backend=sgl.RuntimeEndpoint(url))
print(json.dumps({"x": state["x"], "meta": state.get_meta_info("x")}))
"""


@pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="no SGLang client venv: run `make test`")
def test_sglang_frontend_gen_stop_regex(minisgl_server, tmp_path):
    free = generate(minisgl_server, {"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": NEW_TOKENS}})
    pattern, _ = word_patterns(free["text"])[1]
    done = subprocess.run(
        [str(SGLANG_PYTHON), "-c", SGL_PROGRAM, minisgl_server.url, PROMPT, pattern,
         str(NEW_TOKENS)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    ours = generate(minisgl_server, {"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": NEW_TOKENS, "stop_regex": pattern}})
    assert got["x"] == ours["text"] and re.search(pattern, got["x"]).end() == len(got["x"])
    assert got["meta"]["finish_reason"] == {"type": "stop", "matched": pattern}


class CharTokenizer:
    """Token id = a character's code point (what the detokenizer needs of a tokenizer)."""

    def batch_decode(self, seqs: list[list[int]], **_: Any) -> list[str]:
        return ["".join(map(chr, ids)) for ids in seqs]


@pytest.mark.parametrize("pattern", [r"\bab\b", r"a(?=bc)", r"(?<=x)y", r"^ab", r"b$", r"a\B",
                                     r"(?:ab|b)c", r"x.*y", r"(a)\1", r"c{2,3}", r"(?!a)b\b"])
def test_incremental_search_finds_what_a_full_search_of_each_prefix_finds(pattern):
    """Searching only from where a new match can start gives the full search's answer, with
    tokens of 1-3 characters (the match kept, never cut before text already shown)."""
    import random

    from minisgl.core import SamplingParams
    from minisgl.runtime.tokenizer import DecodeState, IncrementalDetokenizer

    rng = random.Random(pattern)
    detok = IncrementalDetokenizer(CharTokenizer())
    for _ in range(200):
        chunks = ["".join(rng.choice("abcxy ") for _ in range(rng.randint(1, 3)))
                  for _ in range(12)]
        state = DecodeState.start([], SamplingParams(stop_regex=pattern))
        shown, want = "", None
        for chunk in chunks:  # the reference: search each whole prefix
            match = re.search(pattern, shown + chunk)
            if match:
                want = (shown + chunk)[:max(match.end(), len(shown))]
                break
            shown += chunk
        got = None
        for chunk in chunks:  # one token per character, one step per chunk
            if detok.step([(state, ord(ch), False) for ch in chunk]):
                got = state.visible_text
                assert state.finish_reason == {"type": "stop", "matched": pattern}
                break
        assert got == want, (pattern, chunks)
