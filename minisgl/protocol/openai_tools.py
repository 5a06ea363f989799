"""Tool calls on /v1/chat/completions: the tools go into the prompt, `required` and a named
function are grammar-constrained (the call always parses and its arguments follow the
function's schema), and `auto` output is parsed (`--tool-call-parser`), as it streams, by
openai_tool_parser; when a tool is `strict`, each call the model opens under `auto` is
constrained to its function's schema too (a structural tag: free text until the call's
opening tag, then the call's form). `parallel_tool_calls: false` bounds `required` to one call and keeps only
the first call of an `auto` answer.

Prompt: a chat template that takes `tools` gets them. Otherwise a system message lists them
and asks for calls in the hermes style, which the default parser reads:
    <tool_call>
    {"name": "<function>", "arguments": {...}}
    </tool_call>
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from minisgl.errors import InvalidRequest
from minisgl.protocol.fields import check_bool, none_as
from minisgl.protocol.openai_gemma4 import Gemma4CallParser
from minisgl.protocol.openai_pythonic import PythonicCallParser
from minisgl.protocol.openai_tool_parser import ToolCallParser

AutoParser = ToolCallParser | PythonicCallParser | Gemma4CallParser

# --tool-call-parser's names (SGLang's) -> the parser style that reads them; Qwen2.5's calls are
# hermes-style <tool_call> blocks
PARSER_STYLES = {"hermes": "hermes", "qwen25": "hermes", "llama3": "llama3",
                 "mistral": "mistral", "pythonic": "pythonic", "gemma4": "gemma4"}
# the styles whose calls are markers of special tokens the answer's text must keep
SPECIAL_TOKEN_STYLES = ("gemma4",)
# parser style -> (trigger, begin with the function's JSON name, end) of a call the strict
# tools' grammar constrains (the forms the parsers read)
STRICT_CALL_FORMATS = {
    "hermes": ("<tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"),
    "llama3": ('{"name": ', '{{"name": {name}, "parameters": ', "}"),
    "mistral": ("[TOOL_CALLS]", '[TOOL_CALLS] [{{"name": {name}, "arguments": ', "}]"),
}
DEFAULT_PROMPT = (
    "You can call functions. Here they are, as JSON schemas:\n{tools}\n"
    "To call one, answer with\n<tool_call>\n"
    '{{"name": <function name>, "arguments": <the arguments as a JSON object>}}\n</tool_call>')


@dataclass
class ToolUse:
    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}}
    choice: str  # "auto", "required", or the one function's name
    parallel: bool = True  # parallel_tool_calls: false allows one call

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def strict(self) -> bool:
        return any(t["function"].get("strict") for t in self.tools)

    def grammar(self, parser: str, answer: tuple[str, str] | None
                ) -> tuple[str, str] | None:
        """(kind, text) of the grammar the answer must follow, given `answer`'s (the request's
        own format, or None). A named function: its arguments; `required`: a non-empty JSON
        list of calls (one at most without parallel calls); `auto`: free text (or `answer`)
        where, if a tool is strict, each call the model opens in --tool-call-parser's format
        follows its function's schema (an xgrammar structural tag)."""
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                   for t in self.tools}
        if self.choice == "auto":
            return self._strict_calls(parser, schemas, answer) if self.strict else answer
        if answer is not None:
            raise InvalidRequest("tool_choice required or a named function constrains the "
                                 "answer already: drop response_format / regex / ebnf")
        if self.choice != "required":
            return "json_schema", json.dumps(schemas[self.choice])
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, schema in schemas.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return "json_schema", json.dumps(array)

    def _strict_calls(self, parser: str, schemas: dict[str, Any],
                      answer: tuple[str, str] | None) -> tuple[str, str]:
        call_format = STRICT_CALL_FORMATS.get(PARSER_STYLES[parser])
        if call_format is None:
            raise InvalidRequest(f"strict function tools under tool_choice auto need calls "
                                 f"written as JSON; --tool-call-parser {parser} reads calls "
                                 "of another syntax (set strict false, or serve with hermes, "
                                 "qwen25, llama3 or mistral)")
        trigger, begin, end = call_format
        tags = [{"type": "tag", "begin": begin.format(name=json.dumps(name)),
                 "content": {"type": "json_schema", "json_schema": schema}, "end": end}
                for name, schema in schemas.items()]
        if answer is None:
            form: dict[str, Any] = {"type": "triggered_tags", "triggers": [trigger],
                                    "tags": tags, "at_least_one": False,
                                    "stop_after_first": not self.parallel}
        elif answer[0] == "json_schema":  # either the answer's JSON or calls
            form = {"type": "or", "elements": [
                {"type": "json_schema", "json_schema": json.loads(answer[1])},
                {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                 "at_least_one": True, "stop_after_first": not self.parallel}]}
        else:
            raise InvalidRequest(f"strict function tools with a {answer[0]} answer format are "
                                 "not supported by minisgl (set strict false, or ask for a "
                                 "JSON schema)")
        return "structural_tag", json.dumps({"type": "structural_tag", "format": form})

    def parser(self, parser: str) -> AutoParser:
        """A fresh parser for one choice: `parser` (--tool-call-parser) reads `auto` text."""
        names = set(self.names)
        if self.choice == "auto":
            return auto_parser(parser, names, one_call=not self.parallel)
        if self.choice == "required":
            return ToolCallParser("array", names, one_call=not self.parallel)
        return ToolCallParser("named", names, named=self.choice)


def parse_calls(text: str, parser: str, names: set[str]
                ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished free text; what is not a call stays content."""
    return auto_parser(parser, names).parse(text)


def auto_parser(parser: str, names: set[str], one_call: bool = False) -> AutoParser:
    """The parser of `auto` answers that --tool-call-parser `parser` names."""
    if PARSER_STYLES[parser] == "pythonic":
        return PythonicCallParser(names, one_call)
    if PARSER_STYLES[parser] == "gemma4":
        return Gemma4CallParser(names, one_call)
    return ToolCallParser(PARSER_STYLES[parser], names, one_call=one_call)


def _load(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def parse_tool_use(body: dict[str, Any]) -> ToolUse | None:
    """The request's tools, tool_choice and parallel_tool_calls, checked; None when no tool
    may be called."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = check_bool(none_as(body.get("parallel_tool_calls"), True), "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools")
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type", "function") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"]
            for t in tools):
        raise InvalidRequest("tools must be a list of {\"type\": \"function\", \"function\": "
                             "{\"name\", \"description\", \"parameters\"}}")
    for tool in tools:
        parameters = tool["function"].get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequest(f"tools: {tool['function']['name']}.parameters must be a "
                                 "JSON schema object")
    names = [t["function"]["name"] for t in tools]
    if choice in (None, "auto", "none", "required"):
        return None if choice == "none" else ToolUse(tools, choice or "auto", parallel)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools "
                                 f"({', '.join(names)})")
        return ToolUse(tools, name, parallel)
    raise InvalidRequest("tool_choice must be none, auto, required or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def render_tools(messages: list[dict[str, Any]], use: ToolUse, template_takes_tools: bool
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template kwargs) that put the tools into the prompt; earlier calls
    and their results are written as text where the template cannot take them."""
    if template_takes_tools:
        return messages, {"tools": use.tools}
    listing = "\n".join(json.dumps(t["function"]) for t in use.tools)
    system = DEFAULT_PROMPT.format(tools=listing)
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": _load(c["function"]["arguments"])
                                              or {}}) + "\n</tool_call>"
                for c in m["tool_calls"])
            m = {"role": "assistant", "content": (m.get("content") or "") + calls}
        out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}
