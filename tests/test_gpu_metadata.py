"""Host-side logic of the GPU path, checked on any machine: FlashInfer's paged metadata and page
ids, the strided HND view of the head-major pool, CUDA-graph padding, the event poller, and
imports that must not need FlashInfer or CUDA."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minisgl.attention import AttentionBackend
from minisgl.attention.flashinfer_backend import build_paged_metadata, page_indices, paged_view
from minisgl.attention.torch_backend import TorchBackend
from minisgl.core import Batch
from minisgl.engine.stream import wait_event
from minisgl.engine.graph import GraphRunner, graph_batch_sizes
from minisgl.errors import EngineFailed
from tests import paged_scenario as scenario
from tests.conftest import REPO_ROOT


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_metadata_and_page_ids_follow_the_page_table(page_size: int) -> None:
    num_pages, ctx = 200, 128
    locations = scenario.assign_locations(num_pages, page_size, seed=page_size)
    page_table = torch.full((5, ctx), -1, dtype=torch.int32)
    scenario.fill_page_table(page_table, locations)
    rows, seq_lens, extend = [2, 0, 1], [25, 40, 55], [3, 40, 1]
    meta = build_paged_metadata(rows, seq_lens, extend, page_size, ctx, is_decode=False)
    pages = [-(-n // page_size) for n in seq_lens]
    assert meta.kv_indptr.tolist() == [0, pages[0], pages[0] + pages[1], sum(pages)]
    assert meta.last_page_len.tolist() == [n - (p - 1) * page_size for n, p in zip(seq_lens, pages)]
    assert all(1 <= x <= page_size for x in meta.last_page_len.tolist())
    assert meta.qo_indptr.tolist() == [0, 3, 43, 44]
    assert meta.kv_indptr.dtype == meta.last_page_len.dtype == torch.int32
    ids = page_indices(page_table, meta.gather, meta.num_pages, page_size)
    expected = torch.cat([locations[r][:n:page_size] // page_size
                          for r, n in zip(rows, seq_lens)]).to(torch.int32)
    assert ids.dtype == torch.int32 and torch.equal(ids, expected)
    decode = build_paged_metadata(rows, seq_lens, [1, 1, 1], page_size, ctx, is_decode=True)
    assert decode.qo_indptr is None and decode.num_pages == sum(pages)


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_view_is_the_pool_memory(page_size: int) -> None:
    heads, pages, dim = 3, 5, 8
    cache = torch.randn(heads, pages * page_size, dim)
    view = paged_view(cache, page_size)
    assert view.shape == (pages, heads, page_size, dim)
    assert view.stride() == (page_size * dim, pages * page_size * dim, dim, 1)
    assert view.data_ptr() == cache.data_ptr()
    p, h, e = pages - 2, heads - 1, page_size - 1
    assert torch.equal(view[p, h, e], cache[h, p * page_size + e])


class EmulatedFlashInfer(AttentionBackend):
    """FlashInfer's contract in plain torch, fed exactly what FlashInferBackend feeds it: the
    same metadata, page ids and strided view; causal masks aligned to the end of the KV."""

    def prepare_metadata(self, batch: Batch) -> None:
        batch.attn_metadata = build_paged_metadata(
            batch.table_rows, batch.seq_lens, batch.extend_lens, self.kv_pool.page_size,
            self.page_table.shape[1], batch.is_decode)

    def forward(self, q, k, v, layer_id, batch, sinks=None):
        assert sinks is None  # as the real one: a model with sinks never gets this backend
        ps = self.kv_pool.page_size
        k_cache, v_cache = self.kv_pool.layer(layer_id)
        k_cache.index_copy_(1, batch.out_loc, k.transpose(0, 1))
        v_cache.index_copy_(1, batch.out_loc, v.transpose(0, 1))
        meta = batch.attn_metadata
        ids = page_indices(self.page_table, meta.gather, meta.num_pages, ps).long()
        kp, vp = paged_view(k_cache, ps), paged_view(v_cache, ps)
        qo = (torch.arange(meta.batch_size + 1) if meta.is_decode else meta.qo_indptr).tolist()
        kv_indptr, last = meta.kv_indptr.tolist(), meta.last_page_len.tolist()
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)
        for b in range(meta.batch_size):
            pages = ids[kv_indptr[b]:kv_indptr[b + 1]]
            kv_len = (len(pages) - 1) * ps + last[b]
            kb = kp[pages].permute(1, 0, 2, 3).reshape(kp.shape[1], -1, kp.shape[3])[:, :kv_len]
            vb = vp[pages].permute(1, 0, 2, 3).reshape(vp.shape[1], -1, vp.shape[3])[:, :kv_len]
            qb = q[qo[b]:qo[b + 1]].transpose(0, 1)
            n = qb.shape[1]
            mask = torch.arange(kv_len)[None, :] <= torch.arange(n)[:, None] + (kv_len - n)
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=self.scale,
                                               enable_gqa=True)
            out[qo[b]:qo[b + 1]] = o.transpose(0, 1).reshape(n, -1)
        return out


@pytest.mark.parametrize("steps", ["unmixed", "mixed"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_metadata_drives_the_same_attention_as_torch(page_size: int, steps: str
                                                                 ) -> None:
    """End to end through the model on the CPU: the metadata, page ids and strided view the
    FlashInfer backend hands to its kernels give the torch backend's logits."""
    from minisgl.engine import Engine, EngineConfig
    engine = Engine(EngineConfig(
        model_path="qwen3-0.6b", load_format="dummy", device="cpu", dtype="float32",
        json_model_override_args='{"num_hidden_layers": 2, "vocab_size": 4096}',
        max_total_tokens=1024, max_running_requests=4, page_size=page_size, context_length=128))
    try:
        locations = scenario.assign_locations(engine.kv_pool.num_pages, page_size, seed=1)
        ids = scenario.token_ids(seed=1)
        plan = scenario.MIXED_STEPS if steps == "mixed" else scenario.STEPS
        scale = engine.arch.head_dim ** -0.5
        ref = scenario.run_scenario(engine.model, TorchBackend(engine.kv_pool, engine.page_table,
                                                               scale),
                                    engine.page_table, locations, ids, plan)
        ours = scenario.run_scenario(engine.model, EmulatedFlashInfer(
            engine.kv_pool, engine.page_table, scale), engine.page_table, locations, ids, plan)
        for step, (a, b) in enumerate(zip(ours, ref)):
            assert scenario.relative_error(a, b) < 1e-4, f"step {step}"
    finally:
        engine.shutdown()


class StubGraphBackend:
    def init_graphs(self, max_bs, verify_width=0, verify_rows=0): ...
    def prepare_capture(self, batch, bs): ...
    def prepare_replay(self, batch, bs): ...


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(160)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 160
    assert all(b % 8 == 0 for b in sizes[3:])


def _decode_batch(n: int, dummy_loc: int) -> Batch:
    return Batch("decode", n, table_rows=list(range(n)), cached_lens=[10 + i for i in range(n)],
                 seq_lens=[11 + i for i in range(n)], extend_lens=[1] * n,
                 input_positions=torch.arange(10, 10 + n), out_loc=torch.arange(n) * 7)


def test_pad_batch_pads_decode_batches_with_the_dummy_row() -> None:
    runner = GraphRunner(lambda *a: None, StubGraphBackend(), max_bs=32, dummy_row=40,
                         dummy_loc=999, device="cpu")
    runner.graphs = dict.fromkeys((b, 1) for b in runner.batch_sizes)  # as if captured
    batch = _decode_batch(5, 999)
    assert runner.pad_batch(batch) == 3 and batch.size == 5 and batch.padded_size == 8
    assert batch.table_rows[5:] == [40] * 3 and batch.seq_lens[5:] == [1] * 3
    assert batch.cached_lens[5:] == [0] * 3 and batch.extend_lens[5:] == [1] * 3
    assert batch.input_positions.tolist()[5:] == [0] * 3
    assert batch.out_loc.tolist() == [0, 7, 14, 21, 28, 999, 999, 999]
    assert runner.can_run(batch)
    # a tensor-parallel worker: lists already padded by rank 0, positions/out_loc not
    worker = _decode_batch(5, 999)
    worker.table_rows, worker.seq_lens = batch.table_rows, batch.seq_lens
    worker.cached_lens, worker.extend_lens = batch.cached_lens, batch.extend_lens
    runner.pad_batch(worker)
    assert worker.table_rows == batch.table_rows and worker.padded_size == 8
    assert torch.equal(worker.out_loc, batch.out_loc) and runner.can_run(worker)
    exact = _decode_batch(8, 999)
    assert runner.pad_batch(exact) == 0 and runner.can_run(exact)
    unpadded = _decode_batch(5, 999)
    assert not runner.can_run(unpadded)  # never padded: runs eagerly
    big = _decode_batch(33, 999)
    assert runner.pad_batch(big) == 0 and not runner.can_run(big)
    prefill = _decode_batch(4, 999)
    prefill.phase = "prefill"
    assert runner.pad_batch(prefill) == 0 and not runner.can_run(prefill)


def test_pad_batch_pads_verify_steps_to_their_graph_size() -> None:
    """Verify graphs (engine.graph): rows of `width` tokens, up to the step's token budget;
    a verify step laid out at that width pads with dummy rows of `width` tokens."""
    runner = GraphRunner(lambda *a: None, StubGraphBackend(), max_bs=32, dummy_row=40,
                         dummy_loc=999, device="cpu", verify=(4, 64))
    assert runner.sizes == {1: graph_batch_sizes(32), 4: [1, 2, 4, 8, 16]}
    assert runner.input_ids.numel() == 64
    runner.graphs = {(b, w): None for w, sizes in runner.sizes.items() for b in sizes}
    assert runner.verify_shape == (4, 16)
    batch = Batch("prefill", 3, table_rows=[0, 1, 2], cached_lens=[10, 20, 30],
                  seq_lens=[14, 24, 34], extend_lens=[4] * 3,
                  input_positions=torch.arange(12), out_loc=torch.arange(12) + 100, row_tokens=4)
    assert runner.pad_batch(batch) == 1 and batch.padded_size == 4
    assert batch.table_rows[3] == 40 and batch.seq_lens[3] == 4 and batch.extend_lens[3] == 4
    assert batch.cached_lens[3] == 0 and batch.out_loc.tolist()[12:] == [999] * 4
    assert batch.input_positions.numel() == 16 and runner.can_run(batch)
    unpadded = Batch("prefill", 3, table_rows=[0, 1, 2], cached_lens=[10, 20, 30],
                     seq_lens=[14, 22, 34], extend_lens=[4, 2, 4],
                     input_positions=torch.arange(10), out_loc=torch.arange(10))
    assert runner.pad_batch(unpadded) == 0 and not runner.can_run(unpadded)  # packed: eager
    wide = Batch("prefill", 17, table_rows=list(range(17)), cached_lens=[0] * 17,
                 seq_lens=[4] * 17, extend_lens=[4] * 17, input_positions=torch.zeros(68),
                 out_loc=torch.zeros(68), row_tokens=4)
    assert runner.pad_batch(wide) == 0 and not runner.can_run(wide)  # past the largest size
    assert GraphRunner(lambda *a: None, StubGraphBackend(), max_bs=32, dummy_row=40,
                       dummy_loc=999, device="cpu", verify=(8, 4)).sizes.keys() == {1}


class FakeEvent:
    def __init__(self, ready_after: int) -> None:
        self.calls, self.ready_after = 0, ready_after

    def query(self) -> bool:
        self.calls += 1
        return self.calls > self.ready_after


def test_wait_event_polls_until_ready_then_backs_off() -> None:
    assert asyncio.run(wait_event(FakeEvent(0))) == 0
    assert asyncio.run(wait_event(FakeEvent(5))) == 5
    assert asyncio.run(wait_event(FakeEvent(20), spin_s=0.0, max_sleep_s=1e-4)) == 20

    async def failing() -> None:
        failure = asyncio.get_running_loop().create_future()
        failure.set_result("rank 1 died")
        await wait_event(FakeEvent(10**9), failure=failure)

    with pytest.raises(EngineFailed, match="rank 1 died"):
        asyncio.run(failing())


def test_gpu_modules_import_without_flashinfer_or_cuda() -> None:
    code = ("import sys, minisgl.engine.graph, minisgl.attention.flashinfer_backend, "
            "minisgl.engine.stream; assert 'flashinfer' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)
    subprocess.run([sys.executable, "-m", "minisgl.bench", "gpu", "--help"], check=True,
                   cwd=REPO_ROOT, capture_output=True)


def test_flashinfer_backend_says_how_to_install() -> None:
    try:
        import flashinfer  # noqa: F401
        pytest.skip("flashinfer is installed")
    except ImportError:
        pass
    from minisgl.attention import create_attention_backend
    from minisgl.kvcache import KVLayout, KVPool
    pool = KVPool(KVLayout.uniform(1, 1, 8), 4, 1, torch.float32, torch.device("cpu"))
    with pytest.raises(ImportError, match=r"pip install minisgl\[gpu\]"):
        create_attention_backend("flashinfer", pool, torch.zeros(2, 4, dtype=torch.int32), 1.0)
