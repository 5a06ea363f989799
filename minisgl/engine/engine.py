"""The engine: the model, its device memory (KV pool, page table, token pool) and one forward.

`Engine.forward` is what the engine stream runs for a scheduled batch: gather input ids from
the token pool, run the model, sample, write the sampled ids back into the token pool (where
the next batch will gather them) and copy them to the host.

With `--tp-size N` the rank-0 engine also owns ranks 1..N-1 (`minisgl.distributed.worker`):
`launch` first puts the step's host-side inputs into each rank's shared-memory queue, and
`forward` ends with a broadcast of the sampled ids (only rank 0 samples). With N = 1 neither
runs.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import psutil
import torch

from minisgl.attention import (
    AttentionBackend,
    create_attention_backend,
    default_attention_backend,
)
from minisgl.core import Batch
from minisgl.distributed import TPInfo
from minisgl.distributed.context import (
    all_reduce_min,
    bind_thread,
    broadcast,
    create_group,
    tp_context,
)
from minisgl.distributed.shm_queue import QueueClosed
from minisgl.distributed.worker import GLOO_TIMEOUT_S, TPWorkers, cpu_threads
from minisgl.engine.graph import GraphRunner, supports_graphs
from minisgl.engine.sampler import SampleOutput, Sampler, SamplingArgs
from minisgl.engine.stream import Completion, CpuStream, EngineFailed, create_stream
from minisgl.kvcache import KVPool
from minisgl.layers.linear import can_prepack
from minisgl.models import (
    ModelArch,
    build_model,
    load_dummy,
    load_config,
    load_safetensors,
    resolve_model_path,
)
from minisgl.server_args import ServerArgs

logger = logging.getLogger(__name__)

SCORE_SLICE = 1024  # prompt rows whose logits exist at once when scoring input logprobs
DTYPES = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float32": torch.float32}


@dataclass
class HostInputs:
    """What the other tensor-parallel ranks need of a step (tp > 1 only): host copies of its
    index tensors, and every host write to page_table / token_pool since the previous step."""

    positions: torch.Tensor
    out_loc: torch.Tensor
    load_indices: torch.Tensor
    write_indices: torch.Tensor
    logit_rows: torch.Tensor | None
    token_writes: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (row, ids)
    location_writes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass
class InputLogprobRows:
    """Prompt positions scored in a prefill (rank 0): their rows follow the batch's sampling
    rows in `ForwardInput.logit_rows`, in request order."""

    targets: torch.Tensor  # [R] int64 on the device: the prompt token each row predicts
    top_k: int  # also the top k of each row (0: none)
    spans: list[tuple[int, int]]  # (index in batch.reqs, rows), in row order


@dataclass
class InputLogprobs:
    """Host copies: raw log-softmax at each scored row's target, and its top k."""

    values: torch.Tensor  # [R] float32
    top: tuple[torch.Tensor, torch.Tensor] | None  # ([R, k] float32, [R, k] int64)


@dataclass
class ForwardInput:
    batch: Batch
    load_indices: torch.Tensor  # flat token_pool indices of the input ids
    write_indices: torch.Tensor  # flat token_pool index for each real request's sampled id
    # which token rows need logits: prefill, each request's last token, then any scored
    # prompt positions (input logprobs)
    logit_rows: torch.Tensor | None
    sample_args: SamplingArgs | None
    host: HostInputs | None = None  # tp > 1: sent to ranks 1..N-1
    logits_only: bool = False  # return the logits instead of sampling (prefill_logits)
    input_logprobs: InputLogprobRows | None = None  # rank 0

    @property
    def num_scored_rows(self) -> int:
        """Rows after the sampling rows (every rank can count them)."""
        if self.logit_rows is None or self.logits_only:
            return 0
        return len(self.logit_rows) - self.batch.size


@dataclass
class ForwardOutput:
    next_tokens: torch.Tensor  # host copy, [batch.size] int32
    sample: SampleOutput  # logprobs, when asked, already on the host
    input_logprobs: InputLogprobs | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


def check_tp_size(arch: ModelArch, size: int, model_name: str) -> None:
    """Refuse a tensor-parallel size that cannot give every rank an equal share of the heads
    (KV heads may instead be replicated: size a multiple of them) and of the MLP."""
    def fits(n: int) -> bool:
        kv = arch.num_kv_heads
        return (arch.num_heads % n == 0 and (kv % n == 0 if kv >= n else n % kv == 0)
                and arch.intermediate_size % n == 0)

    if fits(size):
        return
    parts = [f"{arch.num_heads} attention heads", f"{arch.num_kv_heads} KV heads",
             f"MLP width {arch.intermediate_size}"]
    sizes = ", ".join(str(n) for n in range(1, arch.num_heads + 1) if fits(n))
    raise ValueError(f"--tp-size {size} cannot split {model_name} evenly ({', '.join(parts)}); "
                     f"tensor-parallel sizes that fit this model: {sizes}")


class Engine:
    def __init__(self, args: ServerArgs, tp: TPInfo | None = None, group: object = None
                 ) -> None:
        """Rank 0 gets `tp=None` (TPInfo(0, args.tp_size)) and, for tp > 1, spawns and owns
        ranks 1..N-1; a worker process passes its own `tp` and joined `group`."""
        self.args = args
        self.tp = tp or TPInfo(0, args.tp_size)
        self.group = group
        self.workers: TPWorkers | None = None
        self.stream = None
        self.graph_runner: GraphRunner | None = None  # CUDA graphs for decode (GPU only)
        self._failure: str | None = None  # kept after shutdown
        self._saved_threads: int | None = None
        self.device = resolve_device(args.device)
        if self.device.type == "cuda":
            if self.tp.size > torch.cuda.device_count():
                raise ValueError(f"--tp-size {self.tp.size} needs {self.tp.size} GPUs; torch "
                                 f"sees {torch.cuda.device_count()}")
            self.device = torch.device("cuda", self.tp.rank)
            torch.cuda.set_device(self.device)
        self.dtype = DTYPES[args.dtype]
        started = time.perf_counter()
        self.model_path: Path = resolve_model_path(args.model_path)
        self.config = load_config(self.model_path)
        if args.json_model_override_args:
            self.config.update(json.loads(args.json_model_override_args))
        self.arch = ModelArch.from_config(self.config)
        self.context_len = args.context_length or self.arch.max_position_embeddings
        if self.tp.size > 1:
            check_tp_size(self.arch, self.tp.size, self.model_path.name)
        try:
            if self.tp.size > 1 and self.tp.is_primary and group is None:
                self.workers = TPWorkers(args, self.tp.size, self.device)
            if self.device.type == "cpu" and self.tp.is_primary:
                self.stream = CpuStream()  # built on the thread that will run the forwards
                if self.workers is not None:  # NOTE: process-wide; restored at shutdown
                    self._saved_threads = self.stream.call(
                        partial(_share_cores, cpu_threads(self.tp.size)))
                self.stream.call(lambda: self._build(started))
            else:
                self._build(started)
        except BaseException as exc:
            self._restore_threads()
            if self.workers is not None:
                error = self.workers.first_error()
                self.workers.shutdown(graceful=False)
                if error is not None:
                    raise RuntimeError(error) from exc
            raise

    def _build(self, started: float) -> None:
        args = self.args
        if self.workers is not None:
            self.workers.wait_for("joining")
            self.group = create_group(self.workers.store, 0, self.tp.size, self.device,
                                      GLOO_TIMEOUT_S)
        with tp_context(self.tp, self.group):
            self.model = self._build_model()
            self.load_seconds = time.perf_counter() - started
            self.max_running = args.max_running_requests or (
                256 if self.device.type == "cuda" else 128)
            self.page_size = args.page_size or (1 if self.device.type == "cuda" else 16)
            self.kv_pool = self._allocate_kv_pool()
        rows = self.max_running + 1  # the last row belongs to the dummy request
        self.dummy_row = self.max_running
        self.page_table = torch.zeros(rows, self.context_len, dtype=torch.int32, device=self.device)
        self.token_pool = torch.zeros(rows, self.context_len, dtype=torch.int32, device=self.device)
        self.page_table[self.dummy_row].fill_(self.kv_pool.dummy_loc)
        self.attn_backend: AttentionBackend = create_attention_backend(
            args.attention_backend or default_attention_backend(self.device, self.dtype),
            self.kv_pool, self.page_table, self.arch.head_dim ** -0.5,
            num_qo_heads=self.model.layers[0].self_attn.qkv_proj.num_heads)  # flashinfer only
        self.sampler = Sampler(self.arch.vocab_size, self.device, list(self.arch.eos_token_ids))
        self.busy_seconds = 0.0
        self.phase_seconds = {"prefill": 0.0, "decode": 0.0}
        self.phase_steps = {"prefill": 0, "decode": 0}
        if (self.device.type == "cuda" and not args.disable_cuda_graph
                and supports_graphs(self.attn_backend)):
            # NOTE: every rank captures the same sizes in the same order (collectives inside)
            runner = GraphRunner(self.model, self.attn_backend,
                                 max_bs=min(args.cuda_graph_max_bs, self.max_running),
                                 dummy_row=self.dummy_row, dummy_loc=self.kv_pool.dummy_loc,
                                 device=self.device)
            with tp_context(self.tp, self.group):
                runner.capture()
            self.graph_runner = runner
        if not self.tp.is_primary:
            return  # a worker runs its steps on its main thread
        binding = (self.tp, self.group) if self.tp.size > 1 else None
        if isinstance(self.stream, CpuStream):
            if binding is not None:
                bind_thread(*binding)  # NOTE: _build runs on the engine thread itself
        else:
            self.stream = create_stream(self.device, binding,
                                        wait=os.environ.get("MINISGL_CUDA_WAIT", "thread"))
        if self.workers is not None:
            self.workers.wait_for("ready")
            self.workers.start_monitor()

    def _build_model(self) -> torch.nn.Module:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = build_model(self.arch)
        finally:
            torch.set_default_dtype(default_dtype)
        if self.args.load_format == "dummy":  # NOTE: the same model whatever --tp-size
            load_dummy(model, self.arch, self.args.seed, self.device, self.dtype)
        else:
            load_safetensors(model, self.model_path)
        if can_prepack(next(model.parameters())):
            for module in model.modules():
                if hasattr(module, "prepack_for_cpu"):
                    module.prepack_for_cpu()
        return model.eval()

    def _allocate_kv_pool(self) -> KVPool:
        kv_heads = self.model.layers[0].self_attn.qkv_proj.num_kv_heads
        per_token = KVPool.bytes_per_token(self.arch.num_layers, kv_heads, self.arch.head_dim,
                                           self.dtype)
        tokens = self.args.max_total_tokens
        if tokens is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                fraction = self.args.mem_fraction_static or 0.85
                budget = free - total * (1 - fraction)
            else:  # the ranks share the host's memory
                budget = (psutil.virtual_memory().available
                          * (self.args.mem_fraction_static or 0.25) / self.tp.size)
            tokens = int(budget // per_token)
        tokens = all_reduce_min(tokens, self.device)  # NOTE: a page id means one slot everywhere
        num_pages = tokens // self.page_size
        if num_pages < 1:
            raise ValueError(f"no memory left for the KV cache ({tokens} tokens of "
                             f"{per_token} bytes); lower --mem-fraction-static or the model size")
        logger.info("KV pool: %d tokens in %d pages of %d (%.2f GiB)", num_pages * self.page_size,
                    num_pages, self.page_size, num_pages * self.page_size * per_token / 2**30)
        return KVPool(self.arch.num_layers, num_pages, self.page_size, kv_heads,
                      self.arch.head_dim, self.dtype, self.device)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.arch.eos_token_ids

    # ---- running steps -----------------------------------------------------------------------

    def launch(self, fwd: ForwardInput) -> Completion:
        """Queue one forward on the engine stream (and, tp > 1, on every other rank)."""
        if self.workers is None:
            return self.stream.launch(partial(self.forward, fwd))
        if self.workers.failed is not None:
            raise EngineFailed(self.workers.failed)
        try:
            self.workers.send(self._step_message(fwd))
        except QueueClosed:
            raise EngineFailed(self.workers.failed or "a tensor-parallel worker is gone") from None
        return self.stream.launch(partial(self._forward_tp, fwd))

    def _forward_tp(self, fwd: ForwardInput) -> ForwardOutput:
        try:
            return self.forward(fwd)
        except Exception as exc:  # a collective broke: most likely a rank died
            assert self.workers is not None
            raise EngineFailed(self.workers.explain_failure(exc)) from exc

    def forward(self, fwd: ForwardInput) -> ForwardOutput | torch.Tensor | None:
        """Runs on the engine stream (GPU) or the engine thread (CPU), in launch order."""
        started = time.perf_counter()
        batch = fwd.batch
        input_ids = self.token_pool.view(-1)[fwd.load_indices]
        scored = None
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            logits = self.graph_runner.replay(batch, input_ids, batch.input_positions)
        elif fwd.num_scored_rows:
            hidden = self.model.hidden_states(input_ids, batch.input_positions, batch,
                                              self.attn_backend, fwd.logit_rows)
            logits = self.model.lm_head(hidden[: batch.size])
            scored = self._score_rows(hidden[batch.size:], fwd.input_logprobs)
        else:
            logits = self.model(input_ids, batch.input_positions, batch, self.attn_backend,
                                fwd.logit_rows)
        if fwd.logits_only:
            return logits.float()
        if not self.tp.is_primary:  # rank 0 samples; every rank stores its choice
            next_tokens = torch.empty(batch.size, dtype=torch.int32, device=self.device)
            self.token_pool.view(-1)[fwd.write_indices] = broadcast(next_tokens, 0)
            return None
        sample = self.sampler.sample(logits[: batch.size], fwd.sample_args, self.token_pool)
        self.token_pool.view(-1)[fwd.write_indices] = sample.next_tokens
        if self.tp.size > 1:
            broadcast(sample.next_tokens, 0)
        tops = sample.top_logprobs
        output = ForwardOutput(
            next_tokens=_to_host(sample.next_tokens),
            sample=SampleOutput(next_tokens=sample.next_tokens, logprobs=_to_host(sample.logprobs),
                                top_logprobs=None if tops is None else
                                (_to_host(tops[0]), _to_host(tops[1]))),
            input_logprobs=scored)
        # NOTE: on CPU this is the real compute time; on CUDA only the launch time.
        elapsed = time.perf_counter() - started
        self.busy_seconds += elapsed
        self.phase_seconds[batch.phase] += elapsed
        self.phase_steps[batch.phase] += 1
        return output

    def _score_rows(self, hidden: torch.Tensor, rows: InputLogprobRows | None
                    ) -> InputLogprobs | None:
        """Input logprobs of the scored prompt rows, SCORE_SLICE rows of logits at a time.
        Every rank runs the LM head (a collective with tp > 1); rank 0 (`rows` given) keeps
        the log-softmax at each target and its top k."""
        values, top_values, top_ids = [], [], []
        for begin in range(0, len(hidden), SCORE_SLICE):
            logits = self.model.lm_head(hidden[begin:begin + SCORE_SLICE])
            if rows is None:
                continue
            logp = torch.log_softmax(logits.float(), dim=-1)
            targets = rows.targets[begin:begin + SCORE_SLICE, None]
            values.append(logp.gather(1, targets).squeeze(1))
            if rows.top_k > 0:
                top = logp.topk(rows.top_k, dim=-1)
                top_values.append(top.values)
                top_ids.append(top.indices)
        if rows is None:
            return None
        top = (_to_host(torch.cat(top_values)), _to_host(torch.cat(top_ids))) if top_ids else None
        return InputLogprobs(values=_to_host(torch.cat(values)), top=top)

    # ---- tensor parallelism ------------------------------------------------------------------

    def _step_message(self, fwd: ForwardInput) -> list[np.ndarray]:
        """A step as int arrays for the other ranks (see `run_step_message`)."""
        batch, host = fwd.batch, fwd.host
        assert host is not None, "a tensor-parallel step needs its host inputs"

        def ints(values: object) -> np.ndarray:
            if isinstance(values, torch.Tensor):
                return values.to(torch.int64).numpy()
            return np.asarray(values, dtype=np.int64)

        tokens, locations = host.token_writes, host.location_writes
        meta = [0 if batch.is_prefill else 1, batch.size, int(fwd.logits_only),
                int(host.logit_rows is not None)]
        return [
            ints(meta), ints(batch.table_rows), ints(batch.cached_lens), ints(batch.seq_lens),
            ints(batch.extend_lens), ints(host.positions), ints(host.out_loc),
            ints(host.load_indices), ints(host.write_indices),
            ints(host.logit_rows if host.logit_rows is not None else []),
            ints([row for row, _ in tokens]), ints([len(ids) for _, ids in tokens]),
            (torch.cat([ids for _, ids in tokens]).to(torch.int32).numpy() if tokens
             else np.zeros(0, np.int32)),
            ints([len(idx) for idx, _ in locations]),
            ints(torch.cat([idx for idx, _ in locations]) if locations else []),
            ints(torch.cat([loc for _, loc in locations]) if locations else []),
        ]

    def run_step_message(self, arrays: list[np.ndarray]) -> None:
        """A worker's step: replay rank 0's table writes, rebuild the batch, run the forward."""
        (meta, rows, cached, seq_lens, extend, positions, out_loc, load, write, logit_rows,
         token_rows, token_lens, token_ids, location_lens, location_idx, location_vals) = arrays
        device = self.device

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        offset = 0
        for row, n in zip(token_rows.tolist(), token_lens.tolist()):
            self.token_pool[row, :n] = dev(token_ids[offset:offset + n])
            offset += n
        offset = 0
        for n in location_lens.tolist():  # NOTE: in order: a later write may overwrite
            flat = dev(location_idx[offset:offset + n])
            self.page_table.view(-1)[flat] = dev(location_vals[offset:offset + n]).to(torch.int32)
            offset += n
        phase, size, logits_only, has_logit_rows = meta.tolist()
        placeholders = [None] * size  # NOTE: the batch only counts its requests here
        batch = Batch(reqs=placeholders, phase="prefill" if phase == 0 else "decode",
                      padded_reqs=placeholders, last_chunk=[True] * size,
                      input_positions=dev(positions), out_loc=dev(out_loc),
                      seq_lens=seq_lens.tolist(), extend_lens=extend.tolist(),
                      cached_lens=cached.tolist(), table_rows=rows.tolist())
        if self.graph_runner is not None:  # rank 0 padded its lists; pad positions / out_loc
            self.graph_runner.pad_batch(batch)
        self.attn_backend.prepare_metadata(batch)
        self.forward(ForwardInput(batch=batch, load_indices=dev(load), write_indices=dev(write),
                                  logit_rows=dev(logit_rows) if has_logit_rows else None,
                                  sample_args=None, logits_only=bool(logits_only)))

    def prefill_logits(self, ids: list[int], row: int = 0) -> torch.Tensor:
        """Logits [len(ids), vocab] (float32) of one prefill of `ids` in slot `row`, KV at
        locations 0..len(ids)-1, run on every rank. For tests and debugging, on an engine that
        serves nothing else (it overwrites that slot and those KV locations)."""
        n, ctx = len(ids), self.context_len
        positions = torch.arange(n)
        load = row * ctx + positions
        token_ids = torch.tensor(ids, dtype=torch.int32)
        self.token_pool[row, :n] = token_ids.to(self.device)
        self.page_table.view(-1)[load.to(self.device)] = positions.to(self.device, torch.int32)
        batch = Batch(reqs=[None], phase="prefill", padded_reqs=[None], last_chunk=[True],
                      input_positions=positions.to(self.device), out_loc=positions.to(self.device),
                      seq_lens=[n], extend_lens=[n], cached_lens=[0], table_rows=[row])
        self.attn_backend.prepare_metadata(batch)
        write = torch.tensor([self.dummy_row * ctx])
        host = HostInputs(positions, positions, load, write, None, [(row, token_ids)],
                          [(load, positions)])
        fwd = ForwardInput(batch=batch, load_indices=load.to(self.device),
                           write_indices=write.to(self.device), logit_rows=None,
                           sample_args=None, host=host, logits_only=True)
        return self.launch(fwd).result()

    @property
    def failed(self) -> str | None:
        """Why this engine cannot run any more (a tensor-parallel rank died), else None."""
        return self.workers.failed if self.workers is not None else self._failure

    def add_failure_listener(self, callback) -> None:
        """`callback(message)` once, from a monitor thread, when the engine fails (tp > 1)."""
        if self.workers is not None:
            self.workers.add_listener(callback)

    def remove_failure_listener(self, callback) -> None:
        if self.workers is not None:
            self.workers.remove_listener(callback)

    def shutdown(self) -> None:
        """Stop the engine thread and, tp > 1, every worker; removes our shared memory."""
        failed = self.failed
        if self.stream is not None:
            # NOTE: after a failure the engine thread may sit in a broken collective: no join
            self.stream.close(wait=failed is None)
        if self.workers is not None:
            self._failure = self.workers.failed
            self.workers.shutdown(graceful=failed is None)
            self.workers = None
        self.group = None
        self._restore_threads()
        if self.device.type == "cuda":
            self._release_device_memory()

    def _release_device_memory(self) -> None:
        """Free the weights, KV pool, tables and graphs now, even while callers still hold
        this engine (an `LLM` kept in a variable): a second engine in the same process needs
        the memory. The engine cannot run after this."""
        torch.cuda.synchronize(self.device)
        if self.graph_runner is not None:
            for graph in self.graph_runner.graphs.values():
                graph.reset()
            self.graph_runner = None
        tensors = [getattr(self, name, None) for name in ("page_table", "token_pool")]
        if getattr(self, "kv_pool", None) is not None:
            tensors.append(self.kv_pool.buffer)
        if getattr(self, "model", None) is not None:
            tensors += [*self.model.parameters(), *self.model.buffers()]
            tensors += [value for module in self.model.modules() for value in vars(module).values()
                        if isinstance(value, torch.Tensor)]  # caches such as RoPE's cos_sin
        for tensor in tensors:
            if tensor is not None and tensor.device.type == "cuda":
                tensor.untyped_storage().resize_(0)
        torch.cuda.empty_cache()

    def _restore_threads(self) -> None:
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None


def _share_cores(threads: int) -> int:
    """On the engine thread (tp > 1 on CPU: the ranks share the host's cores): set torch's
    intra-op threads, the process default and this thread's; returns the previous count. The
    caller's thread keeps its own (the event loop's runs without OpenMP)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    return previous


def _to_host(x: torch.Tensor | None) -> torch.Tensor | None:
    if x is None or x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)
