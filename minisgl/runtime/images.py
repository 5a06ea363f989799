"""A request's images: read (an http(s) URL, a data URL, base64, a file under the allowed
folder), decoded with Pillow, processed by the model's image processor, and laid into the
prompt (its placeholders expanded), all off the event loop. Every failure is an
InvalidRequest naming the image."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import itertools
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from minisgl.args import ServerArgs
from minisgl.core import ImageInput, PromptImages
from minisgl.errors import InvalidRequest

# what a chat message's image part becomes in its text, until the model's own placeholder
# replaces it (RequestManager.encode_chat)
IMAGE_MARKER = "<|minisgl:image|>"
SOURCE_SHOWN = 60  # characters of a failing source an error quotes
# what Pillow may decode (not every plugin it has: some call out to other programs)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


@dataclass(frozen=True)
class ImageLimits:
    max_per_request: int
    max_bytes: int
    max_pixels: int
    fetch_timeout: float
    local_root: Path | None  # image files may be read under it (None: none)


def image_limits(args: ServerArgs) -> ImageLimits:
    root = args.allowed_local_media_path
    return ImageLimits(args.max_images_per_request, args.max_image_bytes, args.max_image_pixels,
                       args.image_fetch_timeout,
                       None if root is None else Path(root).expanduser().resolve())


def _shown(source: str) -> str:
    return source if len(source) <= SOURCE_SHOWN else source[:SOURCE_SHOWN] + "..."


def _fetch(url: str, limits: ImageLimits) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "minisgl"})
    try:
        with urllib.request.urlopen(request, timeout=limits.fetch_timeout) as response:
            data = response.read(limits.max_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise ValueError(f"fetching {_shown(url)} failed: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ValueError(f"fetching {_shown(url)} failed: {reason}") from None
    return data


def _read_file(path: str, limits: ImageLimits) -> bytes:
    if limits.local_root is None:
        raise ValueError("image file paths are not served (start the server with "
                         "--allowed-local-media-path)")
    file = Path(path.removeprefix("file://")).expanduser().resolve()
    if not file.is_relative_to(limits.local_root):
        raise ValueError(f"{_shown(path)} is outside --allowed-local-media-path")
    if not file.is_file():
        raise ValueError(f"no image file {_shown(path)}")
    with file.open("rb") as f:
        return f.read(limits.max_bytes + 1)


def _decode_base64(text: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not an http(s) URL, a data URL, a file path or base64") from None


def read_image_bytes(source: str, limits: ImageLimits) -> bytes:
    """An image source's bytes: SGLang's forms (a URL, a data URL, a file path, base64)."""
    if source.startswith(("http://", "https://")):
        data = _fetch(source, limits)
    elif source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header:
            raise ValueError("a data URL must be base64 (data:image/...;base64,...)")
        data = _decode_base64(payload)
    elif source.startswith(("file://", "/", "./", "../", "~")):
        data = _read_file(source, limits)
    else:
        data = _decode_base64(source)
    if len(data) > limits.max_bytes:
        raise ValueError(f"larger than {limits.max_bytes} bytes (--max-image-bytes)")
    return data


def open_image(source: Any, limits: ImageLimits) -> Any:
    """A decoded PIL image (in memory) from a source, or a PIL image as it is."""
    from PIL import Image
    if isinstance(source, Image.Image):
        image = source
    else:
        if not isinstance(source, str) or not source:
            raise ValueError("an image must be a non-empty string (a URL, a data URL, a file "
                             "path or base64)")
        try:
            image = Image.open(io.BytesIO(read_image_bytes(source, limits)), formats=FORMATS)
        except (Image.UnidentifiedImageError, Image.DecompressionBombError, OSError) as exc:
            raise ValueError(f"not an image Pillow can read ({exc})") from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ValueError(f"{width} x {height} pixels is over {limits.max_pixels} "
                         "(--max-image-pixels)")
    if width < 1 or height < 1:
        raise ValueError(f"an empty image ({width} x {height})")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as exc:  # a truncated or corrupt file
        raise ValueError(f"cannot decode the image ({exc})") from None
    return image


async def prepare_images(sources: list[Any], processor: Any, limits: ImageLimits
                         ) -> list[list[ImageInput]]:
    """Each source read, decoded and processed (into the units the model's encoder takes),
    concurrently and off the event loop."""
    if len(sources) > limits.max_per_request:
        raise InvalidRequest(f"{len(sources)} images in one prompt; at most "
                             f"{limits.max_per_request} (--max-images-per-request)")

    def prepare(index: int, source: Any) -> list[ImageInput]:
        try:
            image = open_image(source, limits)
            return processor.process(image)
        except ValueError as exc:
            raise InvalidRequest(f"image {index}: {exc}") from None

    return list(await asyncio.gather(*(asyncio.to_thread(prepare, i, source)
                                       for i, source in enumerate(sources))))


def lay_out_images(ids: list[int], images: list[list[ImageInput]], processor: Any,
                   context_len: int, encode: Callable[[str], list[int]]
                   ) -> tuple[list[int], PromptImages]:
    """The prompt's ids with its placeholders expanded, and its PromptImages; raises
    InvalidRequest when the placeholders do not match the images or the images overflow the
    context. `encode`: the tokenizer (text to ids, no special tokens added)."""
    count = ids.count(processor.token_id)
    if count != len(images):
        raise InvalidRequest(f"the prompt holds {count} image placeholders "
                             f"({processor.placeholder}) for {len(images)} images")
    out, laid = processor.layout(ids, images, encode)
    end = 0
    for offset, unit in zip(laid.offsets, laid.images):  # NOTE: in order, inside the prompt
        if offset < end or offset + unit.tokens > len(out):
            raise InvalidRequest("the prompt's image tokens do not hold its images (an image "
                                 "placeholder written out by hand, cut short?)")
        end = offset + unit.tokens
    if len(out) >= context_len:
        units = list(itertools.accumulate(len(units) for units in images))
        ends = [offset + unit.tokens for offset, unit in zip(laid.offsets, laid.images)]
        past = next((i for i, end in enumerate(ends) if end >= context_len), len(ends) - 1)
        image = next(i for i, last in enumerate(units) if past < last)
        raise InvalidRequest(f"image {image} brings the prompt past the context of "
                             f"{context_len} tokens ({len(out)} with every image)")
    return out, laid
