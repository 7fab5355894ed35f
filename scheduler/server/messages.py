"""OpenAI chat messages -> what `Engine.add_request` takes: chat messages in the model's form plus decoded media.

Images (`image_url` parts: `data:image/...;base64,` URLs, local paths or `file://` URLs) and audio
(`input_audio` parts: base64 WAV) are decoded here, before the request is submitted, so an unreadable one is a
400 naming its part and nothing is queued. Each media part becomes a `{"type": "image"}` / `{"type": "audio"}`
marker where it stood, the form mlx-vlm's chat template expands; a text-only model gets the text parts joined.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse

from ..models.media import MediaError, load_audio, load_image
from .protocol import APIError, AudioPart, ChatMessage, ImagePart, TextPart


@dataclass
class EnginePrompt:
    messages: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)  # PIL images, decoded
    audio: list[Any] = field(default_factory=list)  # (samples, sample_rate), decoded


def _image_source(url: str) -> str:
    if url.startswith("data:"):
        return url
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return unquote(parsed.path)
    if parsed.scheme in ("http", "https"):
        raise MediaError(None, "remote image URLs are not fetched: send a data: URL or a local path")
    return url  # a local path


def _audio_clip(part: AudioPart, index: int, sample_rate: int) -> Any:
    try:
        data = base64.b64decode(part.input_audio.data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(index, f"input_audio.data is not base64: {exc}", "audio") from exc
    return load_audio(data, index, sample_rate), sample_rate


def convert_messages(messages: list[ChatMessage], vision: bool, audio_rate: int | None) -> EnginePrompt:
    """`vision`: the model takes images; `audio_rate`: its audio sample rate (None: it takes no audio).
    Raises APIError(400) naming the part at fault."""
    out = EnginePrompt(messages=[])
    for m, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        if isinstance(message.content, str):
            out.messages.append({"role": role, "content": message.content})
            continue
        parts: list[dict[str, Any]] = []
        for p, part in enumerate(message.content):
            where = f"messages.{m}.content.{p}"
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, ImagePart):
                if not vision:
                    raise APIError(400, f"{where}: this model takes no images", where)
                try:
                    out.images.append(load_image(_image_source(part.image_url.url), len(out.images)))
                except MediaError as exc:
                    raise APIError(400, f"{where}: unreadable image: {exc.reason}", where) from None
                parts.append({"type": "image"})
            elif isinstance(part, AudioPart):
                if audio_rate is None:
                    raise APIError(400, f"{where}: this model takes no audio", where)
                try:
                    out.audio.append(_audio_clip(part, len(out.audio), audio_rate))
                except MediaError as exc:
                    raise APIError(400, f"{where}: unreadable audio: {exc.reason}", where) from None
                parts.append({"type": "audio"})
        if vision or audio_rate is not None:
            out.messages.append({"role": role, "content": parts})
        else:  # a text model's template takes a string
            out.messages.append({"role": role, "content": "\n".join(p["text"] for p in parts)})
    return out
