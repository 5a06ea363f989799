"""Grammar backends: compile a (kind, text) grammar once, then make one matcher per request.

Kinds, with SGLang's names: `json_schema` (a JSON schema, as a string), `regex`, `ebnf`
(xgrammar's EBNF), `structural_tag` (JSON: xgrammar's `{"type": "structural_tag", "format":
...}`, or SGLang's older `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import OrderedDict
from typing import Any

from minisgl.errors import InvalidRequest
from minisgl.grammar.matcher import Matcher, ReasonerMatcher

logger = logging.getLogger(__name__)

CACHE_SIZE = 1024  # compiled grammars kept (least recently used go first)
# xgrammar's messages start with "[hh:mm:ss] /project/cpp/file.cc:123: "
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def builtin_structural_tag(model_format: str, **options: Any) -> dict[str, Any]:
    """xgrammar's structural tag for a model family's output format (`harmony`, ...: its
    reasoning and tool calls), as JSON; `options` are get_builtin_structural_tag's."""
    try:
        import xgrammar
    except ImportError as e:
        raise InvalidRequest(f"constrained output in the {model_format} format needs "
                             "xgrammar") from e
    return xgrammar.get_builtin_structural_tag(model_format, **options).model_dump(mode="json")


class GrammarBackend:
    """Refuses every grammar: `--grammar-backend none`, or xgrammar missing."""

    name = "none"

    def __init__(self, reason: str = "grammar-constrained decoding is off "
                 "(--grammar-backend none)") -> None:
        self.reason = reason

    async def compile(self, kind: str, text: str) -> Any:
        raise InvalidRequest(f"{kind}: {self.reason}")

    def matcher(self, compiled: Any, after: str | None = None) -> Matcher:
        raise InvalidRequest(self.reason)


class XGrammarBackend(GrammarBackend):
    """`any_whitespace` (SGLang's default; off with --constrained-json-disable-any-whitespace):
    a JSON schema lets the model put any whitespace between tokens (`{"a": 1}`, `{"a":1}`,
    indented, ...); off, only one line in json.dumps's form, `{"a": 1, "b": 2}` (xgrammar's
    default separators, as SGLang compiles it). Fixed per backend, so the cache of compiled
    grammars never mixes the two."""

    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, any_whitespace: bool = True) -> None:
        import xgrammar

        super().__init__()
        self._xgr = xgrammar
        self.any_whitespace = any_whitespace
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self._token_bytes: list[bytes] = info.decoded_vocab
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def _compile(self, kind: str, text: str) -> Any:
        if kind == "json_schema":
            # NOTE: as SGLang, no cap on the whitespace between tokens (its
            # --constrained-json-max-whitespace-cnt is unset by default)
            return self._compiler.compile_json_schema(text, any_whitespace=self.any_whitespace)
        if kind == "regex":
            return self._compiler.compile_regex(text)
        if kind == "ebnf":
            return self._compiler.compile_grammar(text)
        if kind == "structural_tag":
            return self._compile_structural_tag(text)
        raise InvalidRequest(f"unknown grammar kind {kind!r}")

    def _compile_structural_tag(self, text: str) -> Any:
        tag = json.loads(text)
        if not isinstance(tag, dict):
            raise InvalidRequest("structural_tag must be a JSON object")
        if "structures" not in tag:
            if not self.any_whitespace:
                _bound_whitespace(tag)
                text = json.dumps(tag)
            return self._compiler.compile_structural_tag(text)
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not (isinstance(structures, list) and isinstance(triggers, list) and all(
                isinstance(s, dict) and {"begin", "schema", "end"} <= set(s)
                for s in structures)):
            raise InvalidRequest("structural_tag: structures must be a list of {begin, schema, "
                                 "end} and triggers a list of strings")
        items = [self._xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                             end=s["end"]) for s in structures]
        return self._compiler.compile_structural_tag(items, triggers)

    async def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar (cached by kind and text), compiled on a worker thread: the
        request waits for it, the event loop does not. Raises InvalidRequest with the
        compiler's message."""
        key = (kind, text)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        try:
            compiled = await asyncio.to_thread(self._compile, kind, text)
        except InvalidRequest:
            raise
        except Exception as exc:  # the compiler's parse error
            message = _LOCATION.sub("", str(exc).strip().splitlines()[0] if str(exc) else "")
            raise InvalidRequest(f"invalid {kind}: {message or type(exc).__name__}") from None
        self._cache[key] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: Any, after: str | None = None) -> Matcher:
        """A fresh matcher; `after`: the grammar applies to the output after this text
        (the end of a reasoning model's thinking), anything goes before it."""
        matcher = self._xgr.GrammarMatcher(compiled)
        return ReasonerMatcher(matcher, after.encode(), self._token_bytes) if after else matcher


def _bound_whitespace(node: Any) -> None:
    """The JSON contents of a structural tag allow one whitespace character at a time where
    they do not say otherwise (structural tags have no one-line form; this keeps a model from
    writing whitespace without end)."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and node.get("max_whitespace_cnt") is None:
            node["max_whitespace_cnt"] = 1
        for value in node.values():
            _bound_whitespace(value)
    elif isinstance(node, list):
        for value in node:
            _bound_whitespace(value)


def create_grammar_backend(name: str, hf_tokenizer: Any | None, vocab_size: int,
                           any_whitespace: bool = True) -> GrammarBackend:
    if name == "none":
        return GrammarBackend()
    if hf_tokenizer is None:
        return GrammarBackend("grammar-constrained decoding needs a tokenizer; this model has "
                              "none")
    try:
        return XGrammarBackend(hf_tokenizer, vocab_size, any_whitespace)
    except ImportError:
        logger.warning("xgrammar is not installed: requests with a grammar will be refused")
        return GrammarBackend("xgrammar is not installed (pip install xgrammar)")
