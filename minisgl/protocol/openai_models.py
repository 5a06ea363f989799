"""What the OpenAI endpoints know of the served model: the names a request's `model` may use,
the model cards of /v1/models, and the settings chat requests follow (--sampling-defaults,
--tool-call-parser, --reasoning-parser and what the chat template does with the thinking)."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from minisgl.errors import InvalidRequest
from minisgl.flag_checks import HARMONY_PARSER
from minisgl.models import generation_defaults
from minisgl.protocol.reasoning import TemplateThinking, markers
from minisgl.runtime import Runtime

logger = logging.getLogger(__name__)

# NOTE: sglang-router fills a chat request's missing `model` with this name
ROUTER_PLACEHOLDER_MODEL = "unknown"
# distinct system messages whose effect on the template's thinking is kept (an LRU)
SYSTEM_MESSAGES_PROBED = 256


class UnknownModel(InvalidRequest):
    """A `model` this server does not serve (HTTP 404, code model_not_found)."""


@dataclass
class OpenAIModel:
    names: list[str]  # the served names; answers report the first (as vLLM does)
    aliases: set[str]  # what a request's `model` may name: a served name, the model's path
    strict: bool  # --strict-model-name: any other name is a 404
    context_len: int
    sampling_defaults: dict[str, Any]  # what chat requests that leave a sampling field out get
    tool_call_parser: str
    reasoning_parser: str | None = None
    # what the chat template's generation prompt holds of the thinking after a request's
    # system message (its text, or None without one)
    template_thinking: Callable[[str | None], TemplateThinking] = lambda system: (
        TemplateThinking())
    adapters: Callable[[], dict[str, str]] = dict  # the loaded LoRA adapters: name -> path
    lora: bool = False  # --enable-lora: `base:adapter` names an adapter
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def harmony(self) -> bool:
        """Chat answers are in the harmony format (reasoning, calls and answer together)."""
        return self.reasoning_parser == HARMONY_PARSER

    @classmethod
    def of(cls, runtime: Runtime) -> OpenAIModel:
        args = runtime.args
        defaults = (generation_defaults(runtime.model_path)
                    if args.sampling_defaults == "model" else {})
        if defaults:
            logger.info("chat requests default to the model's sampling parameters %s", defaults)
        aliases = {*runtime.served_names, str(runtime.model_path),
                   *([args.model_path] if args.model_path else [])}
        tokenizer = runtime.tokenizer
        thinking = (functools.lru_cache(maxsize=SYSTEM_MESSAGES_PROBED)(
            functools.partial(TemplateThinking.probe, tokenizer.chat_prompt,
                              marks=markers(args.reasoning_parser)))
            if args.reasoning_parser not in (None, HARMONY_PARSER) and tokenizer is not None
            else lambda system: TemplateThinking())
        return cls(list(runtime.served_names), aliases, args.strict_model_name,
                   runtime.context_len, defaults, args.tool_call_parser,
                   args.reasoning_parser, thinking, runtime.loaded_adapters, args.enable_lora)

    def card(self, name: str, root: str | None = None, parent: str | None = None
             ) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "minisgl",
                "root": root or name, "parent": parent, "max_model_len": self.context_len}

    def listing(self) -> dict[str, Any]:
        """/v1/models: the model's names, then each LoRA adapter (its parent: the model)."""
        adapters = [self.card(name, path, self.names[0])
                    for name, path in self.adapters().items()]
        return {"object": "list", "data": [self.card(name) for name in self.names] + adapters}

    def named_card(self, name: str) -> dict[str, Any]:
        """/v1/models/{name}: any name the model goes by, or a loaded adapter's."""
        adapters = self.adapters()
        if name in adapters:
            return self.card(name, adapters[name], self.names[0])
        if name not in self.aliases:
            raise UnknownModel(f"The model '{name}' does not exist")
        return self.card(name)

    def resolve(self, body: dict[str, Any]) -> tuple[str, str | None]:
        """(the name an answer reports, the LoRA adapter to use or None). `model` names an
        adapter as `base:adapter` (SGLang) or by its name alone (vLLM), and is reported as
        given. Otherwise the first served name, whichever name the request gave: any `model`
        is served (one model per server, as SGLang does), unless --strict-model-name asks for
        a 404 on names that are not the model's."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequest("model must be a string")
        if model == ROUTER_PLACEHOLDER_MODEL:
            model = None
        adapter = self._adapter(model) if model and self.lora else None
        if adapter is not None:
            return model, adapter
        if self.strict and model and model not in self.aliases:
            raise UnknownModel(f"The model `{model}` does not exist (this server serves "
                               f"`{self.names[0]}`).")
        return self.names[0], None

    def _adapter(self, model: str) -> str | None:
        adapters = self.adapters()
        if model in adapters:
            return model
        base, colon, adapter = model.rpartition(":")
        if not colon or (base not in self.aliases and self.strict):
            return None
        if adapter in adapters:
            return adapter
        if base in self.aliases:  # NOTE: the model's name with an adapter not loaded
            raise UnknownModel(f"The model `{model}` does not exist: no LoRA adapter "
                               f"`{adapter}` is loaded (loaded: {', '.join(adapters) or 'none'})")
        return None
