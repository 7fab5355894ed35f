"""Tool calls out of a chat choice's text, safe for streaming.

The model's tokenizer says how it writes a call: mlx-lm infers a parser from the chat template (or vocabulary)
and gives the markers that open and close a call (`TokenizerWrapper.tool_call_start` / `tool_call_end`, e.g.
`<tool_call>` ... `</tool_call>` and a JSON parser for Qwen-style templates). Text between the markers is a call,
parsed when it closes (or when the output ends inside one); the rest is the message's content. Whitespace before
a call, and after the last one at the end, is not content (a template puts a newline between a message's text
and its calls, so the content a client sends back renders to what the model wrote). Text that may be the start
of a marker, and whitespace that may precede a call, are held back until the next piece shows which it is, so a
streaming client never gets text that the whole output would not also give, however the text was split into
pieces.

A call whose text the parser cannot read stays in the content as the model wrote it (markers included): the
client sees what came out rather than losing it.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from .markers import partial_suffix


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes tool calls: the markers around one, and the parser of the text between them."""

    start: str
    end: str
    parse: Callable[[str, Any], Any]  # (call text, tools) -> {"name", "arguments"} or a list of them

    @classmethod
    def of(cls, tokenizer: Any) -> "ToolCallFormat | None":
        """The format mlx-lm's tokenizer wrapper declares (or a vision-language model's `ToolCallMarkup`, the
        same attributes), or None (it infers none for this model)."""
        if not getattr(tokenizer, "has_tool_calling", False):
            return None
        return cls(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser)

    @functools.cached_property  # (asked of the parser: a few probes, once per format)
    def shape(self) -> "CallShape | None":
        """The shape of one call after the start marker that the parser reads, so that a grammar can write calls
        it reads back (forced tool calls): asked of the parser itself, with a tool that declares its parameters'
        types (several parsers convert values by them); None when it reads none of the shapes. The model's own
        markups are asked first and JSON last: several parsers read a JSON body as a fallback (mlx-lm's `glm47`,
        `longcat`), and a model writes its own markup best. A parser may add keys of its own (Kimi K2's call id):
        only the name and the arguments are compared."""
        probe = {"name": "f", "arguments": {"x": 1, "s": "a"}}
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}, "s": {"type": "string"}}}}}]
        for shape in sorted(CallShape, key=lambda one: one is CallShape.JSON_OBJECT):
            try:
                parsed = self.parse(shape.example(probe), tools)
            except Exception:  # a parser handed another markup fails as it fails (AttributeError, regex errors...)
                continue
            calls = parsed if isinstance(parsed, list) else [parsed]
            if len(calls) == 1 and isinstance(calls[0], dict) and {k: calls[0].get(k) for k in probe} == probe:
                return shape
        return None

    @functools.cached_property
    def markers(self) -> tuple[str, ...]:
        """What no value of a call may hold: the start and end markers and the closing and `<|...|>` tags of a call
        as its shape writes one (a parser ends a value or a call at the first of these; the splitter ends a call
        at the end marker), each cut where another marker character (`<`, `[`) opens, so that each piece holds its
        first character only at its start (what `constraints` builds its exclusion from)."""
        shape = self.shape
        example = shape.example({"name": "f", "arguments": {"x": 1, "s": "a"}}) if shape is not None else ""
        whole = [self.start, self.end, *re.findall(r"</[^<>]*>|<\|[^<>]*\|>", example)]
        return tuple(sorted({piece for text in whole for piece in re.findall(r"[<\[][^<\[]*", text)
                             if len(piece) > 1}))


class CallShape(Enum):
    """What a format writes for one call after its start marker (and before its end marker, if it has one)."""

    JSON_OBJECT = "json_object"  # `{"name": ..., "arguments": {...}}` on its own line (mlx-lm's `json_tools`)
    NAME_ARGS = "name_args"  # `name[ARGS]{...}` (mlx-lm's `mistral`)
    PYTHONIC = "pythonic"  # `[name(x=1, y="a")]`, several calls in one list (mlx-lm's `pythonic`: LFM2, Llama)
    # `<function=name>` then `<parameter=x>` / value / `</parameter>` lines (mlx-lm's `qwen3_coder`), each value
    # read by its parameter's declared type
    XML_PARAMETERS = "xml_parameters"
    # `call:name{x:1,s:<escape>text<escape>}`: bare keys, strings between a delimiter, scalars as JSON (mlx-lm's
    # `function_gemma`: FunctionGemma; `gemma4`: Gemma 4, whose strings are between `<|"|>`)
    FUNCTION_GEMMA = "function_gemma"
    GEMMA4 = "gemma4"
    # `name<arg_key>x</arg_key><arg_value>1</arg_value>...`: a string parameter's value raw, others JSON (mlx-lm's
    # `glm47`: GLM 4.5-4.7, Laguna)
    ARG_KEY = "arg_key"
    # `<invoke name="f">` / `<parameter name="x">1</parameter>` lines / `</invoke>`, several calls between one pair
    # of markers, each value read by its parameter's declared type (mlx-lm's `minimax_m2`: MiniMax M2)
    INVOKE = "invoke"
    # `<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}<|tool_call_end|>`, several calls
    # between one pair of markers (mlx-lm's `kimi_k2`: Kimi K2)
    KIMI = "kimi"
    # `"name"><param name="x">1</param>` after a `<function name=` start marker, values read as `INVOKE`'s
    # (mlx-lm's `minicpm5`: MiniCPM5)
    PARAM_TAGS = "param_tags"
    # `ARG_KEY` with `longcat_` tags (mlx-lm's `longcat`: LongCat), which reads a call without arguments only as JSON
    LONGCAT = "longcat"
    # `<atem:invoke name="f"><atem:parameter name="x">1</atem:parameter></atem:invoke>`, values JSON, several calls
    # between one pair of markers (mlx-lm's `muse_spark`: Muse Spark)
    ATEM = "atem"
    # `<|open|>call tool="f" index="1"<|sep|>` / `<|open|>argument key="x" type="integer"<|sep|>1<|close|>argument
    # <|sep|>` / `<|close|>call<|sep|>`, a value typed "string" raw, others JSON (mlx-lm's `kimi_k3`: Kimi K3)
    XTML = "xtml"

    @property
    def key_value_tags(self) -> tuple[str, str]:
        """The tags around an argument's key and its value in a `name<key>x</key><value>1</value>` shape."""
        return {CallShape.ARG_KEY: ("arg_key", "arg_value"),
                CallShape.LONGCAT: ("longcat_arg_key", "longcat_arg_value")}[self]

    @property
    def string_delimiter(self) -> str | None:
        """What a `call:name{...}` shape puts around a string value (None: not such a shape)."""
        return {CallShape.FUNCTION_GEMMA: "<escape>", CallShape.GEMMA4: '<|"|>'}.get(self)

    def example(self, call: dict[str, Any]) -> str:
        name, arguments = call["name"], call["arguments"]
        if self is CallShape.JSON_OBJECT:
            return "\n" + json.dumps(call) + "\n"
        if self is CallShape.NAME_ARGS:
            return name + "[ARGS]" + json.dumps(arguments)
        if self is CallShape.PYTHONIC:
            return f"[{name}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in arguments.items()) + ")]"
        if self is CallShape.XML_PARAMETERS:
            return (f"\n<function={name}>\n" + "".join(
                f"<parameter={k}>\n{_raw(v)}\n</parameter>\n"
                for k, v in arguments.items()) + "</function>\n")
        if self in (CallShape.ARG_KEY, CallShape.LONGCAT):
            key, value = self.key_value_tags
            return name + "".join(f"<{key}>{k}</{key}><{value}>{_raw(v)}</{value}>" for k, v in arguments.items())
        if self is CallShape.ATEM:
            return (f'<atem:invoke name="{name}">' + "".join(
                f'<atem:parameter name="{k}">{json.dumps(v)}</atem:parameter>' for k, v in arguments.items())
                + "</atem:invoke>")
        if self is CallShape.XTML:
            return (f'<|open|>call tool="{name}" index="1"<|sep|>' + "".join(
                f'<|open|>argument key="{k}" type="{_json_type(v)}"<|sep|>'
                f"{_raw(v)}<|close|>argument<|sep|>" for k, v in arguments.items()) + "<|close|>call<|sep|>")
        if self is CallShape.INVOKE:
            return (f'\n<invoke name="{name}">\n' + "".join(
                f'<parameter name="{k}">{_raw(v)}</parameter>\n' for k, v in arguments.items()) + "</invoke>\n")
        if self is CallShape.KIMI:
            return (f"<|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>{json.dumps(arguments)}"
                    "<|tool_call_end|>")
        if self is CallShape.PARAM_TAGS:
            return f'"{name}">' + "".join(f'<param name="{k}">{_raw(v)}</param>' for k, v in arguments.items())
        quote = self.string_delimiter
        return f"call:{name}{{" + ",".join(
            f"{k}:{quote + v + quote if isinstance(v, str) else json.dumps(v)}" for k, v in arguments.items()) + "}"


def _json_type(value: Any) -> str:
    """The JSON Schema type name of a value (what Kimi K3's XTML writes beside an argument)."""
    if isinstance(value, bool):
        return "boolean"
    for kind, name in ((str, "string"), (int, "integer"), (float, "number"), (dict, "object"), (list, "array")):
        if isinstance(value, kind):
            return name
    return "null"


def _raw(value: Any) -> str:
    """A value as the XML-like markups write it: a string as itself, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


@dataclass
class ToolCallPiece:
    """What one piece of text added to a choice: content to emit now and the calls it completed."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallSplitter:
    """One choice's text -> its content and its tool calls (OpenAI's `{"id", "type", "function": {"name",
    "arguments"}}`, arguments as a JSON string). `first_call_only` (`parallel_tool_calls: false`): calls after the
    first are dropped, text and all. A format without an end marker (mlx-lm's `mistral`: `[TOOL_CALLS]` then
    `name[ARGS]{...}` or a JSON list) has each call run to the next start marker or to the end of the output, so
    its calls come out when the output ends."""

    def __init__(self, fmt: ToolCallFormat, tools: list[dict] | None, first_call_only: bool = False):
        self.fmt = fmt
        self.tools = tools
        self.first_call_only = first_call_only
        self.calls_made = 0
        self._held = ""  # normal text not emitted yet: trailing whitespace, or a possible start marker
        self._call: str | None = None  # the text of the call being written, once its start marker is seen
        self._after_call = False  # a call was the last thing written: whitespace now may end the output
        self._gap = ""  # the whitespace before the open call

    def feed(self, text: str) -> ToolCallPiece:
        piece = ToolCallPiece()
        pending = self._held + text
        self._held = ""
        while pending:
            if self._call is not None:
                whole = self._call + pending
                if self.fmt.end:
                    end = whole.find(self.fmt.end)
                    rest = end + len(self.fmt.end)
                else:  # a format with no end marker (Mistral's `[TOOL_CALLS]`): a call runs to the next call
                    end = rest = whole.find(self.fmt.start)  # or to the end of the output (`finish`)
                if end < 0:
                    self._call = whole
                    return piece
                pending = whole[rest:]
                self._close(whole[:end], piece)
                continue
            start = pending.find(self.fmt.start)
            if start >= 0:
                before = pending[:start]
                piece.content += before.rstrip()
                self._gap = before[len(before.rstrip()):]  # content again if the call does not parse
                self._call = ""
                pending = pending[start + len(self.fmt.start):]
                continue
            keep = self._undecided_suffix(pending)
            emitted, self._held = pending[: len(pending) - keep], pending[len(pending) - keep:]
            piece.content += emitted
            if emitted.strip():
                self._after_call = False
            return piece
        return piece

    def finish(self) -> ToolCallPiece:
        """The end of the output: held text is content, and a call still open is parsed as it stands (a
        `length` cut leaves it unreadable, so it usually goes back to the content)."""
        # whitespace held after the last call ends the output: not content
        piece = ToolCallPiece(content="" if self._after_call and not self._held.strip() else self._held)
        self._held = ""
        if self._call is not None:
            text, self._call = self._call, None
            parsed = self._parse(text)
            if parsed is None:
                piece.content += self._gap + self.fmt.start + text
            else:
                self._add(parsed, piece)
        return piece

    def _close(self, text: str, piece: ToolCallPiece) -> None:
        self._call = None
        parsed = self._parse(text)
        if parsed is None:
            piece.content += self._gap + self.fmt.start + text + self.fmt.end
            self._after_call = False
            return
        self._add(parsed, piece)
        self._after_call = True

    def _add(self, parsed: list[dict], piece: ToolCallPiece) -> None:
        for call in parsed:
            if self.first_call_only and self.calls_made:
                return
            self.calls_made += 1
            piece.calls.append(_openai_call(call))

    def _parse(self, text: str) -> list[dict] | None:
        try:
            parsed = self.fmt.parse(text, self.tools)
        except Exception:  # mlx-lm's parsers fail as their regexes fall through: ValueError, AttributeError, ...
            return None
        calls = parsed if isinstance(parsed, list) else [parsed]
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            return None
        return calls

    def _undecided_suffix(self, text: str) -> int:
        """Length of the end of `text` not yet known to be content: a proper prefix of the start marker, and any
        whitespace before it (it is not content if a call follows)."""
        marker = partial_suffix(text, (self.fmt.start,))
        body = text[: len(text) - marker]
        return marker + (len(body) - len(body.rstrip()))


def _openai_call(call: dict) -> dict[str, Any]:
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": arguments}}
