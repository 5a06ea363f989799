"""The hierarchical prefix cache (--enable-hierarchical-cache): pages the KV pool no longer
holds come back from host memory or disk instead of being recomputed.

The reference for a page read back is the same prompt served from the pool's own prefix
cache: both runs prefill the same suffix over the same KV bytes, so their logprobs are equal
exactly; the tokens also equal those of a run that computed the whole prompt."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import requests
import torch

from minisgl import LLM
from minisgl.args import ServerArgs
from minisgl.core import IMAGE_KEY_SHIFT, cache_id_kind
from minisgl.flag_checks import parse_size
from minisgl.kvcache import KVLayout, KVPool
from minisgl.kvcache.page_store import HEADER, DiskTier, HostTier, PageStore, page_keys
from minisgl.scheduler.hicache import TierCache
from tests import reference as ref
from tests.conftest import start_minisgl_server
from tests.test_model_configs import save_tiny
from tests.test_quantization import TEXT

PAGE = 16
PROMPT_LEN = 400
SERVED = (PROMPT_LEN - 1) // PAGE * PAGE  # a match never covers a prompt's last token


def prompts(count: int) -> list[list[int]]:
    """`count` prompts of PROMPT_LEN real-text tokens, apart from their first page on."""
    text = ref.prompt_ids(TEXT)
    return [[1000 + i] + (text * 3)[:PROMPT_LEN - 1] for i in range(count)]


# ---- the tiers on their own --------------------------------------------------------------------

def test_page_keys_chain_on_the_pages_before_and_the_fingerprint():
    ids = list(range(64))
    keys = page_keys(b"a" * 16, ids, 16)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert page_keys(b"a" * 16, ids, 16, start=2) == keys[2:]
    assert page_keys(b"a" * 16, ids[:40], 16) == keys[:2]  # a partial page has no key
    assert page_keys(b"b" * 16, ids, 16)[0] != keys[0]
    assert page_keys(b"a" * 16, [99] + ids[1:], 16)[3] != keys[3]  # the first page differs
    assert len(page_keys(b"a" * 16, [1 << 200] * 16, 16)) == 1  # image keys are wide


def read(tier: DiskTier | HostTier, key: bytes, size: int = 64) -> torch.Tensor | None:
    out = torch.empty(size, dtype=torch.uint8)
    return out if tier.read_into(key, out.numpy()) else None


def payload(seed: int, size: int = 64) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_disk_tier_survives_a_restart_and_drops_the_least_recently_used(tmp_path: Path):
    keys = [bytes([i]) * 16 for i in range(5)]
    tier = DiskTier(tmp_path, 64, max_bytes=3 * (HEADER.size + 64))
    for i in range(3):
        tier.put(keys[i], payload(i))
    assert read(tier, keys[0]) is not None  # now the most recently used
    tier.put(keys[3], payload(3))  # over the limit: keys[1] goes
    assert [k in tier for k in keys] == [True, False, True, True, False]
    assert len(list(tmp_path.iterdir())) == 3
    again = DiskTier(tmp_path, 64, max_bytes=10**6)
    assert [k in again for k in keys] == [True, False, True, True, False]
    assert torch.equal(read(again, keys[2]), payload(2))


def test_disk_tier_ignores_truncated_altered_and_foreign_files(tmp_path: Path, caplog):
    keys = [bytes([i]) * 16 for i in range(3)]
    tier = DiskTier(tmp_path, 64, max_bytes=10**6)
    for i, key in enumerate(keys):
        tier.put(key, payload(i))
    first, second = (tmp_path / f"{key.hex()}.kvpage" for key in keys[:2])
    first.write_bytes(first.read_bytes()[:-1])  # cut short
    data = bytearray(second.read_bytes())
    data[-5] ^= 1  # one bit of the payload
    second.write_bytes(bytes(data))
    (tmp_path / "notes.kvpage").write_text("not a page")
    (tmp_path / f"{'ab' * 16}.kvpage").write_bytes(b"\0" * (HEADER.size + 64))  # a bad header
    with caplog.at_level("WARNING"):
        tier = DiskTier(tmp_path, 64, max_bytes=10**6)
        assert read(tier, keys[0]) is None and read(tier, keys[1]) is None
        assert read(tier, bytes.fromhex("ab" * 16)) is None
        assert torch.equal(read(tier, keys[2]), payload(2))
    assert "notes.kvpage is not a page" in caplog.text
    assert caplog.text.count("does not check") == 3
    assert not first.exists() and not second.exists()  # removed, never served
    assert tier.stats.rejected == 3 and keys[0] not in tier


def test_host_tier_keeps_its_limit_least_recently_used_first():
    tier = HostTier(max_bytes=3 * 64)
    keys = [bytes([i]) * 16 for i in range(4)]
    for i in range(3):
        tier.put(keys[i], payload(i))
    read(tier, keys[0])
    tier.put(keys[3], payload(3))
    assert [k in tier for k in keys] == [True, False, True, True]
    assert tier.stats.nbytes == 3 * 64


def test_a_load_stops_at_the_first_page_no_tier_serves_intact(tmp_path: Path):
    host, disk = HostTier(10**6), DiskTier(tmp_path, 64, 10**6)
    store = PageStore([host, disk], 64)
    keys = [bytes([i]) * 16 for i in range(4)]
    store.save(keys, torch.stack([payload(i) for i in range(4)])).result()
    host._pages.clear()  # only the disk has them now
    (tmp_path / f"{keys[2].hex()}.kvpage").write_bytes(b"junk")
    assert store.hits(keys) == 4  # the index alone: no IO
    results = []
    store.load(keys, results.append).result()
    assert results[0].tiers == ["disk", "disk"]
    assert all(torch.equal(p, payload(i)) for i, p in enumerate(results[0].payloads))
    assert len(results[0].payloads) == 2
    assert keys[0] in host  # a disk hit warms the host tier
    store.close()


def test_pool_pages_read_back_bytewise(tmp_path: Path):
    """Every buffer, its scales (int8) and every layer of a page make its payload."""
    for cache_dtype in (None, torch.int8, torch.float8_e4m3fn):
        pool = KVPool(KVLayout(((2, 8), (2, 8), (1, 16))), 10, 4, torch.bfloat16,
                      torch.device("cpu"), cache_dtype)
        for buffer in [*pool.buffers.values(), *pool.scales.values()]:
            raw = buffer.view(torch.uint8) if buffer.dtype != torch.float32 else buffer
            raw.copy_(torch.randint(0, 100, raw.shape).to(raw.dtype))
        data = pool.read_pages(torch.tensor([3, 7]))
        assert data.shape == (2, pool.page_bytes)
        pool.write_pages(torch.tensor([0, 5]), data)
        for layer in range(3):
            for half, scales in zip(pool.layer(layer), pool.layer_scales(layer)):
                for src, dst in ((3, 0), (7, 5)):
                    assert torch.equal(half[:, src * 4:src * 4 + 4].view(torch.uint8),
                                       half[:, dst * 4:dst * 4 + 4].view(torch.uint8))
                    if scales is not None:
                        assert torch.equal(scales[:, src * 4:src * 4 + 4],
                                           scales[:, dst * 4:dst * 4 + 4])


def test_kv_computed_under_an_adapter_is_never_saved(tmp_path: Path):
    store = PageStore([HostTier(10**6)], 64)
    tiers = TierCache(store, b"f" * 16, PAGE, write_back=False)
    ids = list(range(32))
    assert cache_id_kind(ids[0]) == 0 and cache_id_kind((1 << IMAGE_KEY_SHIFT) + 5) == 0
    tiers.offer([t + (2 << 32) for t in ids], torch.arange(32))  # lora uid 1
    tiers.offer([((3 << IMAGE_KEY_SHIFT) + 7)] * 16 + ids[16:], torch.arange(32))  # its image
    assert tiers.take_moves() is None
    tiers.offer([t + (1 << 32) for t in ids], torch.arange(32))  # LongRoPE's kind: kept
    moves = tiers.take_moves()
    assert moves is not None and moves.save_pages == [0, 1]
    store.close()


@pytest.mark.parametrize("flags, error", [
    ({"hicache_storage_backend": "file"}, "needs --enable-hierarchical-cache"),
    ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "--disable-radix-cache"),
    ({"enable_hierarchical_cache": True, "speculative_algorithm": "STANDALONE",
      "speculative_draft_model_path": "x"}, "STANDALONE"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
      "hicache_storage_backend_extra_config": '{"max_sizes": 1}'}, "unknown key 'max_sizes'"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
      "hicache_storage_backend_extra_config": '{"max_size": "ten"}'}, "not a size"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake"}, "file"),
])
def test_what_the_hierarchical_cache_cannot_do_is_refused(flags, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        ServerArgs(**flags)


def test_sizes_read_like_sglangs():
    assert parse_size("64Gi") == 64 * 2**30 and parse_size("10G") == 10**10
    assert parse_size(4096) == 4096 and parse_size("512MB") == 512 * 10**6


# ---- served -------------------------------------------------------------------------------------

def serve(folder: Path, *extra: str):
    return start_minisgl_server(
        "--max-total-tokens", "1024", "--page-size", str(PAGE), "--max-running-requests", "4",
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-dir", str(folder), *extra)


def generate(url: str, ids: list[int]) -> dict:
    response = requests.post(f"{url}/generate", timeout=300, json={
        "input_ids": ids, "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})
    response.raise_for_status()
    meta = response.json()["meta_info"]
    return {"ids": response.json()["output_ids"], "cached": meta["cached_tokens"],
            "details": meta["cached_tokens_details"],
            "logprobs": [entry[0] for entry in meta["output_token_logprobs"]]}


def counter(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=30).text
    match = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)
    assert match is not None, name
    return float(match.group(1))


def page_file(folder: Path, ids: list[int], page: int) -> Path:
    """The disk tier's file of `ids`' page `page` (its folder is named by the fingerprint)."""
    (model_folder,) = [p for p in folder.iterdir() if p.is_dir()]
    key = page_keys(bytes.fromhex(model_folder.name), ids, PAGE)[page]
    return model_folder / f"{key.hex()}.kvpage"


def test_an_evicted_prefix_comes_back_from_disk_also_after_a_restart(tmp_path: Path):
    """A prompt evicted from a 1024-token pool by three others is read back from disk: the
    same logprobs as when the pool itself served it, the same tokens as computing it all. A
    restarted server serves it from disk at once; a cut-short or altered page ends the load
    there (the rest is recomputed, the tokens unchanged)."""
    a, b, c, d = prompts(4)
    server = serve(tmp_path)
    try:
        computed = generate(server.url, a)
        from_pool = generate(server.url, a)
        others = [generate(server.url, other) for other in (b, c, d)]
        from_disk = generate(server.url, a)
        assert counter(server.url, "minisgl_hicache_disk_hit_tokens_total") >= SERVED
        assert counter(server.url, "minisgl_hicache_saved_bytes_total") > 0
        sample = requests.get(f"{server.url}/dashboard/data", timeout=30).json()
        assert sample["server"]["hierarchical_cache"] is True
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert computed["cached"] == 0 and from_pool["cached"] == from_disk["cached"] == SERVED
    assert from_disk["logprobs"] == from_pool["logprobs"]
    assert from_disk["ids"] == from_pool["ids"] == computed["ids"]
    assert from_pool["details"] == {"device": SERVED, "host": 0, "storage": 0,
                                    "storage_backend": "file"}
    assert from_disk["details"] == {"device": 0, "host": 0, "storage": SERVED,
                                    "storage_backend": "file"}

    page_file(tmp_path, b, 5).write_bytes(page_file(tmp_path, b, 5).read_bytes()[:-100])
    altered = page_file(tmp_path, c, 10)
    data = bytearray(altered.read_bytes())
    data[HEADER.size + 7] ^= 0x40
    altered.write_bytes(bytes(data))
    server = serve(tmp_path)
    try:
        warm = generate(server.url, a)
        cut, flipped = generate(server.url, b), generate(server.url, c)
        assert counter(server.url, "minisgl_hicache_rejected_pages_total") == 1
        chunks = requests.post(f"{server.url}/v1/completions", timeout=300, json={
            "prompt": d, "max_tokens": 4, "stream": True, "return_cached_tokens_details": True,
        }).text.split("\n\n")
        details = [json.loads(chunk.removeprefix("data: "))["sglext"] for chunk in chunks
                   if chunk.startswith("data: {") and "sglext" in chunk]
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert warm["cached"] == SERVED and warm["logprobs"] == from_pool["logprobs"]
    assert cut["cached"] == 5 * PAGE and flipped["cached"] == 10 * PAGE
    log = "".join(server.stderr)
    assert "is not a page of this pool" in log and "does not check" in log
    assert cut["ids"] == others[0]["ids"] and flipped["ids"] == others[1]["ids"]
    assert details == [{"cached_tokens_details": {"device": 0, "host": 0, "storage": SERVED,
                                                  "storage_backend": "file"}}]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_host_and_disk_tiers_write_back_on_two_ranks(tp_size: int, tmp_path: Path):
    """Write-back (pages saved when the pool evicts them), a host tier in front of the disk,
    each rank's heads in a page's payload: prompts evicted and read back give the logprobs
    the pool's own prefix cache gave."""
    save_tiny("LlamaForCausalLM", "LlamaConfig", tmp_path / "model")
    gen = torch.Generator().manual_seed(5)
    many = [torch.randint(3, 250, (200,), generator=gen).tolist() for _ in range(5)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with LLM(model=str(tmp_path / "model"), dtype="float32", max_total_tokens=512,
             page_size=PAGE, tp_size=tp_size, enable_hierarchical_cache=True, hicache_size=1,
             hicache_write_policy="write_back", hicache_storage_backend="file",
             hicache_storage_dir=str(tmp_path / "tiers")) as llm:
        first = [llm.generate(input_ids=p, sampling_params=params, return_logprob=True)
                 for p in many[:2]]
        pooled = [llm.generate(input_ids=p, sampling_params=params, return_logprob=True)
                  for p in many[:2]]
        for p in many[2:]:
            llm.generate(input_ids=p, sampling_params=params)
        back = [llm.generate(input_ids=p, sampling_params=params, return_logprob=True)
                for p in many[:2]]
        state = llm.runtime.scheduler.state()
        llm.check_integrity()
    assert state["hicache_host_hit_tokens"] + state["hicache_disk_hit_tokens"] >= 2 * 192
    for one, pool, tier in zip(first, pooled, back):
        assert pool["meta_info"]["cached_tokens"] == tier["meta_info"]["cached_tokens"] == 192
        assert tier["meta_info"]["output_token_logprobs"] == pool["meta_info"][
            "output_token_logprobs"]
        assert tier["output_ids"] == one["output_ids"]
    assert any((tmp_path / "tiers").rglob("*.kvpage"))


def test_cpu_without_a_tier_says_so(caplog):
    with caplog.at_level("INFO"), LLM(dtype="float32", max_total_tokens=1024,
                                      enable_hierarchical_cache=True) as llm:
        assert llm.runtime.engine.page_store is None
        assert llm.generate(input_ids=prompts(1)[0][:40],
                            sampling_params={"max_new_tokens": 2})["output_ids"]
    assert "no tier on CPU" in caplog.text


def test_the_disk_folder_comes_from_sglangs_variable(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    with LLM(dtype="float32", max_total_tokens=1024, enable_hierarchical_cache=True,
             hicache_storage_backend="file") as llm:
        store = llm.runtime.engine.page_store
        assert store is not None and store.tiers[0].folder.parent == tmp_path
    assert os.listdir(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_the_host_tier_on_cuda(policy: str, tmp_path: Path):
    """On a GPU the host tier (pinned memory, its default size) and the disk behind it: pages
    evicted from the device pool come back through the engine stream's copies, with the
    logprobs the pool's own prefix cache gave."""
    many = prompts(5)
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with LLM(dtype="bfloat16", device="cuda", max_total_tokens=1024, page_size=PAGE,
             max_running_requests=4, enable_hierarchical_cache=True, hicache_write_policy=policy,
             hicache_storage_backend="file", hicache_storage_dir=str(tmp_path)) as llm:
        assert [t.name for t in llm.runtime.engine.page_store.tiers] == ["host", "disk"]
        pooled = [llm.generate(input_ids=p, sampling_params=params, return_logprob=True)
                  for p in many[:2] for _ in range(2)][1::2]
        for p in many[2:]:
            llm.generate(input_ids=p, sampling_params=params)
        back = [llm.generate(input_ids=p, sampling_params=params, return_logprob=True)
                for p in many[:2]]
        llm.check_integrity()
    for pool, tier in zip(pooled, back):
        assert tier["meta_info"]["cached_tokens_details"]["host"] == SERVED
        assert tier["meta_info"]["output_token_logprobs"] == pool["meta_info"][
            "output_token_logprobs"]
