"""A soak test: one minisgl server with LoRA, priority scheduling and NGRAM speculation on at
once, under closed-loop mixed traffic that keeps its KV pool full (so requests are retracted
and preempted), for --minutes; then its end state is checked.

What it measures, per request kind: answers ok, intended aborts, 4xx, 5xx, unanswered (a
timeout or a connection the server dropped) and invalid (a 200 whose content fails the kind's
check), with end-to-end latency p50 / p99. Every --interval seconds: the server's resident
memory, open files and threads, its KV pool and queues, retractions and preemptions so far,
latency and time to first token over the interval, errors so far (one line each).

The verdict: after the traffic stops and /flush_cache, the pool is empty, nothing runs or
waits and the scheduler's integrity check found nothing; no request went unanswered or got a
5xx, a 4xx or an invalid answer; resident memory grew less than --rss-growth-bound from the
end of the warm-up to the last sample; retraction and preemption both happened (the pool was
full); every greedy probe equals its reference, run alone on the idle server first, or first
differs where the reference's top-2 logprob margin is below --margin-bound.

    python -m minisgl.bench soak                    # an hour on the bundled model
    python -m minisgl.bench soak --minutes 3
    python -m minisgl.bench soak --minutes 1 --dtype float32 --server-args \\
        "--load-format dummy --json-model-override-args '{\\"num_hidden_layers\\": 2}'"

Writes series.json (samples, outcomes, tables) and soak.png into --out; prints the tables in
Markdown and exits with 1 if a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from minisgl.bench.compare import ServerProcess, log, start_minisgl
from minisgl.bench.lora import save_random_adapter
from minisgl.bench.plot import Panel, draw_panels
from minisgl.bench.serving import sse_messages
from minisgl.server.timeline import percentile

ADAPTER = "soak"
RANK = 8
WORDS = ("river stone light garden window music letter morning winter city road forest "
         "market paper engine signal harbor lantern valley bridge station orchard ribbon "
         "compass thunder meadow candle mirror anchor").split()
PROBES = ["The capital of France is", "Write a short poem about the sea:",
          "def fibonacci(n):", "The three primary colors are"]
LORA_PROBE = "Once upon a time, in a small village,"
PROBE_TOKENS = 24
HIGH_PRIORITY, LOW_PRIORITY = 20, 0
CITIES = ["Paris", "Rome", "Oslo", "Lima"]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"enum": CITIES},
                                                   "sunny": {"type": "boolean"}},
                  "required": ["city", "sunny"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
            "name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"enum": CITIES}},
                           "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {
            "name": "get_time", "description": "Local time in a city",
            "parameters": {"type": "object", "properties": {"city": {"enum": CITIES}},
                           "required": ["city"], "additionalProperties": False}}}]
OPENAI_FINISHED = ("stop", "length", "tool_calls")
# NOTE: logprob units (= logit units). bf16, the default on an AVX-512 CPU, spaces logits of
# magnitude 16-32 by 0.125: a batched run that sums in another order than the solo one moves
# the top two by a step or two (a first difference at margin 0.125 was seen with the bundled
# model); float32 runs need far less (tests/reference.py: 1e-2).
MARGIN_BOUND = 0.5

# kind -> (weight, what it sends)
MIX: dict[str, tuple[int, str]] = {
    "probe": (3, f"/generate, greedy, {PROBE_TOKENS} tokens, one of {len(PROBES)} fixed "
                 "prompts; compared with its solo reference"),
    "stream-logprobs": (3, "/generate stream, sampled, return_logprob, top_logprobs_num 3, "
                           "64-192 tokens"),
    "chat-n2": (2, "/v1/chat/completions stream, n=2, sampled, 48 tokens"),
    "structured": (2, "chat, response_format json_schema; the JSON must parse and match"),
    "tools": (2, "chat with 2 tools, tool_choice required; a known call must come back"),
    "lora": (2, f"adapter {ADAPTER!r}: /generate lora_path (greedy, compared with its solo "
                 "reference) or chat model BASE:soak"),
    "priority": (2, f"/generate stream, priority {LOW_PRIORITY} (32-96 tokens) and "
                    f"{HIGH_PRIORITY} (a 150-word prompt, 32 tokens: it preempts) in turn"),
    "hang-up": (1, "/generate stream closed by the client after 3 events (intended abort)"),
    "abort": (1, "/generate stream with rid, /abort_request after 2 events (intended abort)"),
    "prefix": (2, "/generate, 300-word prompts sharing one of 3 prefixes, 16 tokens"),
    "long": (1, "/generate stream, sampled, as many tokens as a third of the pool: while it "
                "grows, the admission estimate falls short and the newest requests are "
                "retracted"),
}
STATUSES = ("ok", "aborted", "4xx", "5xx", "unanswered", "invalid")
SAMPLED = ("kv_pool_tokens", "kv_used_tokens", "kv_cached_tokens", "kv_evictable_tokens",
           "request_slots_used", "num_running_reqs", "num_waiting_reqs", "retractions",
           "preemptions", "new_token_ratio", "integrity_error")


@dataclass
class Outcome:
    kind: str
    status: str  # one of STATUSES
    started: float  # seconds since the traffic started
    ended: float
    ttft: float | None = None
    truncated: bool = False  # a grammar-constrained answer that hit max_tokens: not checkable
    probe: str | None = None  # equal | near-tie | mismatch
    detail: str = ""

    @property
    def latency(self) -> float:
        return self.ended - self.started


@dataclass
class Reference:
    output_ids: list[int]
    margins: list[float]  # per position: top-1 minus top-2 logprob


@dataclass
class Reply:
    status: int = 0
    body: Any = None  # a non-streamed answer's JSON (or text)
    events: list[dict[str, Any]] = field(default_factory=list)
    aborted_by_us: bool | None = None  # /abort_request found the request


class ReplyError(Exception):
    """The reply is not what the kind expects (an `invalid` outcome)."""


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ---- the adapter -------------------------------------------------------------------------------

def model_overrides(server_args: list[str]) -> dict[str, Any]:
    """--json-model-override-args among the extra server flags (the adapter must fit them)."""
    for i, arg in enumerate(server_args):
        if arg == "--json-model-override-args" and i + 1 < len(server_args):
            return json.loads(server_args[i + 1])
        if arg.startswith("--json-model-override-args="):
            return json.loads(arg.split("=", 1)[1])
    return {}


def make_adapter(model_path: str | None, overrides: dict[str, Any]) -> Path:
    """A random rank-8 PEFT adapter on every linear of the served model's shapes, made once
    under minisgl's cache dir (only shapes matter: the base's weights are not loaded)."""
    import torch
    import transformers

    from minisgl.env import cache_root
    from minisgl.models import resolve_model_path
    base = resolve_model_path(model_path)
    key = hashlib.sha256(f"{base.resolve()} {json.dumps(overrides, sort_keys=True)}".encode())
    path = cache_root() / "soak-lora" / f"{base.name[:40]}-r{RANK}-{key.hexdigest()[:12]}"
    if (path / "adapter_config.json").exists():
        return path
    config = transformers.AutoConfig.from_pretrained(base)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    save_random_adapter(transformers.AutoModelForCausalLM.from_config(config), RANK, path)
    return path


# ---- one client's requests ---------------------------------------------------------------------

class Traffic:
    """The closed-loop clients and what they recorded."""

    def __init__(self, url: str, model: str, args: argparse.Namespace,
                 references: dict[str, Reference], prefixes: list[str]) -> None:
        self.url, self.model, self.args = url, model, args
        self.references, self.prefixes = references, prefixes
        self.outcomes: list[Outcome] = []
        self.started = time.perf_counter()
        self.stop = asyncio.Event()
        self.rids = self.priorities = 0
        self.deck: list[str] = []
        self.deck_rng = random.Random(args.seed)
        self.session: aiohttp.ClientSession | None = None

    def now(self) -> float:
        return time.perf_counter() - self.started

    async def post(self, path: str, body: dict[str, Any], stream: bool = False,
                   hang_up_after: int | None = None, abort_after: int | None = None,
                   outcome: Outcome | None = None, first_token: Any = None) -> Reply:
        """POST `body`; a stream's events parsed, the first that carries output
        (`first_token(event)`) timed into `outcome`."""
        assert self.session is not None
        reply, started = Reply(), time.perf_counter()
        async with self.session.post(self.url + path, json=body) as resp:
            reply.status = resp.status
            if resp.status != 200 or not stream:
                text = await resp.text()
                try:
                    reply.body = json.loads(text)
                except ValueError:
                    reply.body = text
                return reply
            async for message in sse_messages(resp):
                reply.events.append(message)
                if outcome is not None and outcome.ttft is None and first_token(message):
                    outcome.ttft = time.perf_counter() - started
                if hang_up_after is not None and len(reply.events) >= hang_up_after:
                    resp.close()  # NOTE: the hang-up: the server must abort the request
                    return reply
                if abort_after is not None and len(reply.events) == abort_after:
                    async with self.session.post(self.url + "/abort_request",
                                                 json={"rid": body["rid"]}) as abort:
                        if abort.status != 200:
                            raise ReplyError(f"/abort_request: HTTP {abort.status}")
                        reply.aborted_by_us = (await abort.json())["success"]
        return reply

    def deal(self) -> str:
        """The next kind, from one shuffled deck holding each kind `weight` times: every
        deck's worth of requests has the mix's proportions exactly, so a short run sees every
        kind."""
        if not self.deck:
            self.deck = [kind for kind, (weight, _) in MIX.items() for _ in range(weight)]
            self.deck_rng.shuffle(self.deck)
        return self.deck.pop()

    async def client(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        while not self.stop.is_set():
            await self.one(self.deal(), rng)

    async def one(self, kind: str, rng: random.Random) -> Outcome:
        started = self.now()
        outcome = Outcome(kind, "ok", started, started)
        try:
            reply = await getattr(self, "send_" + kind.replace("-", "_"))(rng, outcome)
            if 400 <= reply.status < 500:
                outcome.status, outcome.detail = "4xx", f"{reply.status}: {reply.body}"[:300]
            elif reply.status >= 500:
                outcome.status, outcome.detail = "5xx", f"{reply.status}: {reply.body}"[:300]
        except ReplyError as exc:
            outcome.status, outcome.detail = "invalid", str(exc)[:300]
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # a malformed answer
            outcome.status, outcome.detail = "invalid", repr(exc)[:300]
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            outcome.status, outcome.detail = "unanswered", repr(exc)[:300]
        outcome.ended = self.now()
        self.outcomes.append(outcome)
        return outcome

    # -- the kinds: each sends, then raises ReplyError for a 200 that fails its check ------------

    def compare_probe(self, name: str, output_ids: list[int], outcome: Outcome) -> None:
        ref = self.references[name]
        if output_ids == ref.output_ids:
            outcome.probe = "equal"
            return
        at = next((i for i, (a, b) in enumerate(zip(output_ids, ref.output_ids)) if a != b),
                  min(len(output_ids), len(ref.output_ids)))
        margin = ref.margins[at] if at < len(ref.margins) else float("inf")
        outcome.detail = f"{name!r} first differs at token {at}, reference margin {margin:.4g}"
        if margin < self.args.margin_bound:
            outcome.probe = "near-tie"
            return
        outcome.probe = "mismatch"
        raise ReplyError(outcome.detail)

    async def greedy(self, name: str, prompt: str, adapter: str | None,
                     outcome: Outcome) -> Reply:
        body = {"text": prompt, "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                     "max_new_tokens": PROBE_TOKENS}}
        if adapter is not None:
            body["lora_path"] = adapter
        reply = await self.post("/generate", body)
        if reply.status == 200:
            native_finished(reply.body)
            self.compare_probe(name, reply.body["output_ids"], outcome)
        return reply

    async def send_probe(self, rng: random.Random, outcome: Outcome) -> Reply:
        prompt = rng.choice(PROBES)
        return await self.greedy(prompt, prompt, None, outcome)

    async def send_stream_logprobs(self, rng: random.Random, outcome: Outcome) -> Reply:
        tokens, top = rng.randint(64, 192), 3
        reply = await self.post("/generate", {
            "text": words(rng, rng.randint(20, 120)), "stream": True, "return_logprob": True,
            "top_logprobs_num": top, "sampling_params": {
                "temperature": 0.8, "top_p": 0.95, "max_new_tokens": tokens,
                "ignore_eos": True}}, stream=True, outcome=outcome, first_token=native_has_output)
        if reply.status == 200:
            meta = stream_finished(reply, tokens)
            if (len(meta["output_token_logprobs"]) != tokens
                    or any(len(t) != top for t in meta["output_top_logprobs"])):
                raise ReplyError("logprobs missing: "
                                 f"{len(meta['output_token_logprobs'])} of {tokens}")
        return reply

    async def send_chat_n2(self, rng: random.Random, outcome: Outcome) -> Reply:
        reply = await self.post("/v1/chat/completions", {
            "model": self.model, "messages": [{"role": "user", "content": words(rng, 30)}],
            "n": 2, "max_tokens": 48, "temperature": 0.7, "stream": True},
            stream=True, outcome=outcome, first_token=chat_has_output)
        if reply.status == 200:
            finished = {c["index"]: c["finish_reason"] for e in reply.events
                        for c in e.get("choices", []) if c.get("finish_reason")}
            if sorted(finished) != [0, 1] or not set(finished.values()) <= {"stop", "length"}:
                raise ReplyError(f"choices finished: {finished}")
        return reply

    async def send_structured(self, rng: random.Random, outcome: Outcome) -> Reply:
        reply = await self.post("/v1/chat/completions", {
            "model": self.model, "max_tokens": 64, "temperature": 0.7,
            "messages": [{"role": "user", "content": "Weather report as JSON for "
                          + rng.choice(CITIES)}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA}}})
        if reply.status == 200:
            choice = chat_choice(reply.body)
            if choice["finish_reason"] == "length":
                outcome.truncated = True
                return reply
            try:
                answer = json.loads(choice["message"]["content"])
            except (TypeError, ValueError):
                raise ReplyError(f"not JSON: {choice['message']['content']!r:.200}") from None
            if (not isinstance(answer, dict) or set(answer) != {"city", "sunny"}
                    or answer["city"] not in CITIES or not isinstance(answer["sunny"], bool)):
                raise ReplyError(f"JSON off the schema: {answer!r:.200}")
        return reply

    async def send_tools(self, rng: random.Random, outcome: Outcome) -> Reply:
        reply = await self.post("/v1/chat/completions", {
            "model": self.model, "max_tokens": 96, "temperature": 0.7, "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False,
            "messages": [{"role": "user", "content": f"What is it like in {rng.choice(CITIES)}?"}]})
        if reply.status == 200:
            choice = chat_choice(reply.body)
            if choice["finish_reason"] == "length":
                outcome.truncated = True
                return reply
            calls = choice["message"].get("tool_calls") or []
            names = {tool["function"]["name"] for tool in TOOLS}
            if choice["finish_reason"] != "tool_calls" or not calls:
                raise ReplyError(f"no tool call: {choice!r:.200}")
            for call in calls:
                arguments = json.loads(call["function"]["arguments"])
                if call["function"]["name"] not in names or arguments.get("city") not in CITIES:
                    raise ReplyError(f"unknown call {call['function']!r:.200}")
        return reply

    async def send_lora(self, rng: random.Random, outcome: Outcome) -> Reply:
        if rng.random() < 0.5:
            return await self.greedy("lora", LORA_PROBE, ADAPTER, outcome)
        reply = await self.post("/v1/chat/completions", {
            "model": f"{self.model}:{ADAPTER}", "max_tokens": 32, "temperature": 0.7,
            "messages": [{"role": "user", "content": words(rng, 20)}]})
        if reply.status == 200:
            chat_choice(reply.body)
            if reply.body.get("model") != f"{self.model}:{ADAPTER}":
                raise ReplyError(f"answered as model {reply.body.get('model')!r}")
        return reply

    async def send_priority(self, rng: random.Random, outcome: Outcome) -> Reply:
        # NOTE: low first, then in turn: a first request meets an empty pool and preempts none.
        # The urgent one is long, so a full pool cannot admit it without preempting.
        self.priorities += 1
        urgent = self.priorities % 2 == 0
        priority, tokens = (HIGH_PRIORITY, 32) if urgent else (LOW_PRIORITY, rng.randint(32, 96))
        outcome.detail = f"priority {priority}"
        reply = await self.post("/generate", {
            "text": words(rng, 150 if urgent else rng.randint(20, 80)), "stream": True,
            "priority": priority, "sampling_params": {
                "temperature": 0.7, "max_new_tokens": tokens, "ignore_eos": True}},
            stream=True, outcome=outcome, first_token=native_has_output)
        if reply.status == 200:
            stream_finished(reply, tokens)
        return reply

    async def send_hang_up(self, rng: random.Random, outcome: Outcome) -> Reply:
        reply = await self.post("/generate", {
            "text": words(rng, 40), "stream": True,
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 96, "ignore_eos": True}},
            stream=True, hang_up_after=3, outcome=outcome, first_token=native_has_output)
        if reply.status == 200:
            if len(reply.events) < 3:
                raise ReplyError(f"the stream ended after {len(reply.events)} events")
            outcome.status = "aborted"
        return reply

    async def send_abort(self, rng: random.Random, outcome: Outcome) -> Reply:
        self.rids += 1
        reply = await self.post("/generate", {
            "text": words(rng, 40), "stream": True, "rid": f"soak-{self.args.seed}-{self.rids}",
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 96, "ignore_eos": True}},
            stream=True, abort_after=2, outcome=outcome, first_token=native_has_output)
        if reply.status == 200:
            reason = (reply.events[-1]["meta_info"]["finish_reason"] or {}) if reply.events else {}
            if reply.aborted_by_us and reason.get("type") == "abort":
                outcome.status = "aborted"
            else:
                native_finished(reply.events[-1] if reply.events else {})
        return reply

    async def send_prefix(self, rng: random.Random, outcome: Outcome) -> Reply:
        reply = await self.post("/generate", {
            "text": rng.choice(self.prefixes) + "\nQuestion: " + words(rng, 12),
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}})
        if reply.status == 200:
            meta = native_finished(reply.body)
            outcome.detail = f"cached {meta.get('cached_tokens', 0)}"
        return reply

    async def send_long(self, rng: random.Random, outcome: Outcome) -> Reply:
        tokens = self.args.max_total_tokens // 3
        reply = await self.post("/generate", {
            "text": words(rng, 20), "stream": True,
            "sampling_params": {"temperature": 0.7, "max_new_tokens": tokens,
                                "ignore_eos": True}},
            stream=True, outcome=outcome, first_token=native_has_output)
        if reply.status == 200:
            stream_finished(reply, tokens)
        return reply


def native_has_output(message: dict[str, Any]) -> bool:
    return bool(message.get("output_ids") or message.get("meta_info", {}).get(
        "completion_tokens"))


def chat_has_output(message: dict[str, Any]) -> bool:
    return any((c.get("delta") or {}).get("content") for c in message.get("choices", []))


def native_finished(result: Any) -> dict[str, Any]:
    """A native result's meta_info, if it finished by length or stop (not aborted)."""
    meta = result.get("meta_info", {}) if isinstance(result, dict) else {}
    reason = meta.get("finish_reason") or {}
    if reason.get("type") not in ("length", "stop"):
        raise ReplyError(f"finished with {reason or 'nothing'}")
    return meta


def stream_finished(reply: Reply, tokens: int) -> dict[str, Any]:
    """A native stream's last meta_info, if it finished with all `tokens` (ignore_eos)."""
    meta = native_finished(reply.events[-1] if reply.events else {})
    if meta["completion_tokens"] != tokens:
        raise ReplyError(f"{meta['completion_tokens']} tokens of {tokens}")
    return meta


def chat_choice(body: Any) -> dict[str, Any]:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices or choices[0].get("finish_reason") not in OPENAI_FINISHED:
        raise ReplyError(f"no finished choice: {body!r:.200}")
    return choices[0]


# ---- the run -----------------------------------------------------------------------------------

def server_flags(args: argparse.Namespace, adapter: Path) -> list[str]:
    flags = ["--lora-paths", f"{ADAPTER}={adapter}", "--enable-priority-scheduling",
             "--speculative-algorithm", "NGRAM"]
    if args.dtype:
        flags += ["--dtype", args.dtype]
    if args.model_path:
        flags += ["--model-path", args.model_path]
    return flags + shlex.split(args.server_args)


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        resp.raise_for_status()
        return await resp.json()


async def scheduler_state(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    return (await get_json(session, url + "/get_server_info"))["internal_states"][0]


async def solo_references(session: aiohttp.ClientSession, url: str
                          ) -> dict[str, Reference]:
    """Each probe alone on the idle server, with its top-2 logprobs."""
    references = {}
    probes = [(p, p, None) for p in PROBES] + [("lora", LORA_PROBE, ADAPTER),
                                               ("lora-base", LORA_PROBE, None)]
    for name, prompt, adapter in probes:
        body: dict[str, Any] = {"text": prompt, "return_logprob": True, "top_logprobs_num": 2,
                                "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                    "max_new_tokens": PROBE_TOKENS}}
        if adapter is not None:
            body["lora_path"] = adapter
        async with session.post(url + "/generate", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"the solo reference for {name!r}: HTTP {resp.status}: "
                                   f"{await resp.text()}")
            result = await resp.json()
        tops = result["meta_info"]["output_top_logprobs"]
        references[name] = Reference(result["output_ids"], [t[0][0] - t[1][0] for t in tops])
    return references


def process_stats(pid: int) -> dict[str, float]:
    """Resident memory (MB), open files and threads of the server and its children."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    return {"rss_mb": sum(p.memory_info().rss for p in procs) / 1e6,
            "fds": sum(p.num_fds() for p in procs),
            "threads": sum(p.num_threads() for p in procs)}


def window_stats(outcomes: list[Outcome], since: float, until: float) -> dict[str, float | None]:
    done = [o for o in outcomes if since < o.ended <= until and o.status == "ok"]
    ttfts = [o.ttft for o in done if o.ttft is not None]
    return {"p50_s": percentile([o.latency for o in done], 0.5),
            "p99_s": percentile([o.latency for o in done], 0.99),
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99)}


def error_count(outcomes: list[Outcome]) -> int:
    return sum(o.status in ("4xx", "5xx", "unanswered", "invalid") for o in outcomes)


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


async def sampler(server: ServerProcess, traffic: Traffic, session: aiohttp.ClientSession,
                  interval: float, samples: list[dict[str, Any]]) -> None:
    previous = 0.0
    while True:
        await asyncio.sleep(interval)
        t = traffic.now()
        state = await scheduler_state(session, server.url)
        sample = {"t_s": t, **process_stats(server.proc.pid),
                  **{k: state[k] for k in SAMPLED},
                  **window_stats(traffic.outcomes, previous, t),
                  "done": len(traffic.outcomes), "errors": error_count(traffic.outcomes),
                  "aborted": sum(o.status == "aborted" for o in traffic.outcomes)}
        samples.append(sample)
        previous = t
        print(f"[{t / 60:6.2f} min] rss {sample['rss_mb']:.0f} MB, fds {sample['fds']}, "
              f"threads {sample['threads']} | kv used {sample['kv_used_tokens']}"
              f"/{sample['kv_pool_tokens']} (cached {sample['kv_cached_tokens']}) | slots "
              f"{sample['request_slots_used']}, running "
              f"{sample['num_running_reqs']}, waiting {sample['num_waiting_reqs']} | retracted "
              f"{sample['retractions']}, preempted {sample['preemptions']} | e2e p50 "
              f"{seconds(sample['p50_s'])} p99 {seconds(sample['p99_s'])} s, ttft p50 "
              f"{seconds(sample['ttft_p50_s'])} p99 {seconds(sample['ttft_p99_s'])} s | done "
              f"{sample['done']}, errors {sample['errors']}", flush=True)


async def wait_idle(session: aiohttp.ClientSession, url: str, timeout: float
                    ) -> dict[str, Any]:
    """The scheduler's state once nothing runs or waits and only the prefix cache holds KV
    (or at `timeout`), after /flush_cache."""
    deadline = time.monotonic() + timeout
    while True:
        state = await scheduler_state(session, url)
        idle = (state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0
                and state["kv_used_tokens"] == state["kv_cached_tokens"])
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    while time.monotonic() < deadline:
        async with session.post(url + "/flush_cache") as resp:
            if resp.status == 200:
                break
        await asyncio.sleep(0.2)
    return await scheduler_state(session, url)


async def soak(server: ServerProcess, args: argparse.Namespace
               ) -> tuple[Traffic, list[dict[str, Any]], dict[str, Any]]:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as control:
        model = (await get_json(control, server.url + "/v1/models"))["data"][0]["id"]
        references = await solo_references(control, server.url)
        rng = random.Random(args.seed)
        prefixes = [words(rng, 300) for _ in range(3)]
        traffic = Traffic(server.url, model, args, references, prefixes)
        # NOTE: a fresh connection per request (as sglang.bench_serving): a hang-up closes one
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            traffic.session = session
            samples: list[dict[str, Any]] = []
            clients = [asyncio.create_task(traffic.client(i)) for i in range(args.concurrency)]
            watch = asyncio.create_task(sampler(server, traffic, control, args.interval,
                                                samples))
            await asyncio.sleep(args.minutes * 60)
            traffic.stop.set()
            log(f"traffic stopped; waiting for {sum(not c.done() for c in clients)} clients")
            await asyncio.gather(*clients)
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        end = await wait_idle(control, server.url, timeout=60)
        end.update(process_stats(server.proc.pid))
    return traffic, samples, end


def kind_rows(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    total = sum(weight for weight, _ in MIX.values())
    rows = []
    for kind, (weight, _) in MIX.items():
        mine = [o for o in outcomes if o.kind == kind]
        ok = [o.latency for o in mine if o.status == "ok"]
        rows.append({"kind": kind, "share": weight / total, "sent": len(mine),
                     **{s: sum(o.status == s for o in mine) for s in STATUSES},
                     "truncated": sum(o.truncated for o in mine),
                     "p50_s": percentile(ok, 0.5), "p99_s": percentile(ok, 0.99)})
    return rows


def checks(args: argparse.Namespace, traffic: Traffic, samples: list[dict[str, Any]],
           end: dict[str, Any], warmup_s: float, log_errors: list[str],
           exit_code: int | None) -> list[dict[str, Any]]:
    out = traffic.outcomes
    count = {s: sum(o.status == s for o in out) for s in STATUSES}
    after = [s for s in samples if s["t_s"] >= warmup_s]
    growth = ((after[-1]["rss_mb"] - after[0]["rss_mb"]) / after[0]["rss_mb"]
              if len(after) > 1 else None)
    probes = [o for o in out if o.probe is not None]
    verdicts = {v: sum(o.probe == v for o in probes) for v in ("equal", "near-tie", "mismatch")}
    refs = traffic.references
    lora_changes = refs["lora"].output_ids != refs["lora-base"].output_ids
    rows = [
        ("KV tokens used after /flush_cache", end["kv_used_tokens"], "== 0",
         end["kv_used_tokens"] == 0),
        ("request slots used at the end", end["request_slots_used"], "== 0",
         end["request_slots_used"] == 0),
        ("running + waiting requests at the end",
         end["num_running_reqs"] + end["num_waiting_reqs"], "== 0",
         end["num_running_reqs"] + end["num_waiting_reqs"] == 0),
        ("scheduler integrity_error", end["integrity_error"], "None",
         end["integrity_error"] is None),
        ("unanswered requests", count["unanswered"], "== 0", count["unanswered"] == 0),
        ("5xx answers", count["5xx"], "== 0", count["5xx"] == 0),
        ("4xx answers (no kind expects one)", count["4xx"], "== 0", count["4xx"] == 0),
        ("invalid answers", count["invalid"], "== 0", count["invalid"] == 0),
        ("RSS growth after warm-up",
         "n/a" if growth is None else f"{growth:+.2%} ({after[0]['rss_mb']:.0f} -> "
         f"{after[-1]['rss_mb']:.0f} MB)", f"< {args.rss_growth_bound:.0%}",
         growth is not None and growth < args.rss_growth_bound),
        ("retractions (the pool was full)", end["retractions"], ">= 1", end["retractions"] >= 1),
        ("preemptions (priority)", end["preemptions"], ">= 1", end["preemptions"] >= 1),
        ("probes equal / near-tie / mismatch",
         f"{verdicts['equal']} / {verdicts['near-tie']} / {verdicts['mismatch']}",
         f"mismatch 0 (near-tie: margin < {args.margin_bound:g})",
         verdicts["mismatch"] == 0 and len(probes) > 0),
        ("the adapter changes the solo greedy answer", lora_changes, "True", bool(lora_changes)),
        ("server log errors (Traceback / ERROR)", len(log_errors), "== 0", not log_errors),
        ("server exit code on SIGTERM", exit_code, "== 0", exit_code == 0),
    ]
    return [{"check": c, "value": v, "bound": b, "pass": bool(p)} for c, v, b, p in rows]


def print_mix(args: argparse.Namespace, flags: list[str]) -> None:
    total = sum(weight for weight, _ in MIX.values())
    print(f"## soak: {args.minutes:g} min ({warmup_minutes(args):g} min warm-up), "
          f"{args.concurrency} closed-loop clients, --max-total-tokens "
          f"{args.max_total_tokens}, sampled every {args.interval:g} s\n")
    print(f"server flags: {shlex.join(flags)}")
    print("(LoRA, priority scheduling and NGRAM speculation run in one server: none of them "
          "is refused with the others)\n")
    print("| kind | share | what |\n|---|---|---|")
    for kind, (weight, what) in MIX.items():
        print(f"| {kind} | {weight / total:.0%} | {what} |")
    print(flush=True)


def print_tables(rows: list[dict[str, Any]], check_rows: list[dict[str, Any]]) -> None:
    print("\n| kind | sent | ok | intended aborts | 4xx | 5xx | unanswered | invalid | "
          "truncated | p50 s | p99 s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['sent']} | {r['ok']} | {r['aborted']} | {r['4xx']} | "
              f"{r['5xx']} | {r['unanswered']} | {r['invalid']} | {r['truncated']} | "
              f"{seconds(r['p50_s'])} | {seconds(r['p99_s'])} |")
    print("\n| check | value | bound | pass |\n|---|---|---|---|")
    for c in check_rows:
        print(f"| {c['check']} | {c['value']} | {c['bound']} | {'yes' if c['pass'] else 'NO'} |")


def plot(path: Path, samples: list[dict[str, Any]]) -> None:
    def series(key: str) -> list[float | None]:
        return [s[key] for s in samples]

    draw_panels(path, [s["t_s"] / 60 for s in samples], [
        Panel("server RSS (MB)", {"rss": series("rss_mb")}),
        Panel("KV tokens", {"used": series("kv_used_tokens"),
                            "prefix cache": series("kv_cached_tokens")}),
        Panel("requests in the server", {"running": series("num_running_reqs"),
                                         "waiting": series("num_waiting_reqs"),
                                         "slots used": series("request_slots_used")}),
        Panel("end-to-end latency over the interval (s)", {"p50": series("p50_s"),
                                                           "p99": series("p99_s")}),
        Panel("errors and intended aborts so far", {"errors": series("errors"),
                                                    "intended aborts": series("aborted")}),
    ], "min")


def warmup_minutes(args: argparse.Namespace) -> float:
    return min(args.warmup_minutes, args.minutes / 6)


def soak_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0, help="traffic duration")
    parser.add_argument("--warmup-minutes", type=float, default=5.0,
                        help="RSS growth is measured from its end (at most --minutes / 6)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop clients")
    parser.add_argument("--max-total-tokens", type=int, default=2000,
                        help="the KV pool: small, so the default mix keeps it full and "
                        "requests are retracted")
    parser.add_argument("--rss-growth-bound", type=float, default=0.03,
                        help="(last sample - end of warm-up) / end of warm-up, at most")
    parser.add_argument("--margin-bound", type=float, default=MARGIN_BOUND,
                        help="a probe may differ from its solo reference only first where the "
                        "reference's top-2 logprob margin is below this (default %(default)s: "
                        "batched and solo runs sum in different orders, and bf16, the default "
                        "on an AVX-512 CPU, spaces logits of magnitude 16-32 by 0.125, so the "
                        "top two may swap within a step or two; a wrong row, adapter or KV "
                        "page differs at margins of whole logits; 0.01 suffices in float32)")
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a request may take before it counts as unanswered")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for series.json and soak.png (default: a new one in /tmp)")
    parser.add_argument("--dtype", default=None, help="the server's --dtype (default: its own)")
    parser.add_argument("--model-path", default=None, help="default: the bundled model")
    parser.add_argument("--server-args", default="",
                        help="extra server flags, one string (shlex-split)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> dict[str, Any]:
    args = soak_parser().parse_args()
    if args.minutes <= 0 or args.interval <= 0 or args.concurrency < 1:
        raise SystemExit("--minutes and --interval must be > 0, --concurrency >= 1")
    out = args.out or Path(tempfile.mkdtemp(prefix="minisgl-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.server_args)
    log("making the LoRA adapter (cached after the first run)")
    adapter = make_adapter(args.model_path, model_overrides(extra))
    flags = server_flags(args, adapter)
    print_mix(args, flags)
    server = start_minisgl(True, 2 * args.concurrency, args.max_total_tokens, tuple(flags))
    try:
        traffic, samples, end = asyncio.run(soak(server, args))
    finally:
        server.stop()
    log_errors = [line.rstrip() for line in server.lines
                  if "Traceback" in line or " ERROR " in line]
    rows = kind_rows(traffic.outcomes)
    check_rows = checks(args, traffic, samples, end, warmup_minutes(args) * 60, log_errors,
                        server.proc.returncode)
    print_tables(rows, check_rows)
    passed = all(c["pass"] for c in check_rows)
    failures = [asdict(o) for o in traffic.outcomes
                if o.status in ("4xx", "5xx", "unanswered", "invalid")]
    for failure in failures[:5]:
        print(f"\n{failure['kind']} {failure['status']}: {failure['detail']}")
    for line in log_errors[:10]:
        print(f"server log: {line}")
    results = {"passed": passed, "flags": flags, "kinds": rows, "checks": check_rows,
               "samples": samples, "end_state": end, "server_log_errors": log_errors}
    (out / "series.json").write_text(json.dumps(
        {**results, "outcomes": [asdict(o) for o in traffic.outcomes]}, indent=1, default=str))
    plot(out / "soak.png", samples)
    print(f"\nverdict: {'PASS' if passed else 'FAIL'} (series.json and soak.png in {out})",
          flush=True)
    if not passed:
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
