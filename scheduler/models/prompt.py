"""Prompts of multimodal requests: chat templating, placeholder checks, and OpenAI-style content parts.

``render``          chat messages -> prompt text: mlx-vlm's ``apply_chat_template`` (the family's placeholders
                    and the generation prompt, as ``mlx_vlm.generate`` renders them) or, for messages with videos,
                    the model's own chat template (each ``{"type": "video"}`` part where it is).
``from_openai_messages``  OpenAI chat messages whose content is a list of parts (``text``, ``image_url``,
                    ``input_audio``, ``video_url``) -> our messages (``{"type": "image"}`` etc. placeholders) and
                    the media inputs in order (``data:`` URLs decoded here; ``http(s)`` URLs are refused when the
                    media is read, never fetched). Used by servers and the compat surface alike.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

from scheduler.models import seam


@dataclass
class MediaInputs:
    """The media of one request in prompt order, per kind (what ``Engine.add_request`` takes)."""

    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    audio: list[Any] = field(default_factory=list)


class ContentPartError(ValueError):
    """An OpenAI content part this layer cannot turn into a media input (``index``: the part's position)."""

    def __init__(self, message_index: int, part_index: int, reason: str):
        self.message_index, self.part_index = message_index, part_index
        super().__init__(f"message {message_index}, content part {part_index}: {reason}")


_PLACEHOLDER_PARTS = ("text", "image", "video", "audio")


def has_media_parts(messages: list[dict]) -> bool:
    """Whether any message's content parts go through ``from_openai_messages``: media given in the part (a url
    or data: ``image_url``, ``video_url``, ``input_audio``, an ``image`` part with a source) or a part type
    that is not one of our placeholders (refused there with ``ContentPartError``)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _PLACEHOLDER_PARTS or (kind in ("image", "video") and part.get(kind) is not None):
                    return True
    return False


def _url_of(value: Any) -> Any:
    return value.get("url") if isinstance(value, dict) else value


def _audio_of(part: dict, mi: int, pi: int) -> bytes:
    spec = part.get("input_audio")
    if not isinstance(spec, dict) or "data" not in spec:
        raise ContentPartError(mi, pi, 'input_audio wants {"data": <base64>, "format": "wav"}')
    try:
        return base64.b64decode(spec["data"], validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise ContentPartError(mi, pi, f"input_audio data is not base64: {exc}") from None


# content part types that carry a URL -> the placeholder they become
_URL_PARTS = {"image_url": "image", "image": "image", "video_url": "video", "video": "video"}


def from_openai_messages(messages: list[dict]) -> tuple[list[dict], MediaInputs]:
    """OpenAI chat messages -> (messages with ``{"type": "image" | "video" | "audio"}`` placeholders where the
    media parts were, the media in order). Image / video URLs are passed on as given (a ``data:`` URL, a path,
    or an ``http(s)`` URL, which the media loader refuses with a clear error); audio parts are decoded from
    base64 to bytes. Unknown part types raise ``ContentPartError``."""
    media = MediaInputs()
    out: list[dict] = []
    for mi, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ContentPartError(mi, 0, f"a message must be a dict, got {type(message).__name__}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            out.append(dict(message))
            continue
        parts = []
        for pi, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind in _URL_PARTS:
                placeholder = _URL_PARTS[kind]
                source = _url_of(part.get(f"{placeholder}_url", part.get(placeholder)))
                if source is None:
                    raise ContentPartError(mi, pi, f"{placeholder} part without a url")
                (media.images if placeholder == "image" else media.videos).append(source)
                parts.append({"type": placeholder})
            elif kind == "input_audio":
                media.audio.append(_audio_of(part, mi, pi))
                parts.append({"type": "audio"})
            else:
                raise ContentPartError(mi, pi, f"unsupported content part type {kind!r}")
        out.append({**message, "content": parts})
    return out, media


def render(processor: Any, config: Any, messages: list[dict], num_images: int, num_videos: int,
           num_audio: int) -> str:
    if not messages:
        raise ValueError("no messages")
    if num_videos:
        render_own = getattr(processor, "apply_chat_template", None)
        if render_own is None or not (getattr(processor, "chat_template", None)
                                      or getattr(getattr(processor, "tokenizer", None), "chat_template", None)):
            raise ValueError("this model has no chat template for video messages; pass a templated prompt string")
        return seam.own_chat_template(processor, messages)
    return seam.chat_template(processor, config, messages, num_images=num_images,
                              num_audios=num_audio)
