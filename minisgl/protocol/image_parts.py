"""Image content parts of chat messages (OpenAI's `image_url`, the Responses API's
`input_image`): each becomes IMAGE_MARKER in the message's text, where the model's own
placeholder goes, and its source joins the prompt's images, in order."""

from __future__ import annotations

from typing import Any

from minisgl.errors import InvalidRequest
from minisgl.runtime.images import IMAGE_MARKER

IMAGE_PART_TYPES = ("image_url", "input_image")
DETAILS = (None, "auto", "high")  # "low" asks for a cheaper, coarser view, which is not served


def image_source(part: dict[str, Any], where: str) -> str:
    """The URL (http(s) or data:) of an image part; raises InvalidRequest naming it."""
    url = part.get("image_url")
    detail = part.get("detail")
    if isinstance(url, dict):  # chat: {"url": ..., "detail": ...}
        url, detail = url.get("url"), url.get("detail", detail)
    if url is None and part.get("file_id") is not None:
        raise InvalidRequest(f"{where}: file_id images are not served (send image_url)")
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}: an image part needs image_url (an http(s) or data: "
                             "URL)")
    if not url.startswith(("http://", "https://", "data:")):
        raise InvalidRequest(f"{where}: image_url must be an http(s) or data: URL")
    if detail not in DETAILS:
        raise InvalidRequest(f"{where}: detail {detail!r} is not served (images are seen at "
                             "the model's own resolution: auto or high)")
    return url


def join_parts(pieces: list[tuple[bool, str]]) -> str:
    """(is an image, text) pieces as one string: text parts joined by newlines, an image's
    marker against its neighbours."""
    out = ""
    for i, (image, text) in enumerate(pieces):
        if i and not image and not pieces[i - 1][0]:
            out += "\n"
        out += IMAGE_MARKER if image else text
    return out
