"""How the bundled model does under JSON schemas with free whitespace (SGLang's default) and
without it (`--constrained-json-disable-any-whitespace`): the same chat prompts, greedy, through
`LLM.generate`, one request at a time (by default).

    python -m minisgl.bench json-whitespace --prompts-per-schema 10 --max-new-tokens 256

`--temperature T` samples instead (request i gets sampling_seed i), `--no-chat-template` sends
the user text bare (completion style), `--short-prompts` uses three terse prompts for every
schema instead ("Describe it as JSON.", "Here is some data:", "Output:", in turn; with
sampling, each turn has its own seed), `--batch` sends all requests in one call.

Per setting: schema-valid rate (`jsonschema.validate(json.loads(text))`), requests that hit
max_new_tokens (and of those, how many were emitting a whitespace run when cut), mean output
tokens, mean tok/s (each request's output tokens / its end-to-end latency), outputs holding a
newline outside strings, and the valid count per schema.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from typing import Any

import jsonschema

from minisgl import LLM

FLAT = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "email": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "age", "email", "city"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "company": {"type": "string"}, "founded": {"type": "integer"},
    "address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "country": {"type": "string"}},
        "required": ["street", "city", "country"], "additionalProperties": False},
    "ceo": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}},
    "required": ["company", "founded", "address", "ceo"], "additionalProperties": False}
ARRAY = {"type": "array", "minItems": 1, "maxItems": 5, "items": {
    "type": "object", "properties": {
        "item": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
    "required": ["item", "quantity"], "additionalProperties": False}}
ENUMS = {"type": "object", "properties": {
    "category": {"type": "string", "enum": ["electronics", "clothing", "food", "toys"]},
    "price": {"type": "number", "minimum": 0},
    "rating": {"type": "number", "minimum": 0, "maximum": 5},
    "in_stock": {"type": "boolean"}},
    "required": ["category", "price", "rating", "in_stock"], "additionalProperties": False}

SUBJECTS = {
    "flat object": ("Give me a JSON object with the name, age, email and city of {}.", [
        "a retired teacher from Lyon", "a young software engineer", "a famous chef",
        "a marathon runner", "a librarian in Boston", "a jazz musician", "a farmer in Kenya",
        "a student in Tokyo", "a pilot", "a fictional detective"]),
    "nested object": ("Describe {} as JSON: company name, year founded, address (street, city, "
                      "country) and CEO (name, age).", [
                          "a small bakery", "a car maker", "a tech startup", "a bank",
                          "a toy company", "a coffee chain", "an airline", "a bookstore",
                          "a shipping firm", "a video game studio"]),
    "array of objects": ("List the things I need for {} as a JSON array of objects with item "
                         "and quantity.", [
                             "a picnic", "baking a cake", "a camping trip", "a birthday party",
                             "painting a room", "a beach day", "making pancakes",
                             "a school year", "a garden", "a road trip"]),
    "enums and numbers": ("Describe {} as JSON: category (electronics, clothing, food or toys), "
                          "price, rating from 0 to 5, and whether it is in stock.", [
                              "a laptop", "a winter jacket", "a box of chocolates",
                              "a teddy bear", "a smartphone", "running shoes", "a pizza",
                              "a puzzle", "headphones", "a wool scarf"]),
}
SCHEMAS = {"flat object": FLAT, "nested object": NESTED, "array of objects": ARRAY,
           "enums and numbers": ENUMS}
SHORT = ["Describe it as JSON.", "Here is some data:", "Output:"]
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def requests(llm: LLM, per_schema: int, chat: bool, short: bool) -> list[tuple[str, str]]:
    """(schema name, prompt) pairs, the same for every setting."""
    out = []
    for name, (template, subjects) in SUBJECTS.items():
        for i in range(per_schema):
            text = SHORT[i % len(SHORT)] if short else template.format(subjects[i])
            out.append((name, llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False,
                add_generation_prompt=True) if chat else text))
    return out


def valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_schemas(flag: bool, args: argparse.Namespace) -> dict[str, Any]:
    with LLM(dtype=args.dtype, constrained_json_disable_any_whitespace=flag) as llm:
        prompts = requests(llm, args.prompts_per_schema, not args.no_chat_template,
                           args.short_prompts)
        params = [{"temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                   "sampling_seed": i, "json_schema": json.dumps(SCHEMAS[name])}
                  for i, (name, _) in enumerate(prompts)]
        llm.generate(prompt=prompts[0][1], sampling_params={  # warm-up: compile, first pass
            **params[0], "max_new_tokens": 4})
        if args.batch:
            outs = llm.generate(prompt=[p for _, p in prompts], sampling_params=params)
        else:
            outs = [llm.generate(prompt=p, sampling_params=sp)
                    for (_, p), sp in zip(prompts, params)]
        rows = []
        for (name, _), out in zip(prompts, outs):
            meta, text = out["meta_info"], out["text"]
            skeleton = STRING.sub('""', text)
            rows.append({"schema": name, "text": text, "valid": valid(text, SCHEMAS[name]),
                         "length": meta["finish_reason"]["type"] == "length",
                         "ws_tail": bool(re.search(r"\s{16}$", skeleton)),
                         "newline": "\n" in skeleton,
                         "tokens": meta["completion_tokens"],
                         "tok_s": meta["completion_tokens"] / meta["e2e_latency"]})
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts-per-schema", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-chat-template", action="store_true")
    parser.add_argument("--short-prompts", action="store_true")
    parser.add_argument("--batch", action="store_true")
    parser.add_argument("--show", action="store_true", help="print every output")
    args = parser.parse_args()
    if args.prompts_per_schema > 10 and not args.short_prompts:
        parser.error("--prompts-per-schema is at most 10 (the subjects there are) without "
                     "--short-prompts")
    settings = {"any whitespace (default)": False,
                "compact (--constrained-json-disable-any-whitespace)": True}
    results = {label: run_schemas(flag, args)["rows"] for label, flag in settings.items()}
    n = len(next(iter(results.values())))
    print(f"{n} requests ({args.prompts_per_schema} per schema x {len(SCHEMAS)} schemas), "
          f"{'temperature %g' % args.temperature if args.temperature else 'greedy'}, "
          f"{'bare' if args.no_chat_template else 'chat'}"
          f"{' short' if args.short_prompts else ''} prompts, max_new_tokens "
          f"{args.max_new_tokens}, {'one batch' if args.batch else 'one at a time'}")
    print("| setting | schema-valid | hit length (in whitespace) | mean output tokens "
          "| mean tok/s | newline outside strings |")
    print("|---|---|---|---|---|---|")
    for label, rows in results.items():
        ok = sum(r["valid"] for r in rows)
        length = sum(r["length"] for r in rows)
        tail = sum(r["length"] and r["ws_tail"] for r in rows)
        print(f"| {label} | {ok}/{n} ({100 * ok / n:.0f}%) | {length} ({tail}) "
              f"| {statistics.mean(r['tokens'] for r in rows):.1f} "
              f"| {statistics.mean(r['tok_s'] for r in rows):.1f} "
              f"| {sum(r['newline'] for r in rows)} |")
    print()
    print("| setting | " + " | ".join(SCHEMAS) + " |")
    print("|---|" + "---|" * len(SCHEMAS))
    for label, rows in results.items():
        counts = [f"{sum(r['valid'] for r in rows if r['schema'] == s)}/"
                  f"{sum(r['schema'] == s for r in rows)}" for s in SCHEMAS]
        print(f"| {label} | " + " | ".join(counts) + " |")
    if args.show:
        for label, rows in results.items():
            print(f"\n# {label}")
            for r in rows:
                print(f"[{r['schema']}] valid={r['valid']} tokens={r['tokens']} "
                      f"{r['text']!r}")


if __name__ == "__main__":
    main()
