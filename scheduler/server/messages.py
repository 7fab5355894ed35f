"""OpenAI chat messages -> what `Engine.add_request` takes: chat messages in the model's form plus decoded media.

Images (`image_url` parts: `data:image/...;base64,` URLs; `http(s)` URLs, fetched here under the engine's fetch
policy, `EngineConfig.remote_media` and its bounds; local paths or `file://` URLs only under the directory the
server allows, `--allowed-local-media-path`) and audio
(`input_audio` parts: base64 WAV) are decoded here, before the request is submitted, so an unreadable one is a
400 naming its part and nothing is queued; one the model's processor refuses is refused by the engine
(`UnreadableMedia`), which the server answers the same way (`EnginePrompt.part_of` names the part). Videos
(`video_url` parts: `data:video/...;base64,` URLs, or URLs and files as for images) are decoded by the engine,
whose frame sampling (`video_fps`, `video_max_frames`) they need; one it cannot read is a 400 the same way.
Each media part becomes a `{"type": "image"}` / `{"type": "video"}` / `{"type": "audio"}` marker where it
stood, the form the chat templates expand; a text-only model gets the text parts joined. An assistant message's
`tool_calls` and a `tool` message's `tool_call_id` go to the template too (the calls' JSON arguments as objects;
not for vision-language models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from ..models.fetch import FetchPolicy, is_remote, resolve
from ..models.media import MediaError, load_audio, load_image
from ..models.prompt import ContentPartError, from_openai_messages
from .protocol import APIError, ChatMessage


@dataclass
class EnginePrompt:
    messages: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)  # PIL images, decoded
    videos: list[Any] = field(default_factory=list)  # sources (data: URL, fetched bytes or path), decoded by the engine
    audio: list[Any] = field(default_factory=list)  # (samples, sample_rate), decoded
    # where each medium came from, per kind ("image", "video", "audio"): the body's path of its content part
    parts: dict[str, list[str]] = field(default_factory=lambda: {"image": [], "video": [], "audio": []})

    def part_of(self, kind: str, index: int | None) -> str | None:
        """The content part (`messages.I.content.J`) of the engine's `kind` medium `index`, if known."""
        paths = self.parts.get(kind, [])
        return paths[index] if index is not None and 0 <= index < len(paths) else None


def _media_source(url: str, kind: str, local_dir: Path | None, media_fetch: FetchPolicy | None) -> str | bytes:
    """A part's URL as the media loaders take it: a data: URL as is, an http(s) URL fetched under the engine's
    policy (`media_fetch`; None: refused), a path (or file:// URL) only under `local_dir` (the server's
    --allowed-local-media-path: a client must not make the server read its files)."""
    if url.startswith("data:"):
        return url
    if is_remote(url):
        return resolve(url, media_fetch, kind, None)  # (refused where remote media are off)
    parsed = urlparse(url)
    path = unquote(parsed.path) if parsed.scheme == "file" else url
    if local_dir is None:
        raise MediaError(None, "local files are not read unless the server allows a directory "
                               "(--allowed-local-media-path): send a data: URL", kind)
    resolved = (local_dir / path).resolve()  # relative to it; symlinks and .. resolved before the check
    if not resolved.is_relative_to(local_dir):
        raise MediaError(None, f"{path!r} is outside the allowed media directory", kind)
    return str(resolved)


def fetches_media(messages: list[ChatMessage]) -> bool:
    """Whether converting these messages fetches a medium from an http(s) URL (the server converts such requests
    on a thread pool of their own)."""
    for message in messages:
        for part in message.content if isinstance(message.content, list) else ():
            spec = getattr(part, "image_url", None) or getattr(part, "video_url", None)
            if spec is not None and is_remote(spec.url):
                return True
    return False


def _message_dict(message: ChatMessage, index: int, multimodal: bool) -> dict[str, Any]:
    """One message as the chat template takes it. Tool calls sent back in an assistant message get their JSON
    arguments as objects (what templates render, and what mlx-lm's server hands them); its missing content is
    empty text."""
    role = "system" if message.role == "developer" else message.role
    content = message.content
    out: dict[str, Any] = {"role": role, "content": "" if content is None else
                           content if isinstance(content, str) else [p.model_dump() for p in content]}
    if message.tool_calls or message.tool_call_id is not None:
        if multimodal:
            raise APIError(400, f"messages.{index}: tool calls and tool messages are not supported for "
                                "vision-language models", f"messages.{index}")
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
    calls = []
    for j, call in enumerate(message.tool_calls or ()):
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError as exc:
            where = f"messages.{index}.tool_calls.{j}.function.arguments"
            raise APIError(400, f"{where}: not valid JSON: {exc}", where) from None
        calls.append({"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": arguments}})
    if calls:
        out["tool_calls"] = calls
    return out


def convert_messages(messages: list[ChatMessage], vision: bool, audio_rate: int | None,
                     video: bool = False, local_dir: Path | None = None,
                     media_fetch: FetchPolicy | None = None) -> EnginePrompt:
    """`vision` / `video`: the model takes images / videos; `audio_rate`: its audio sample rate (None: it takes
    no audio); `local_dir`: the directory whose files parts may name (None: none); `media_fetch`: how http(s)
    URLs are fetched (the engine's `Engine.media_fetch`; None: refused). Raises
    APIError(400) naming the part at fault. The content parts are parsed by the engine's own parser
    (`models.prompt.from_openai_messages`); only the decoding happens here, ahead of the engine."""
    as_dicts = [_message_dict(m, i, vision or video or audio_rate is not None) for i, m in enumerate(messages)]
    try:
        parsed, media = from_openai_messages(as_dicts)
    except ContentPartError as exc:
        where = f"messages.{exc.message_index}.content.{exc.part_index}"
        raise APIError(400, f"{where}: {exc.reason}", where) from None
    out = EnginePrompt(messages=parsed)
    sources = {"image": iter(media.images), "video": iter(media.videos), "audio": iter(media.audio)}
    for kind, m, p in media.origins:
        where = f"messages.{m}.content.{p}"
        source = next(sources[kind])
        if kind == "image":
            if not vision:
                raise APIError(400, f"{where}: this model takes no images", where)
            try:
                out.images.append(load_image(_media_source(source, kind, local_dir, media_fetch), len(out.images)))
            except MediaError as exc:
                raise APIError(400, f"{where}: unreadable image: {exc.reason}", where) from None
            out.parts["image"].append(where)
        elif kind == "video":
            if not video:
                raise APIError(400, f"{where}: this model takes no video", where)
            try:
                out.videos.append(_media_source(source, kind, local_dir, media_fetch))
            except MediaError as exc:
                raise APIError(400, f"{where}: unreadable video: {exc.reason}", where) from None
            out.parts["video"].append(where)
        else:
            if audio_rate is None:
                raise APIError(400, f"{where}: this model takes no audio", where)
            try:
                out.audio.append((load_audio(source, len(out.audio), audio_rate), audio_rate))
            except MediaError as exc:
                raise APIError(400, f"{where}: unreadable audio: {exc.reason}", where) from None
            out.parts["audio"].append(where)
    if not vision and not video and audio_rate is None:  # a text model's template takes a string
        out.messages = [{**message, "content": "\n".join(p["text"] for p in message["content"])}
                        if isinstance(message["content"], list) else message for message in out.messages]
    return out

