"""Prompt resolution: one path from what a caller gives (a string, token ids, chat messages, OpenAI content parts,
media) to what the engine queues, a ``ResolvedPrompt`` (validated token ids, the vision-language model's prepared
media, or the error of unreadable media), for text and vision-language models alike.

``PromptResolver.resolve``  the one entry point (``Engine.add_request`` calls it; compat and the server reach it
                    through ``add_request``). Text models: the tokenizer (``encode``, or ``apply_chat_template``
                    for chat messages). Vision-language models: the model adapter's ``prepare``.
``render``          chat messages -> prompt text: mlx-vlm's ``apply_chat_template`` (the family's placeholders
                    and the generation prompt, as ``mlx_vlm.generate`` renders them) or, for messages with videos,
                    the model's own chat template (each ``{"type": "video"}`` part where it is).
``from_openai_messages``  OpenAI chat messages whose content is a list of parts (``text``, ``image_url``,
                    ``input_audio``, ``video_url``) -> our messages (``{"type": "image"}`` etc. placeholders) and
                    the media inputs in order (``data:`` URLs decoded when the media is read; ``http(s)`` URLs
                    fetched then, under the adapter's ``media_fetch`` policy). Used by servers and the compat
                    surface alike.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from scheduler.models import library
from scheduler.request import (InvalidRequest, MediaItemRef, UnreadableMedia, as_token_ids, media_field,
                               validate_prompt_tokens)


@dataclass
class MediaInputs:
    """The media of one request in prompt order, per kind (what ``Engine.add_request`` takes)."""

    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    audio: list[Any] = field(default_factory=list)
    # where each medium came from, in prompt order: (kind, message index, content part index); filled by
    # ``from_openai_messages`` (the server names the part of a medium it cannot read)
    origins: list[tuple[str, int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, images: Any = None, videos: Any = None, audio: Any = None) -> "MediaInputs":
        return cls(list(images or ()), list(videos or ()), list(audio or ()))

    def by_kind(self) -> tuple[tuple[str, list[Any]], ...]:
        """(argument name, items) per kind, in the order requests are checked."""
        return ("images", self.images), ("videos", self.videos), ("audio", self.audio)

    def __bool__(self) -> bool:
        return bool(self.images or self.videos or self.audio)


@dataclass(frozen=True)
class ResolvedPrompt:
    """A request's prompt as the engine queues it: the one value that crosses from prompt resolution into the
    engine (and, through ``Request.media``, to the executor)."""

    token_ids: list[int]  # validated ids; for a vision-language model the processor's (placeholders expanded)
    media: Any = None  # the model adapter's PreparedRequest (vision-language models); None for text models

    @property
    def num_media_items(self) -> int:
        return self.media.num_media_items if self.media is not None else 0

    @property
    def num_media_tokens(self) -> int:
        return self.media.num_media_tokens if self.media is not None else 0

    @property
    def media_key(self) -> str | None:
        return self.media.media_key if self.media is not None else None

    @property
    def media_marks(self) -> tuple[tuple[int, str], ...]:
        return self.media.media_marks if self.media is not None else ()

    @property
    def first_chunk_reach(self) -> int:
        return self.media.first_chunk_reach if self.media is not None else 0

    @property
    def media_items(self) -> tuple[MediaItemRef, ...]:
        if self.media is None:
            return ()
        return tuple(MediaItemRef(item.key, item.tokens, item.count) for item in self.media.media_items)


class PromptResolver:
    """Resolves requests for one loaded model. ``vlm``: the model adapter of a vision-language model (None for
    a text model, whose ``tokenizer`` then does the work). Bad input raises ``InvalidRequest`` naming the
    argument; media that cannot be read or that the processor refuses raises ``UnreadableMedia`` naming the
    item."""

    def __init__(self, tokenizer: Any, vlm: Any, vocab_size: int, max_model_len: int,
                 video_fps: float | None = None, video_max_frames: int | None = None,
                 min_prompt: tuple[int, str] | None = None, one_forward: tuple[int, str] | None = None):
        self.tokenizer, self.vlm = tokenizer, vlm
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.video_fps, self.video_max_frames = video_fps, video_max_frames
        self.min_prompt = min_prompt  # (fewest prompt tokens, why): the family's `Family.min_prompt`
        # (the most tokens one prefill forward holds, the settings that bound it): a prompt whose first chunk must
        # reach further (`ResolvedPrompt.first_chunk_reach`) could never be prefilled
        self.one_forward = one_forward

    def _check(self, prompt: Any, prompt_tokens: Any, media: MediaInputs, request_id: str | None = None) -> Any:
        """The checks that need no tokenizer or processor; ``prompt_tokens`` as a list of ints (or None)."""
        for name, items in media.by_kind():
            if items and self.vlm is None:
                raise InvalidRequest(name, "this engine was loaded with a text-only model")
            if items and prompt is None:
                raise InvalidRequest(name, f"give a prompt (text or chat messages) with {name}: the processor "
                                           "expands the placeholders")
        if (prompt is None) == (prompt_tokens is None):
            raise InvalidRequest("prompt", "give exactly one of prompt and prompt_tokens", request_id)
        return as_token_ids(prompt_tokens) if prompt_tokens is not None else None  # lists, tuples, 1-D arrays

    def resolve(self, prompt: Any, prompt_tokens: Any, media: MediaInputs, request_id: str | None = None,
                tools: Any = None, chat_template_kwargs: Any = None, truncate: int | None = None) -> ResolvedPrompt:
        """``prompt`` (a string, chat messages, or for a vision-language model messages with content parts) or
        ``prompt_tokens``, exactly one, and the media -> the request's ``ResolvedPrompt``. ``tools`` (function
        schemas) and ``chat_template_kwargs`` (e.g. ``enable_thinking``) go to the chat template (chat messages
        only). ``truncate`` (``SamplingParams.truncate_prompt_tokens``): only the last this many prompt tokens are
        kept; a prompt with media that is longer is refused."""
        prompt_tokens = self._check(prompt, prompt_tokens, media, request_id)
        template_kwargs = self._template_kwargs(prompt, tools, chat_template_kwargs, request_id)
        prepared = None
        if self.vlm is None:
            ids = prompt_tokens if prompt_tokens is not None else self._tokenize(prompt, template_kwargs, request_id)
            if truncate is not None:
                ids = list(ids)[-truncate:]
        else:
            prepared = self._prepare(prompt, prompt_tokens, media, request_id, template_kwargs)
            if truncate is not None and len(prepared.input_ids) > truncate:
                if prepared.num_media_items:
                    raise InvalidRequest("truncate_prompt_tokens", f"the prompt has {len(prepared.input_ids)} "
                                         "tokens and media, which truncating would cut into", request_id)
                prepared = self.vlm.text_request(prepared.input_ids[-truncate:])
            ids = prepared.input_ids
        # a spliced image's id is outside the vocabulary: the prompt may hold it where its image's rows go
        spliced = frozenset({self.vlm.splice_marker}) if prepared is not None and prepared.splice_runs else frozenset()
        ids = validate_prompt_tokens(ids, self.vocab_size, self.max_model_len, spliced)
        if self.min_prompt is not None and len(ids) < self.min_prompt[0]:
            raise InvalidRequest("prompt", f"has {len(ids)} token(s); this model takes at least {self.min_prompt[0]}: "
                                           f"{self.min_prompt[1]}", request_id)
        reach = prepared.first_chunk_reach if prepared is not None else 0
        if self.one_forward is not None and reach > self.one_forward[0]:
            raise InvalidRequest("prompt", f"its first {reach} tokens (through its last media token) must be "
                                           "prefilled in one forward, as mlx_vlm.generate prefills them (this "
                                           "checkpoint's image tokens attend to each other both ways), and one "
                                           f"forward holds at most {self.one_forward[0]} ({self.one_forward[1]})",
                                 request_id)
        return ResolvedPrompt(ids, prepared)

    def fetch_remote(self, prompt: Any, media: MediaInputs, request_id: str | None = None) -> tuple[Any, MediaInputs]:
        """The request's media at http(s) URLs fetched now, as ``resolve`` would fetch them (the adapter's
        ``media_fetch`` policy): the prompt and media with each such item replaced by its bytes, and media given
        as content parts moved out of the messages into ``media`` (placeholders left where they stood, as the
        adapter moves them). ``AsyncEngine`` calls it off its one preparing thread, so a slow host holds only its
        own request. Raises ``UnreadableMedia`` naming an item it cannot fetch; what it cannot judge (content
        parts next to media arguments, an unknown part type) it leaves as given, for ``resolve`` to refuse."""
        from scheduler.models import fetch
        from scheduler.models.media import MediaError

        policy = self.vlm.media_fetch if self.vlm is not None else None
        if policy is None:
            return prompt, media
        if isinstance(prompt, list) and not media and has_media_parts(prompt):
            try:
                prompt, media = from_openai_messages(prompt)
            except ContentPartError:
                return prompt, media
        try:
            fetched = fetch.resolve_all(media.images, media.videos, media.audio, policy)
        except MediaError as exc:
            raise UnreadableMedia(exc.kind, exc.index, exc.reason, request_id) from None
        return prompt, MediaInputs(*fetched, origins=media.origins)

    _ENGINE_TEMPLATE_ARGS = ("tools", "tokenize", "conversation", "messages")
    # how the rendered prompt ends (transformers' `apply_chat_template` arguments): the generation prompt (the
    # default), nothing after the last turn, or the last message, an assistant's, left open for the model to go on
    _ENDINGS = ("add_generation_prompt", "continue_final_message")

    def _template_kwargs(self, prompt: Any, tools: Any, kwargs: Any, request_id: str | None) -> dict[str, Any]:
        """The chat template's extra arguments, checked: ``tools`` a list of dicts, ``chat_template_kwargs`` a dict
        that sets none of the arguments the engine sets itself; only with chat messages. Its
        ``add_generation_prompt`` and ``continue_final_message`` (booleans, as transformers takes them) say how
        the prompt ends: ``continue_final_message`` needs an assistant message last, and turns the generation
        prompt off unless it is asked for too (which is refused: they exclude each other)."""
        if tools is None and kwargs is None:
            return {}
        for name, value in (("tools", tools), ("chat_template_kwargs", kwargs)):
            if value is None:
                continue
            if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
                raise InvalidRequest(name, "needs a prompt of chat messages: it goes to the chat template", request_id)
        if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
            raise InvalidRequest("tools", f"must be a list of tool dicts, got {type(tools).__name__}", request_id)
        if kwargs is not None:
            if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
                raise InvalidRequest("chat_template_kwargs", f"must be a dict with string keys, got {kwargs!r}",
                                     request_id)
            taken = sorted(set(kwargs) & set(self._ENGINE_TEMPLATE_ARGS))
            if taken:
                raise InvalidRequest("chat_template_kwargs", f"sets {taken}, which the engine sets itself (tools: "
                                                             "give them as tools)", request_id)
            kwargs = self._ending(prompt, kwargs, request_id)
        return {**(kwargs or {}), **({"tools": list(tools)} if tools else {})}

    def _ending(self, messages: list[dict], kwargs: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        """``kwargs`` with its ending arguments checked, and the generation prompt off where the final message is
        continued."""
        for name in self._ENDINGS:
            if not isinstance(kwargs.get(name, False), bool):
                raise InvalidRequest("chat_template_kwargs", f"{name} must be true or false, got {kwargs[name]!r}",
                                     request_id)
        if not kwargs.get("continue_final_message"):
            return kwargs
        if kwargs.get("add_generation_prompt"):
            raise InvalidRequest("chat_template_kwargs", "add_generation_prompt and continue_final_message exclude "
                                                         "each other: a continued message gets no generation prompt",
                                 request_id)
        if messages[-1].get("role") != "assistant":
            raise InvalidRequest("chat_template_kwargs", "continue_final_message needs the last message to be the "
                                                         f"assistant's, not {messages[-1].get('role')!r}", request_id)
        return {**kwargs, "add_generation_prompt": False}

    def _tokenize(self, prompt: Any, template_kwargs: dict[str, Any], request_id: str | None = None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt", "is empty")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
            try:
                return list(self.tokenizer.apply_chat_template(prompt, **with_generation_prompt(template_kwargs)))
            except (TemplateError, TypeError, ValueError) as exc:  # its own checks (roles, shapes), its filters
                raise InvalidRequest("prompt", f"the chat template refused these messages: {exc}",
                                     request_id) from None
        raise InvalidRequest("prompt", f"must be a string or a list of chat messages, got {type(prompt).__name__}")

    def _prepare(self, prompt: Any, prompt_tokens: list[int] | None, media: MediaInputs,
                 request_id: str | None, template_kwargs: dict[str, Any] | None = None) -> Any:
        """The vision-language model's CPU preprocessing, on the caller's thread: the adapter's prepared inputs."""
        from scheduler.models.media import MediaError, MediaLimit

        if prompt_tokens is not None:
            return self.vlm.text_request(prompt_tokens)
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequest("prompt", "is empty")
        kwargs: dict[str, Any] = {"template_kwargs": template_kwargs} if template_kwargs else {}
        if media.videos:
            kwargs.update(videos=media.videos, fps=self.video_fps, max_frames=self.video_max_frames)
        if media.audio:
            kwargs["audio"] = media.audio
        try:
            return self.vlm.prepare(prompt, media.images, **kwargs)
        except MediaLimit as exc:
            raise InvalidRequest(media_field(exc.kind), str(exc), request_id) from None
        except MediaError as exc:  # it does not decode, is remote, or the processor refuses it
            raise UnreadableMedia(exc.kind, exc.index, exc.reason, request_id) from None
        except (ValueError, TypeError, TemplateError) as exc:  # TemplateError: a chat template's own checks
            raise InvalidRequest("prompt", str(exc), request_id) from None


class ContentPartError(ValueError):
    """An OpenAI content part this layer cannot turn into a media input (``index``: the part's position)."""

    def __init__(self, message_index: int, part_index: int, reason: str):
        self.message_index, self.part_index, self.reason = message_index, part_index, reason
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
    media parts were, the media in order). The one parser of content parts: the engine's prompt resolution and
    the server (``scheduler/server/messages.py``) both use it. Image / video URLs are passed on as given (a ``data:`` URL, a path,
    or an ``http(s)`` URL, which ``scheduler.models.fetch`` fetches or refuses before the media are read); audio
    parts are decoded from base64 to bytes. Unknown part types raise ``ContentPartError``."""
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
                media.origins.append((placeholder, mi, pi))
                parts.append({"type": placeholder})
            elif kind == "input_audio":
                media.audio.append(_audio_of(part, mi, pi))
                media.origins.append(("audio", mi, pi))
                parts.append({"type": "audio"})
            else:
                raise ContentPartError(mi, pi, f"unsupported content part type {kind!r}")
        out.append({**message, "content": parts})
    return out, media


def with_generation_prompt(template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Chat template arguments as the engine renders them: the generation prompt unless they say otherwise
    (`PromptResolver._ending`)."""
    return {"add_generation_prompt": True, **(template_kwargs or {})}


def render(processor: Any, config: Any, messages: list[dict], num_images: int, num_videos: int,
           num_audio: int, template_kwargs: dict[str, Any] | None = None, video_on_tokenizer: bool = False) -> str:
    """``video_on_tokenizer``: messages with videos render with the tokenizer's chat template where it has one
    (``FamilySpec.video_chat_on_tokenizer``)."""
    if not messages:
        raise ValueError("no messages")
    if num_videos:
        render_own = getattr(processor, "apply_chat_template", None)
        if render_own is None or not (getattr(processor, "chat_template", None)
                                      or getattr(getattr(processor, "tokenizer", None), "chat_template", None)):
            raise ValueError("this model has no chat template for video messages; pass a templated prompt string")
        return library.own_chat_template(processor, messages, template_kwargs, on_tokenizer=video_on_tokenizer)
    return library.chat_template(processor, config, messages, num_images=num_images,
                                 num_audios=num_audio, template_kwargs=template_kwargs)
