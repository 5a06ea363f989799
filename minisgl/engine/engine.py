"""The engine: the model, its device memory (KV pool, page table, token pool), the stream its
forwards run on, and the step itself (`ModelRunner`): gather the input ids from the token pool,
run the model (a captured CUDA graph for a decode batch that fits one), sample on rank 0, and
write the sampled ids back into the token pool, where the next batch gathers them.

With `tp_size` N > 1 the rank-0 engine also owns ranks 1..N-1 (`minisgl.distributed.worker`):
`launch` first puts the step message into each rank's shared-memory ring, and every forward
ends with a broadcast of the sampled ids (only rank 0 samples).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from minisgl.core import Batch
from minisgl.distributed.context import TPInfo, bind_thread, broadcast, create_group, tp_context
from minisgl.distributed.shm_queue import QueueClosed
from minisgl.distributed.worker import GLOO_TIMEOUT_S, TPWorkers, cpu_threads
from minisgl.engine.chunking import default_chunk, widest_row_width
from minisgl.engine.config import EngineConfig, resolve
from minisgl.engine.decode_steps import run_steps
from minisgl.engine.draft_model import DraftModel
from minisgl.engine.failure import FailureWatch, FaultAfterSteps
from minisgl.engine.forward import ForwardInput, ForwardOutput, InputLogprobs, VerifyRows, to_host
from minisgl.engine.graph import GraphRunner, supports_graphs
from minisgl.engine.hicache import KVMoves, KVTiers, build_page_store, kv_fingerprint
from minisgl.engine.images import EncodedImages, spliced_embeddings
from minisgl.engine.lora import LoraModules, lora_settings
from minisgl.engine.memory import (allocate_kv_pool, allocate_state_pool, decode_weight_bytes,
                                   release_cuda_memory)
from minisgl.engine.model_loading import attention_for, draft_arch, kv_layout, load_model
from minisgl.engine.placement import check_hybrid, check_tp_size, resolve_device
from minisgl.engine.pooling import last_token_embeddings
from minisgl.engine.quantization import check_int8_activations
from minisgl.engine.sampler import Sampler, to_device
from minisgl.engine.scoring import score_rows
from minisgl.engine.speculation import Speculator, spec_config
from minisgl.engine.stream import Completion, CpuStream
from minisgl.engine.tp_message import MSG_MOVES, PHASES, StepMessage, moves_message
from minisgl.env import cuda_wait_mode, fault_after_steps, return_freed_heap
from minisgl.errors import EngineFailed
from minisgl.flag_checks import lora_adapters
from minisgl.kvcache import KVPool
from minisgl.kvcache.page_store import PageStore
from minisgl.kvcache.state_pool import StatePool
from minisgl.layers.moe import syncs_on_host
from minisgl.models import (ModelArch, check_supported, generation_eos_ids, load_config,
                            resolve_model_path)
from minisgl.models.fused_layers import fuse_layers

logger = logging.getLogger(__name__)

class Engine:
    def __init__(self, config: EngineConfig, tp: TPInfo | None = None, group: object = None
                 ) -> None:
        """Rank 0 gets `tp=None` (TPInfo(0, tp_size)) and, for tp > 1, spawns and owns ranks
        1..N-1; a worker process passes its own `tp` and joined `group`."""
        self.config = config
        self.tp = tp or TPInfo(0, config.tp_size)
        self.group = group
        self.workers: TPWorkers | None = None
        self.stream: Any = None
        self._failure: str | None = None  # kept after shutdown
        self._failure_watch: FailureWatch | None = None
        self._saved_threads: int | None = None
        if (steps := fault_after_steps()) is not None and self.tp.rank == 0:
            self.forward = FaultAfterSteps(self.forward, steps)  # type: ignore[method-assign]
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            if self.tp.size > torch.cuda.device_count():
                raise ValueError(f"--tp-size {self.tp.size} needs {self.tp.size} GPUs; torch "
                                 f"sees {torch.cuda.device_count()}")
            self.device = torch.device("cuda", self.tp.rank)
            torch.cuda.set_device(self.device)
        self.model_path: Path = resolve_model_path(config.model_path)
        model_config = load_config(self.model_path)
        if config.json_model_override_args:
            model_config.update(json.loads(config.json_model_override_args))
        self.arch = ModelArch.from_config(model_config)
        eos = self.arch.eos_token_ids
        eos += tuple(t for t in generation_eos_ids(self.model_path) if t not in eos)
        self.arch = dataclasses.replace(self.arch, eos_token_ids=eos)
        check_supported(self.arch)
        self.config = config = resolve(config, self.device, self.arch)
        self.dtype: torch.dtype = getattr(torch, config.dtype)
        self.kv_cache_dtype: torch.dtype = getattr(torch, config.kv_cache_dtype)
        self.quantization: str = config.quantization
        self.activation_terms = check_int8_activations(config.cpu_int8_activations,
                                                       self.quantization, self.device)
        self.context_len: int = config.context_length
        self.arch = dataclasses.replace(self.arch, served_context=self.context_len)
        if self.tp.size > 1:
            check_tp_size(self.arch, self.tp.size, self.model_path.name)
        if self.arch.is_hybrid and config.enable_hierarchical_cache:
            raise ValueError("--enable-hierarchical-cache keeps no recurrent states: not with "
                             "a hybrid model")
        if self.arch.is_hybrid:
            check_hybrid(self.arch, config.tp_size, config.mamba_ssm_dtype, self.device,
                         self.dtype)
        self.draft_arch = (draft_arch(config, self.arch, self.context_len)
                           if self.tp.is_primary else None)
        if self.draft_arch is not None and self.draft_arch[1].is_hybrid:
            raise ValueError("--speculative-draft-model-path: a hybrid draft model (recurrent "
                             "states) is not supported")
        try:
            if self.tp.size > 1 and self.tp.is_primary and group is None:
                self.workers = TPWorkers(self.tp.size, self.device, config.log_level,
                                         partial(worker_step_runner, config))
            if self.device.type == "cpu" and self.tp.is_primary:
                self.stream = CpuStream()  # built on the thread that will run the forwards
                if self.workers is not None:  # NOTE: process-wide; restored at shutdown
                    self._saved_threads = self.stream.call(
                        partial(_share_cores, cpu_threads(self.tp.size)))
                self.stream.call(self._build)
            else:
                self._build()
        except BaseException as exc:
            self._restore_threads()
            if self.workers is not None:
                error = self.workers.first_error()
                self.workers.shutdown(graceful=False)
                # NOTE: a ValueError here is bad input every rank meets (a checkpoint the TP
                # size cannot shard): it is reported as such, in one line
                if error is not None and not isinstance(exc, ValueError):
                    raise RuntimeError(error) from exc
            raise

    def _build(self) -> None:
        config = self.config
        if self.workers is not None:
            self.workers.wait_for("joining")
            self.group = create_group(self.workers.store, 0, self.tp.size, self.device,
                                      GLOO_TIMEOUT_S)
        with tp_context(self.tp, self.group):
            self.model = self._load(self.arch, self.model_path, self.quantization,
                                    config.model_path)
            # rank 0, a model whose prompts may hold images: what makes them its inputs
            images = getattr(self.model, "image_processor", None)
            self.image_processor = (images(self.model_path) if images is not None
                                    and self.tp.rank == 0 else None)
            settings = lora_settings(config.enable_lora, lora_adapters(config.lora_paths),
                                     config.max_loras_per_batch, config.max_lora_rank,
                                     config.lora_target_modules, config.max_loaded_loras)
            self.lora = (None if settings is None else
                         LoraModules(self.model, settings, self.dtype, self.device, self.tp))
        draft = None
        if self.draft_arch is not None:
            with tp_context(TPInfo(), None):  # NOTE: the draft model runs whole on rank 0
                draft = self._load_draft(*self.draft_arch)
        with tp_context(self.tp, self.group):
            self.max_running: int = config.max_running_requests
            self.page_size: int = config.page_size
            self.states = None if not self.arch.is_hybrid else allocate_state_pool(
                self.arch, self.tp.size, self.max_running + 1,
                (config.max_mamba_cache_size or 0) - self.max_running, self.dtype, self.device,
                scratch=0 if config.speculative_algorithm is None
                else config.speculative_num_draft_tokens - 1,
                state_dtype=getattr(torch, config.mamba_ssm_dtype))
            if self.states is not None:
                self.model.bind_states(self.states)
            self.kv_pool = allocate_kv_pool(
                config, kv_layout(self.model, self.arch), self.page_size, self.dtype,
                self.kv_cache_dtype, self.device, self.tp.size,
                draft_bytes_per_token=0 if draft is None else kv_layout(
                    *draft).bytes_per_token(self.kv_cache_dtype))
        self.config = config = dataclasses.replace(
            config, max_total_tokens=self.kv_pool.num_pages * self.page_size)
        self.page_store: PageStore | None = None  # rank 0, --enable-hierarchical-cache
        self.kv_fingerprint = b""
        if config.enable_hierarchical_cache and self.tp.is_primary:
            self.kv_fingerprint = kv_fingerprint(config, self.model_path, self.kv_pool)
            self.page_store = build_page_store(config, self.kv_pool, self.kv_fingerprint,
                                               self.device)
        kv_tiers = (KVTiers(self.kv_pool, self.tp, self.page_store)
                    if config.enable_hierarchical_cache else None)
        rows = self.max_running + 1  # the request rows, then the dummy row
        self.page_table = torch.zeros(rows, self.context_len, dtype=torch.int32, device=self.device)
        self.token_pool = torch.zeros(rows, self.context_len, dtype=torch.int32, device=self.device)
        self.page_table[self.dummy_row].fill_(self.kv_pool.dummy_loc)
        self.attn_backend = attention_for(config.attention_backend, self.arch, self.model,
                                          self.kv_pool, self.page_table, self.device, self.dtype)
        if self.device.type == "cpu" and hasattr(self.model, "fused_layers"):
            self.model.fused_layers = fuse_layers(self.model, self.attn_backend, self.tp.size)
        self.decode_weight_bytes = decode_weight_bytes(self.model)  # this rank's
        self.sampler = Sampler(self.arch.vocab_size, self.device, list(self.arch.eos_token_ids),
                               seed=config.seed)
        self.speculation = spec_config(config, self.device.type)
        graph_runner = None
        if (self.device.type == "cuda" and not config.disable_cuda_graph
                and not self.arch.is_hybrid and supports_graphs(self.attn_backend)
                and not syncs_on_host(self.model, self.dtype, self.device)):
            spec = self.speculation
            # NOTE: every rank captures the same sizes in the same order (collectives inside)
            graph_runner = GraphRunner(self.model, self.attn_backend,
                                       max_bs=min(config.cuda_graph_max_bs, self.max_running),
                                       dummy_row=self.dummy_row,
                                       dummy_loc=self.kv_pool.dummy_loc, device=self.device,
                                       lora=None if self.lora is None else self.lora.context,
                                       verify=None if spec is None else (
                                           spec.num_draft_tokens, spec.batch_tokens))
            with tp_context(self.tp, self.group):
                graph_runner.capture()
        speculator = None
        if self.speculation is not None and self.tp.is_primary:
            draft_model = None if draft is None else self._draft_runner(*draft)
            speculator = Speculator(self.speculation, self.token_pool, self.page_table,
                                    draft_model, self.states)
            if graph_runner is not None:
                speculator.pad_for_graphs(*graph_runner.verify_shape, self.kv_pool.dummy_loc)
        self.runner = ModelRunner(self.model, self.attn_backend, self.sampler, self.token_pool,
                                  graph_runner, self.tp, speculator, self.lora, self.states,
                                  kv_tiers)
        if not self.tp.is_primary:
            return  # a worker runs its steps on its main thread
        binding = (self.tp, self.group) if self.tp.size > 1 else None
        if isinstance(self.stream, CpuStream):
            if binding is not None:
                bind_thread(*binding)  # NOTE: _build runs on the engine thread itself
        else:
            from minisgl.engine.stream import CudaStream

            self.stream = CudaStream(self.device, binding, poll=cuda_wait_mode() == "poll")
        if self.workers is not None:
            self.workers.wait_for("ready")
            self.workers.start_monitor()

    def _load(self, arch: ModelArch, folder: Path, quantization: str, model_path: str | None
              ) -> torch.nn.Module:
        config = self.config
        return load_model(arch, folder, quantization, self.dtype, self.device,
                          load_format=config.load_format, seed=config.seed, model_path=model_path,
                          log=self.tp.is_primary, terms=self.activation_terms)

    def _load_draft(self, folder: Path, arch: ModelArch) -> tuple[torch.nn.Module, ModelArch]:
        """STANDALONE's draft model, whole on rank 0."""
        config = self.config
        return self._load(arch, folder, config.speculative_draft_model_quantization,
                          config.speculative_draft_model_path), arch

    def _draft_runner(self, model: torch.nn.Module, arch: ModelArch) -> DraftModel:
        """The draft model with a KV pool laid out as the target's (same pages, same table)."""
        pool = KVPool(kv_layout(model, arch), self.kv_pool.num_pages, self.page_size,
                      self.dtype, self.device, self.kv_cache_dtype)
        backend = attention_for(self.config.attention_backend, arch, model, pool,
                                self.page_table, self.device, self.dtype)
        assert self.speculation is not None
        return DraftModel(model, backend, self.sampler, self.token_pool, self.page_table,
                          self.speculation.catch_up_tokens)

    @property
    def graph_runner(self) -> GraphRunner | None:
        """CUDA graphs for decode (GPU only)."""
        runner = getattr(self, "runner", None)
        return runner.graph_runner if runner is not None else None

    @property
    def draft_model(self) -> DraftModel | None:
        """STANDALONE's draft model (rank 0)."""
        runner = getattr(self, "runner", None)
        speculator = runner.speculator if runner is not None else None
        return speculator.draft_model if speculator is not None else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.arch.eos_token_ids

    @property
    def dummy_row(self) -> int:
        """The row of page_table / token_pool that pads a batch (CUDA graphs): the last one,
        after the max_running request rows; its pages are the KV pool's dummy page."""
        return self.max_running

    def default_chunked_prefill_size(self, mixed: bool) -> int:
        """Prompt tokens per prefill step when --chunked-prefill-size is not given; `mixed`:
        with --enable-mixed-chunk. On CPU it keeps one layer's widest activation (this rank's
        share) within what the allocator serves without fresh mappings."""
        top_k = self.arch.moe.top_k if self.arch.moe is not None else 1
        widest_row_bytes = widest_row_width(self.model, top_k) * self.dtype.itemsize
        return default_chunk(self.device.type, mixed, widest_row_bytes)

    @property
    def runs_steps_in_order(self) -> bool:
        """Whether a launched step may wait for host work on the steps before it: its grammar
        mask (see GrammarMask), a verify step's layout (engine.speculation). Only the CPU
        engine thread can; a CUDA launch runs on the scheduler's thread."""
        return isinstance(self.stream, CpuStream)

    @property
    def phase_seconds(self) -> dict[str, float]:
        return self.runner.phase_seconds

    @property
    def phase_steps(self) -> dict[str, int]:
        return self.runner.phase_steps

    @property
    def forwarded_tokens(self) -> dict[str, int]:
        return self.runner.forwarded_tokens

    @property
    def busy_seconds(self) -> float:
        return self.runner.busy_seconds

    # ---- running steps -----------------------------------------------------------------------

    def plan_batch(self, batch: Batch) -> None:
        """Host side of a scheduled batch: graph padding and attention metadata."""
        self.runner.plan_batch(batch)

    def forward(self, fwd: ForwardInput) -> ForwardOutput:
        """The step itself, on the calling thread and stream; `launch` queues it there."""
        if fwd.verify is not None and not fwd.verify_step:  # not laid out yet
            self.runner.resolve(fwd)
        if fwd.steps > 1:
            return run_steps(fwd, self.runner.forward, self.runner.plan_batch)
        return self.runner.forward(fwd)

    def launch(self, fwd: ForwardInput) -> Completion:
        """Queue one forward on the engine stream (and, tp > 1, on every other rank). While
        speculating, the step message leaves from the engine stream, once a verify step is laid
        out (every message does, so the ranks get them in launch order)."""
        if self.workers is None:
            return self.stream.launch(partial(self.forward, fwd))
        if self.workers.failed is not None:
            raise EngineFailed(self.workers.failed)
        if fwd.message is None:
            raise ValueError("a tensor-parallel step needs its step message")
        if self.speculation is None:
            self._send(fwd)
        return self.stream.launch(partial(self._forward_tp, fwd,
                                          send=self.speculation is not None))

    def _send(self, fwd: ForwardInput) -> None:
        assert self.workers is not None and fwd.message is not None
        # NOTE: a hybrid's state copies are planned after the message was built
        fwd.message.state_loads = fwd.batch.state_loads
        fwd.message.state_saves = fwd.batch.state_saves
        if fwd.kv_moves is not None:
            fwd.message.kv_saves = fwd.kv_moves.save_pages
            fwd.message.kv_loads = fwd.kv_moves.load_pages
        try:
            self.workers.send(fwd.message.pack())
        except QueueClosed:
            raise EngineFailed(self.workers.failed or "a tensor-parallel worker is gone") from None

    def _forward_tp(self, fwd: ForwardInput, send: bool) -> ForwardOutput:
        if send:
            if fwd.verify is not None:
                self.runner.resolve(fwd)
                assert fwd.message is not None and self.runner.speculator is not None
                fwd.message.resolve(fwd.batch, fwd.load_indices, fwd.write_indices,
                                    fwd.logit_rows, self.runner.speculator.token_writes(fwd))
            self._send(fwd)
        try:
            return self.forward(fwd)
        except Exception as exc:  # a collective broke: most likely a rank died
            assert self.workers is not None
            raise EngineFailed(self.workers.explain_failure(exc)) from exc

    def move_pages(self, moves: KVMoves) -> Completion:
        """Queue page copies to and from the lower tiers outside a step (the scheduler, idle,
        with saves due), on every rank, in order with the steps."""
        assert self.runner.kv_tiers is not None
        if self.workers is not None:
            try:
                self.workers.send(moves_message(moves))
            except QueueClosed:
                raise EngineFailed(self.workers.failed or "a tensor-parallel worker is gone"
                                   ) from None
        return self.stream.launch(partial(self._move_pages, moves))

    def _move_pages(self, moves: KVMoves) -> None:
        assert self.runner.kv_tiers is not None
        try:
            self.runner.kv_tiers.run(moves)
        except Exception:  # NOTE: nobody awaits it; a broken rank fails the next step
            logger.exception("copying pages to the lower tiers failed")

    def run_step_message(self, arrays: list[np.ndarray]) -> None:
        """A worker's step: replay rank 0's table writes, rebuild the batch, run the forward
        (or only copy pages, `move_pages`)."""
        if int(arrays[0][0]) == MSG_MOVES:
            assert self.runner.kv_tiers is not None
            self.runner.kv_tiers.run(KVMoves(arrays[1].tolist(), arrays[2].tolist()))
            return
        message = StepMessage.unpack(arrays)
        message.replay_writes(self.token_pool, self.page_table)
        batch = message.batch(self.device)
        self.runner.plan_batch(batch)
        device = self.device
        self.runner.forward(ForwardInput(
            batch, message.load_indices.to(device), message.write_indices.to(device),
            logit_rows=None if message.logit_rows is None else message.logit_rows.to(device),
            sample_args=None, logits_only=message.logits_only, verify_step=message.verify_step,
            lora_loads=message.lora_loads, image_rows=message.image_rows,
            kv_moves=message.kv_moves()))

    # ---- failure and shutdown ----------------------------------------------------------------

    @property
    def failed(self) -> str | None:
        """Why this engine cannot run any more (a tensor-parallel rank died), else None: the
        one place to read it."""
        return self.workers.failed if self.workers is not None else self._failure

    def failure(self) -> asyncio.Future[str]:
        """The one way to await a failure: a future of the running loop that completes with
        `failed`'s message when the engine fails (at once if it already has; on tp 1 never).
        Every caller on the same loop gets the same future. Call on the loop."""
        loop = asyncio.get_running_loop()
        watch = self._failure_watch
        if watch is None or watch.loop is not loop:
            if watch is not None:
                watch.close()
            watch = self._failure_watch = FailureWatch(self.workers, self._failure)
        return watch.future

    def shutdown(self) -> None:
        """Stop the engine thread and, tp > 1, every worker; removes our shared memory. On
        CUDA the device memory is freed at once."""
        failed = self.failed
        if self.page_store is not None:
            self.page_store.close()
        if self._failure_watch is not None:
            self._failure_watch.close()
            self._failure_watch = None
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
            if self.graph_runner is not None:
                self.graph_runner.release()
                self.runner.graph_runner = None
            kv = getattr(self, "kv_pool", None)
            release_cuda_memory(self.device, [getattr(self, "page_table", None),
                                              getattr(self, "token_pool", None),
                                              *(kv.buffers.values() if kv is not None else ())],
                                getattr(self, "model", None))
            draft = self.draft_model
            if draft is not None:
                release_cuda_memory(self.device, [*draft.backend.kv_pool.buffers.values()],
                                    draft.model)

    def _restore_threads(self) -> None:
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None


def worker_step_runner(config: EngineConfig, tp: TPInfo, group: object
                       ) -> Callable[[list[np.ndarray]], None]:
    """What a tensor-parallel worker process runs: its own engine on its shard (the target
    `TPWorkers` spawns ranks 1..N-1 with), fed one step message at a time."""
    return Engine(config, tp=tp, group=group).run_step_message


def _share_cores(threads: int) -> int:
    """On the engine thread (tp > 1 on CPU: the ranks share the host's cores): set torch's
    intra-op threads, the process default and this thread's; returns the previous count. The
    caller's thread keeps its own (the event loop's runs without OpenMP)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    return previous


# CPU: after a step of this many tokens the heap's free pages go back to the OS (see forward)
RETURN_HEAP_AFTER_TOKENS = 1024


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn_backend, sampler: Sampler,
                 token_pool: torch.Tensor, graph_runner: GraphRunner | None, tp: TPInfo,
                 speculator: Speculator | None = None, lora: LoraModules | None = None,
                 states: StatePool | None = None, kv_tiers: KVTiers | None = None) -> None:
        self.model, self.attn_backend, self.sampler = model, attn_backend, sampler
        self.kv_tiers = kv_tiers  # --enable-hierarchical-cache
        self.token_pool, self.graph_runner, self.tp = token_pool, graph_runner, tp
        self.flat_tokens = token_pool.view(-1)  # NOTE: made once: every op in the step counts
        self.speculator = speculator  # rank 0 of a speculating engine
        self.lora = lora  # --enable-lora
        self.states = states  # a hybrid model's recurrent states
        self.encoded_images = EncodedImages()  # rank 0: recent images' encoder outputs
        self.device = token_pool.device
        self.phase_seconds = {phase: 0.0 for phase in PHASES}
        self.phase_steps = {phase: 0 for phase in PHASES}
        self.forwarded_tokens = {"prefill": 0, "decode": 0}  # mixed steps count in both

    def plan_batch(self, batch: Batch) -> None:
        """Host side, when the batch is scheduled: pad a decode batch to its graph size (dummy
        rows, dummy page), then build the attention metadata."""
        if self.graph_runner is not None:
            self.graph_runner.pad_batch(batch)
        self.attn_backend.prepare_metadata(batch)

    def resolve(self, fwd: ForwardInput) -> None:
        """Lay out a verify step once the steps before it ran (rank 0; see engine.speculation)."""
        assert self.speculator is not None
        self.speculator.resolve(fwd)
        self.plan_batch(fwd.batch)

    def forward(self, fwd: ForwardInput) -> ForwardOutput:
        """Runs on the engine stream (GPU) or the engine thread (CPU), in launch order."""
        started = time.perf_counter()
        if fwd.kv_moves is not None:
            assert self.kv_tiers is not None
            self.kv_tiers.run(fwd.kv_moves)
        if self.lora is not None:
            self.lora.begin_step(fwd.lora_loads, fwd.batch)
        logits, scored, embeddings = self._logits(fwd)
        if self.device.type == "cpu" and len(fwd.load_indices) >= RETURN_HEAP_AFTER_TOKENS:
            # NOTE: glibc keeps a prefill chunk's freed activations resident, on top of a KV
            # pool that fills as the requests decode (BENCHMARKS.md)
            return_freed_heap()
        if fwd.logits_only:
            return ForwardOutput(logits=logits.float())
        if self.tp.rank:  # rank 0 samples; every rank stores its choice
            next_tokens = torch.empty(len(fwd.write_indices), dtype=torch.int32,
                                      device=self.device)
            self.flat_tokens[fwd.write_indices] = broadcast(next_tokens, 0)
            if fwd.verify_step and self.states is not None:
                self._keep_states_as_rank_0(fwd.batch)
            return ForwardOutput()
        output = self._sample(fwd, logits, scored)
        output.embeddings = embeddings
        if self.speculator is not None and fwd.verify is None:
            self.speculator.record_step(fwd)
        self._count(fwd.batch, started, verify=fwd.verify)
        return output

    def _logits(self, fwd: ForwardInput
                ) -> tuple[torch.Tensor, InputLogprobs | None, torch.Tensor | None]:
        """The batch's next-token logits (replayed from a CUDA graph where one fits), the
        input logprobs of its scored prompt rows and the embeddings of its embedding rows
        (each None without any)."""
        batch = fwd.batch
        input_ids = self.flat_tokens[fwd.load_indices]
        if fwd.image_rows is not None:
            batch.input_embeds = spliced_embeddings(self.model, fwd.image_rows, fwd.images,
                                                    self.encoded_images, self.tp, self.device)
        # NOTE: the model's RoPE reads these rows (attention reads batch.input_positions)
        positions = (batch.input_positions if batch.rope_positions is None
                     else batch.rope_positions)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch, input_ids, positions), None, None
        if fwd.num_scored_rows or fwd.embed_rows is not None:
            # NOTE: the same collectives as the model's forward on the other ranks: the LM
            # head on the sampling rows, then (every rank) on the scored rows
            hidden = self.model.hidden_states(input_ids, positions, batch, self.attn_backend,
                                              fwd.logit_rows)
            embeddings = (None if fwd.embed_rows is None
                          else last_token_embeddings(hidden, fwd.embed_rows))
            logits = self.model.lm_head(hidden[: batch.size])
            scored = (score_rows(self.model.lm_head, hidden[batch.size:], fwd.input_logprobs)
                      if fwd.num_scored_rows else None)
            return logits, scored, embeddings
        return self.model(input_ids, positions, batch, self.attn_backend,
                          fwd.logit_rows), None, None

    def _keep_states_as_rank_0(self, batch: Batch) -> None:
        """A verify step on a worker: each row's recurrent states (this rank's heads') back to
        those after its accepted tokens, from the sources rank 0 chose
        (Speculator.keep_accepted_states)."""
        assert self.states is not None
        rows = to_device(torch.tensor(batch.table_rows[:batch.size]), self.device)
        self.states.copy(broadcast(torch.empty_like(rows), 0), rows)

    def _sample(self, fwd: ForwardInput, logits: torch.Tensor,
                scored: InputLogprobs | None) -> ForwardOutput:
        """Rank 0: sample (under the grammar's mask), store the ids in the token pool, share
        them with the other ranks, and copy the results to the host."""
        mask = None
        if fwd.grammar is not None:  # NOTE: may wait for the scheduler (see GrammarMask)
            bitmask = fwd.grammar.wait()
            mask = (fwd.grammar.rows, bitmask.to(self.device, non_blocking=True))
        if fwd.verify is not None:
            assert self.speculator is not None
            output, stored = self.speculator.verify(fwd, logits, self.sampler, mask)
            sources = self.speculator.keep_accepted_states(fwd)
            self.flat_tokens[fwd.write_indices] = stored
            if self.tp.size > 1:
                broadcast(stored, 0)
                if sources is not None:  # each rank rolls its own heads' states back
                    broadcast(sources, 0)
            return output
        sample = self.sampler.sample(logits[: fwd.batch.size], fwd.sample_args, self.token_pool,
                                     mask)
        self.flat_tokens[fwd.write_indices] = sample.next_tokens
        if self.tp.size > 1:
            broadcast(sample.next_tokens, 0)
        tops = sample.top_logprobs
        return ForwardOutput(
            token_ids=to_host(sample.next_tokens), logprobs=to_host(sample.logprobs),
            top_logprobs=None if tops is None else (to_host(tops[0]), to_host(tops[1])),
            input_logprobs=scored)

    def _count(self, batch: Batch, started: float, verify: VerifyRows | None) -> None:
        """NOTE: on CPU this is the real compute time; on CUDA only the launch time. A verify
        step counts as decode, with its rows' tokens (not the fillers of a graph's layout)."""
        phase = "decode" if verify is not None else batch.phase
        seconds = time.perf_counter() - started
        self.phase_seconds[phase] += seconds
        self.phase_steps[phase] += 1
        if phase == "decode":
            tokens = sum(verify.counts) if verify is not None else batch.size  # no fillers
            self.forwarded_tokens["decode"] += tokens
            if self.speculator is not None:
                self.speculator.observe_step(tokens, seconds)
            return
        self.forwarded_tokens["decode"] += batch.decode_rows
        self.forwarded_tokens["prefill"] += sum(batch.extend_lens[:batch.size - batch.decode_rows])

    @property
    def busy_seconds(self) -> float:
        return sum(self.phase_seconds.values())
