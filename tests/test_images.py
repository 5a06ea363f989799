"""Images in, text out (Qwen2.5-VL), against transformers' Qwen2_5_VLForConditionalGeneration
in float32 on a tiny random checkpoint built here (a 2-block vision tower, 2 text layers; the
bundled tokenizer with Qwen's three vision tokens added; nothing downloaded).

Offline (`LLM`): greedy output equals the reference on prompts with one and with two images of
different sizes, batched and alone, with prefill chunks that cut through an image, under tensor
parallelism; the prefix cache shares an image's tokens exactly when the image is the same. A
real server: the `openai` client (a data URL, an http URL of a local server), LangChain, the
Responses API and SGLang's `image_data` all give the reference's answer; bad images get a 400
naming the image, and queue nothing."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import requests
import torch

from tests.conftest import start_minisgl_server
from tests.test_model import TINY
from tests.test_server import assert_error, post, requests_total, state

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
PLACEHOLDER = "".join(VISION_TOKENS)
# head_dim 16: eight rotated pairs, in M-RoPE's three sections (temporal, height, width)
ROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1_000_000.0}
VISION = dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
              window_size=56, fullatt_block_indexes=[1])
PIXELS = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 64)  # up to 64 image tokens
NEW_TOKENS = 10
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
SIZES = {"wide": (120, 90), "tall": (60, 200), "square": (84, 84), "other": (120, 90)}


def random_image(name: str) -> Any:
    from PIL import Image
    width, height = SIZES[name]
    rng = np.random.default_rng(sorted(SIZES).index(name))
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(image: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def bundled_tokenizer(path: Path, extra: list[str]) -> Any:
    from transformers import AutoTokenizer

    from minisgl.models import resolve_model_path
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(None)))
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    tokenizer.save_pretrained(str(path))
    return tokenizer


def with_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Norm weights start at one: give them values, so a misread one shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model


class Checkpoint:
    """A tiny checkpoint of one family, its reference, and the expected output of a prompt."""

    placeholder: str  # what an image is in a prompt's text
    image_token: int  # ... and in its ids
    hybrid = False  # a decoder with recurrent states (the prefix cache keeps their snapshots)

    @property
    def embedded_token(self) -> int:
        """The token whose embeddings an image's encoder output replaces."""
        return self.image_token

    def __init__(self, path: Path) -> None:
        self.path = path

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat_ids(self, question: str, images: int = 1) -> list[int]:
        content = self.placeholder * images + question
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                  tokenize=False, add_generation_prompt=True)
        return self.text_ids(text)

    @torch.inference_mode()
    def expected(self, ids: list[int], images: list[Any], new_tokens: int = NEW_TOKENS
                 ) -> list[int]:
        """transformers' greedy tokens, each image placeholder expanded as its processor
        does."""
        prompt, inputs = self.reference_inputs(ids, images) if images else (ids, {})
        out = self.model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0, eos_token_id=None, **inputs)
        return out[0, len(prompt):].tolist()


class QwenVL(Checkpoint):
    """Qwen2.5-VL: a 2-block vision tower (windows, one full-attention block), 2 text layers."""

    placeholder = "".join(VISION_TOKENS)
    CLASSES = ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")
    VISION: dict[str, Any] = VISION
    PIXELS: dict[str, Any] = PIXELS

    def __init__(self, path: Path) -> None:
        import transformers
        super().__init__(path)
        self.tokenizer = bundled_tokenizer(path, VISION_TOKENS)
        start, self.image_token, end = self.tokenizer.convert_tokens_to_ids(VISION_TOKENS)
        torch.manual_seed(0)
        config_class, model_class = (getattr(transformers, name) for name in self.CLASSES)
        config = config_class(text_config=self.text(len(self.tokenizer)),
                              vision_config=self.VISION, image_token_id=self.image_token,
                              vision_start_token_id=start, vision_end_token_id=end)
        self.model = with_norms(model_class(config).float().eval())
        self.model.save_pretrained(str(path))
        self.processor = transformers.Qwen2VLImageProcessorPil(**self.PIXELS)
        self.processor.save_pretrained(str(path))

    def text(self, vocab: int) -> dict[str, Any]:
        return {**TINY, "vocab_size": vocab, "rope_parameters": ROPE, "eos_token_id": 2,
                "bos_token_id": None}

    def reference_inputs(self, ids: list[int], images: list[Any]
                         ) -> tuple[list[int], dict[str, Any]]:
        processed = self.processor(images=images, return_tensors="pt")
        counts = iter((processed["image_grid_thw"].prod(-1) // 4).tolist())
        expanded: list[int] = []
        for token in ids:
            expanded += [token] * next(counts) if token == self.image_token else [token]
        mask = (torch.tensor([expanded]) == self.image_token).int()
        return expanded, {"pixel_values": processed["pixel_values"],
                          "image_grid_thw": processed["image_grid_thw"],
                          "mm_token_type_ids": mask}


class Qwen35(QwenVL):
    """Qwen3.5: a hybrid decoder (Gated DeltaNet and gated attention, 4 layers), a 2-block
    tower of 16-pixel patches with a 4 x 4 position table resampled to each image."""

    hybrid = True
    CLASSES = ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration")
    VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=16, num_position_embeddings=16)
    PIXELS = dict(patch_size=16, min_pixels=32 * 32, max_pixels=32 * 32 * 48)

    def text(self, vocab: int) -> dict[str, Any]:
        return dict(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                    eos_token_id=2, layer_types=["linear_attention", "full_attention"] * 2,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2]})


class Qwen3VL(QwenVL):
    """Qwen3-VL: a 3-block tower of 16-pixel patches whose first two blocks' features go into
    the decoder's two layers (deepstack), sections interleaved."""

    CLASSES = ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration")
    VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=TINY["hidden_size"], patch_size=16,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    PIXELS = Qwen35.PIXELS

    def text(self, vocab: int) -> dict[str, Any]:
        return {**TINY, "vocab_size": vocab, "head_dim": 16, "eos_token_id": 2,
                "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                    "mrope_section": [2, 3, 3]}}


class SmolVLM(Checkpoint):
    """SmolVLM: a 2-layer SigLIP tower on 32-pixel tiles of 4-pixel patches (16 tokens each
    after the 2 x 2 pixel shuffle), images split into tiles (longest side 64) or whole."""

    placeholder = "<image>"
    MARKS = ["<image>", "<fake_token_around_image>", "<global-img>",
             *(f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4))]

    def __init__(self, path: Path, split: bool) -> None:
        import transformers
        super().__init__(path)
        self.tokenizer = bundled_tokenizer(path, self.MARKS)
        self.image_token = self.tokenizer.convert_tokens_to_ids("<image>")
        torch.manual_seed(0)
        config = transformers.SmolVLMConfig(
            text_config={**TINY, "vocab_size": len(self.tokenizer), "model_type": "llama"},
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, image_size=32, patch_size=4),
            image_token_id=self.image_token, scale_factor=2)
        self.model = with_norms(transformers.SmolVLMForConditionalGeneration(config).eval())
        self.model.save_pretrained(str(path))
        self.processor = transformers.SmolVLMImageProcessorPil(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
            do_image_splitting=split)
        self.processor.save_pretrained(str(path))

    def reference_inputs(self, ids: list[int], images: list[Any]
                         ) -> tuple[list[int], dict[str, Any]]:
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string
        outs = [self.processor(images=[[image]], return_tensors="pt", return_row_col_info=True)
                for image in images]
        found = iter(outs)
        expanded: list[int] = []
        for token in ids:
            if token != self.image_token:
                expanded.append(token)
                continue
            out = next(found)
            expanded += self.text_ids(get_image_prompt_string(
                out["rows"][0][0], out["cols"][0][0], 16, "<fake_token_around_image>",
                "<image>", "<global-img>"))
        return expanded, {"pixel_values": torch.cat([o["pixel_values"] for o in outs], 1)}


class Gemma3(Checkpoint):
    """Gemma 3: a 2-layer SigLIP tower on 56-pixel images of 7-pixel patches, pooled 2 x 2 to
    16 tokens an image; 2 text layers, the first windowed to 8 tokens (less than an image), so
    the window reaches forward inside an image."""

    placeholder = "<start_of_image>"

    def __init__(self, path: Path) -> None:
        import transformers
        super().__init__(path)
        self.tokenizer = bundled_tokenizer(path, ["<start_of_image>", "<image_soft_token>",
                                                  "<end_of_image>"])
        boi, self.soft, eoi = self.tokenizer.convert_tokens_to_ids(
            ["<start_of_image>", "<image_soft_token>", "<end_of_image>"])
        self.image_token = boi
        torch.manual_seed(0)
        text = {**TINY, "vocab_size": len(self.tokenizer), "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"], "head_dim": 16,
                "query_pre_attn_scalar": 16}
        config = transformers.Gemma3Config(
            text_config=text, boi_token_index=boi, eoi_token_index=eoi,
            image_token_index=self.soft, mm_tokens_per_image=16,
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, image_size=56, patch_size=7,
                               vision_use_head=False))
        self.model = with_norms(transformers.Gemma3ForConditionalGeneration(config).eval())
        with torch.no_grad():  # the projector starts at zero
            self.model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
        self.model.save_pretrained(str(path))
        self.processor = transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
        self.processor.save_pretrained(str(path))

    @property
    def embedded_token(self) -> int:
        return self.soft

    def reference_inputs(self, ids: list[int], images: list[Any]
                         ) -> tuple[list[int], dict[str, Any]]:
        written = self.text_ids("\n\n<start_of_image>" + "<image_soft_token>" * 16
                                + "<end_of_image>\n\n")
        expanded: list[int] = []
        for token in ids:
            expanded += written if token == self.image_token else [token]
        processed = self.processor(images=images, return_tensors="pt")
        return expanded, {"pixel_values": processed["pixel_values"],
                          "token_type_ids": (torch.tensor([expanded]) == self.soft).long()}


FAMILIES = {"qwen2.5-vl": QwenVL, "qwen3-vl": Qwen3VL, "qwen3.5": Qwen35,
            "smolvlm": lambda path: SmolVLM(path, split=True),
            "smolvlm-whole": lambda path: SmolVLM(path, split=False), "gemma3": Gemma3}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return FAMILIES[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Checkpoint:
    return QwenVL(tmp_path_factory.mktemp("qwen2.5-vl-server"))


def cases(checkpoint: Checkpoint) -> list[tuple[list[int], list[Any]]]:
    """(prompt ids, images): one image, two of different sizes, none, an image first."""
    ids, image = checkpoint.text_ids, checkpoint.placeholder
    return [(ids("Look: " + image + " what is it?"), [random_image("wide")]),
            (ids("A " + image + " and a " + image + " differ how?"),
             [random_image("tall"), random_image("square")]),
            (ids("No image at all, just some words here"), []),
            (ids(image + "first"), [random_image("square")])]


def generate(llm: Any, prompts: list[tuple[list[int], list[Any]]]) -> list[list[int]]:
    outs = llm.generate(input_ids=[ids for ids, _ in prompts],
                        image_data=[images or None for _, images in prompts],
                        sampling_params=GREEDY)
    llm.check_integrity()
    return [out["output_ids"] for out in outs]


@pytest.mark.parametrize("flags", [{}, {"chunked_prefill_size": 8},
                                   {"enable_mixed_chunk": True, "chunked_prefill_size": 16},
                                   {"tp_size": 2}],
                         ids=["whole", "chunks-cut-images", "mixed-chunks", "tp2"])
def test_greedy_matches_transformers_batched_and_alone(checkpoint, flags) -> None:
    from minisgl.llm import LLM
    prompts = cases(checkpoint)
    expected = [checkpoint.expected(ids, images) for ids, images in prompts]
    with LLM(model=str(checkpoint.path), dtype="float32", max_total_tokens=4096,
             **flags) as llm:
        assert generate(llm, prompts) == expected
        if not flags:
            assert [generate(llm, [p])[0] for p in prompts] == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_on_cuda_matches_transformers(checkpoint) -> None:
    """The CUDA path (the encoder on the device, the spliced rows, multimodal RoPE in
    FlashInfer's rotary, decode in CUDA graphs with rope_delta) in float32."""
    from minisgl.llm import LLM
    prompts = cases(checkpoint)
    expected = [checkpoint.expected(ids, images) for ids, images in prompts]
    with LLM(model=str(checkpoint.path), dtype="float32", max_total_tokens=4096,
             device="cuda") as llm:
        assert generate(llm, prompts) == expected


def test_prefix_cache_shares_an_image_only_with_itself(checkpoint) -> None:
    """Page size 1: a prompt again hits the cache through its image; the same text with
    another image of the same size matches only up to the image's first token."""
    from minisgl.llm import LLM
    ids = checkpoint.text_ids("some text before the image " + checkpoint.placeholder
                              + " and after it")
    with LLM(model=str(checkpoint.path), dtype="float32", max_total_tokens=4096,
             page_size=1) as llm:
        def run(name: str) -> tuple[list[int], int]:
            out = llm.generate(input_ids=ids, image_data=random_image(name),
                               sampling_params=GREEDY)
            return out["output_ids"], out["meta_info"]["cached_tokens"]

        first, cached = run("wide")
        assert cached == 0
        again, cached = run("wide")
        assert again == first == checkpoint.expected(ids, [random_image("wide")])
        prompt_len = llm.generate(input_ids=ids, image_data=random_image("wide"),
                                  sampling_params={"max_new_tokens": 1})["meta_info"][
                                      "prompt_tokens"]
        assert cached == prompt_len - 1
        other, cached = run("other")
        shared = first_image_token(checkpoint, ids)  # the text and marks before the image
        # a hybrid resumes only from a state snapshot, none of which is inside that text
        assert cached == (0 if checkpoint.hybrid else shared)
        assert other == checkpoint.expected(ids, [random_image("other")])
        llm.check_integrity()


def first_image_token(checkpoint: Checkpoint, ids: list[int]) -> int:
    """The first prompt position whose token is an image's embedding (the expanded prompt's)."""
    prompt, _ = checkpoint.reference_inputs(ids, [random_image("wide")])
    return prompt.index(checkpoint.embedded_token)


def test_an_image_read_again_is_not_encoded_again(qwen) -> None:
    """Pages of 16: the repeated prompt's cached prefix ends inside the image, whose tail is
    read again from the kept encoder output; a new image is encoded."""
    from minisgl.llm import LLM
    ids = qwen.text_ids("Look: " + PLACEHOLDER + " what is it?")
    with LLM(model=str(qwen.path), dtype="float32", max_total_tokens=1024,
             page_size=16) as llm:
        model = llm.runtime.engine.model
        encoded: list[int] = []
        encode = model.encode_images
        model.encode_images = lambda pixels, grids: (encoded.append(len(pixels)),
                                                     encode(pixels, grids))[1]
        outs = [llm.generate(input_ids=ids, image_data=random_image(name),
                             sampling_params=GREEDY) for name in ("wide", "wide", "other")]
    assert 0 < outs[1]["meta_info"]["cached_tokens"] < outs[1]["meta_info"]["prompt_tokens"] - 1
    assert encoded == [1, 1]  # "wide" once, "other" once
    assert [o["output_ids"] for o in outs] == [qwen.expected(ids, [random_image(name)])
                                               for name in ("wide", "wide", "other")]


def test_gemma3_image_tokens_written_out_by_hand_must_be_whole(tmp_path) -> None:
    """A `<start_of_image>` id followed by image tokens is taken as written out, only if all
    of them and `<end_of_image>` follow; a short run is refused and nothing else is lost."""
    from minisgl.errors import InvalidRequest
    from minisgl.llm import LLM
    gemma = Gemma3(tmp_path)
    boi, soft, eoi = gemma.image_token, gemma.soft, gemma.tokenizer.convert_tokens_to_ids(
        "<end_of_image>")
    written = [5, boi] + [soft] * 16 + [eoi, 6]
    with LLM(model=str(tmp_path), dtype="float32", max_total_tokens=1024) as llm:
        for short in ([5, boi, soft, 6], [5, boi] + [soft] * 16 + [6], [boi, soft]):
            with pytest.raises(InvalidRequest, match="followed by 16 of them"):
                llm.generate(input_ids=short, image_data=random_image("wide"),
                             sampling_params=GREEDY)
        out = llm.generate(input_ids=written, image_data=random_image("wide"),
                           sampling_params=GREEDY)
        llm.check_integrity()
    prompt = torch.tensor([written])
    with torch.inference_mode():
        expected = gemma.model.generate(
            prompt, pixel_values=gemma.processor(images=[random_image("wide")],
                                                 return_tensors="pt")["pixel_values"],
            token_type_ids=(prompt == soft).long(), max_new_tokens=NEW_TOKENS,
            do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(written):].tolist()
    assert out["output_ids"] == expected


def test_an_image_past_the_context_is_refused_naming_it(qwen) -> None:
    """The second image (12 tokens) brings the prompt past a 32-token context."""
    from minisgl.errors import InvalidRequest
    from minisgl.llm import LLM
    ids = qwen.text_ids("a " + PLACEHOLDER + " b " + PLACEHOLDER)
    with LLM(model=str(qwen.path), dtype="float32", max_total_tokens=1024,
             context_length=32) as llm:
        with pytest.raises(InvalidRequest, match="image 1 brings the prompt past the context"):
            llm.generate(input_ids=ids, image_data=[random_image("wide")] * 2,
                         sampling_params=GREEDY)
        out = llm.generate(input_ids=qwen.text_ids("a " + PLACEHOLDER),
                           image_data=random_image("wide"), sampling_params={"max_new_tokens": 2})
        assert len(out["output_ids"]) == 2
        llm.check_integrity()


def test_speculative_decoding_refuses_images_and_serves_text(qwen) -> None:
    from minisgl.errors import InvalidRequest
    from minisgl.llm import LLM
    with LLM(model=str(qwen.path), dtype="float32", max_total_tokens=1024,
             speculative_algorithm="NGRAM") as llm:
        with pytest.raises(InvalidRequest, match="speculative decoding"):
            llm.generate(input_ids=qwen.text_ids("a " + PLACEHOLDER),
                         image_data=random_image("wide"), sampling_params=GREEDY)
        ids = qwen.text_ids("only words here, no image")
        assert llm.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == \
            qwen.expected(ids, [])
        llm.check_integrity()


# ---- real shapes ------------------------------------------------------------------------

@pytest.mark.parametrize("model,ids,tower_depth", [
    # Qwen2.5-VL's eighth block is its first of full attention, the seven before it windowed
    ("qwen2.5-vl-7b", [1, 2, 151652, 151655, 151653, 3], {"depth": 8}),
    ("gemma-3-4b-it", [2, 255999] + [262144] * 256 + [256000, 3], {"num_hidden_layers": 2})])
def test_real_shapes_run_a_step_with_an_image(model, ids, tower_depth, caplog) -> None:
    """Shape-only configs (--load-format dummy) at their real vision shape, fewer vision
    blocks and two decoder layers: a prompt with an image runs, and the start-up line reports
    the tower's memory."""
    import logging

    import minisgl.models
    from minisgl.llm import LLM
    caplog.set_level(logging.INFO, logger="minisgl.models.loader")
    config = Path(minisgl.models.__file__).parent / "configs" / model / "config.json"
    vision = {**json.loads(config.read_text())["vision_config"], **tower_depth}
    overrides = json.dumps({"num_hidden_layers": 2, "vision_config": vision})
    with LLM(model=model, load_format="dummy", dtype="bfloat16", max_total_tokens=1024,
             json_model_override_args=overrides) as llm:
        out = llm.generate(input_ids=ids, image_data=random_image("square"),
                           sampling_params={"max_new_tokens": 2, "ignore_eos": True})
        llm.check_integrity()
    assert len(out["output_ids"]) == 2 and out["meta_info"]["prompt_tokens"] > len(ids) - 1
    assert any("the vision tower" in r.getMessage() for r in caplog.records), caplog.text


# ---- a real server --------------------------------------------------------------------------

class ImageHost:
    """A local http server: /image.png, anything else 404."""

    def __init__(self, body: bytes) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                found = self.path == "/image.png"
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                if found:
                    self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def host() -> Any:
    host = ImageHost(png_bytes(random_image("wide")))
    yield host
    host.server.shutdown()


@pytest.fixture(scope="module")
def server(qwen, tmp_path_factory) -> Any:
    folder = tmp_path_factory.mktemp("media")
    (folder / "wide.png").write_bytes(png_bytes(random_image("wide")))
    server = start_minisgl_server("--model-path", str(qwen.path),
                                  "--max-images-per-request", "2", "--max-image-bytes", "60000",
                                  "--max-image-pixels", "50000", "--image-fetch-timeout", "3",
                                  "--allowed-local-media-path", str(folder))
    server.media = folder
    yield server
    assert server.stop() == 0, server.log()


def chat_answer(qwen: Checkpoint, question: str) -> str:
    expected = qwen.expected(qwen.chat_ids(question), [random_image("wide")])
    return qwen.tokenizer.decode(expected, skip_special_tokens=True)


def test_openai_client_image_parts(qwen, server, host) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    expected = chat_answer(qwen, "What is this?")
    for url in (data_url(random_image("wide")), host.url + "/image.png"):
        answer = client.chat.completions.create(
            model="m", temperature=0, max_tokens=NEW_TOKENS,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
                {"type": "text", "text": "What is this?"}]}])
        assert answer.choices[0].message.content == expected, url[:30]
    response = client.responses.create(
        model="m", temperature=0, max_output_tokens=NEW_TOKENS, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(random_image("wide"))},
            {"type": "input_text", "text": "What is this?"}]}])
    assert response.output_text == expected


def test_langchain_image_message(qwen, server) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="m", temperature=0,
                      max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
    message = HumanMessage(content=[
        {"type": "image_url", "image_url": {"url": data_url(random_image("wide"))}},
        {"type": "text", "text": "Describe it."}])
    assert chat.invoke([message]).content == chat_answer(qwen, "Describe it.")


def test_sglang_image_data_forms(qwen, server, host) -> None:
    """/generate's image_data as base64, a data URL, a URL and a file path; a batch with one
    image list per prompt."""
    text = "Look: " + PLACEHOLDER + " what is it?"
    image = random_image("wide")
    expected = qwen.expected(qwen.text_ids(text), [image])
    forms = [base64.b64encode(png_bytes(image)).decode(), data_url(image),
             host.url + "/image.png", str(server.media / "wide.png")]
    for form in forms:
        r = post(server, "/generate", {"text": text, "image_data": form,
                                       "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == expected, form[:30]
    two = "Two: " + PLACEHOLDER + PLACEHOLDER
    r = post(server, "/generate", {
        "text": [text, two], "sampling_params": GREEDY,
        "image_data": [[data_url(image)], [data_url(random_image("tall")),
                                            data_url(random_image("square"))]]})
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == [
        expected, qwen.expected(qwen.text_ids(two),
                                      [random_image("tall"), random_image("square")])]


def bad_inputs(server: Any, host: Any) -> dict[str, tuple[dict[str, Any], str]]:
    """name -> (a /generate body's fields, a phrase of the error)."""
    good = data_url(random_image("wide"))
    noise = np.random.default_rng(1).integers(0, 256, (150, 150, 3), dtype=np.uint8)
    from PIL import Image
    large = data_url(Image.fromarray(noise))  # ~68 kB of PNG, over --max-image-bytes
    big = data_url(Image.new("RGB", (300, 200)))  # 60000 pixels, over --max-image-pixels
    return {
        "no placeholder": ({"text": "no image here", "image_data": good}, "0 image placeholders"),
        "placeholders without images": ({"text": PLACEHOLDER * 2, "image_data": good},
                                        "2 image placeholders"),
        "not base64": ({"image_data": "not an image!"}, "image 0: not an http(s) URL"),
        "not an image": ({"image_data": base64.b64encode(b"plain text").decode()},
                         "image 0: not an image"),
        "truncated": ({"image_data": "data:image/png;base64," + base64.b64encode(
            png_bytes(random_image("wide"))[:300]).decode()}, "image 0"),
        "missing URL": ({"image_data": host.url + "/missing.png"}, "HTTP 404"),
        "unreachable URL": ({"image_data": "http://127.0.0.1:1/image.png"}, "fetching"),
        "file outside the folder": ({"image_data": "/etc/passwd"}, "--allowed-local-media-path"),
        "too many bytes": ({"image_data": large}, "--max-image-bytes"),
        "too many pixels": ({"image_data": big}, "--max-image-pixels"),
        "too many images": ({"text": PLACEHOLDER * 3, "image_data": [good] * 3},
                            "--max-images-per-request"),
        "not a string": ({"image_data": 7}, "image_data: image 0"),
    }


def test_bad_images_are_refused_naming_them_and_queue_nothing(server, host) -> None:
    before = requests_total(server), state(server)["prompt_tokens"]
    for name, (fields, phrase) in bad_inputs(server, host).items():
        body = {"text": "Look: " + PLACEHOLDER, "sampling_params": GREEDY, **fields}
        error = assert_error(post(server, "/generate", body), 400)
        assert phrase in error["message"], (name, error)
        batch = {"text": ["fine " + PLACEHOLDER, body["text"]], "sampling_params": GREEDY,
                 "image_data": [data_url(random_image("wide")), fields["image_data"]]}
        assert_error(post(server, "/generate", batch), 400)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for part, phrase in (({"url": "ftp://example.com/a.png"}, "http(s) or data: URL"),
                         ({"url": data_url(random_image("wide")), "detail": "low"}, "detail")):
        with pytest.raises(openai.BadRequestError, match=phrase.replace("(", r"\(").replace(
                ")", r"\)")):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": part}]}])
    assert (requests_total(server), state(server)["prompt_tokens"]) == before
    r = post(server, "/generate", {"text": "Look: " + PLACEHOLDER, "sampling_params": GREEDY,
                                   "image_data": data_url(random_image("wide"))})
    assert r.status_code == 200, r.text


def test_a_text_model_refuses_images(minisgl_server) -> None:
    error = assert_error(post(minisgl_server, "/generate", {
        "text": "hi", "image_data": data_url(random_image("wide"))}), 400)
    assert "image_data and image parts are not served" in error["message"]
    r = requests.post(minisgl_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(random_image("wide"))}}]}]})
    assert_error(r, 400, "not served by")
