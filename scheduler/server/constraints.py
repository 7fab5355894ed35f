"""A request's output constraint: OpenAI's `response_format`, vLLM's `structured_outputs` and a forced tool call
(`tool_choice` "required" or a named function), as the engine's `StructuredOutput`.

A forced call is a Lark grammar over the model's own call markup, with each offered tool's parameters as the
arguments' schema (llguidance embeds a JSON schema in Lark with `%json`), one call or several, in the shape its
parser reads (`ToolCallFormat.shape`): a JSON body `{"name": ..., "arguments": ...}` between the markers, on
lines of their own (mlx-lm's `json_tools`, Qwen-style templates); `name[ARGS]{...}` after the start marker
(mlx-lm's `mistral`, `[TOOL_CALLS]`); `[name(x=..., y=...)]` between one pair of markers, each keyword's value
JSON of its parameter's schema (mlx-lm's `pythonic` reads JSON's true / false / null as Python's); or
`<function=name>` then a `<parameter=x>` / value / `</parameter>` block per argument (mlx-lm's `qwen3_coder`),
each value written as that parser converts its parameter's declared type back; or
`call:name{x:1,s:<escape>a<escape>}` (mlx-lm's `function_gemma`: bare keys, scalar values; `gemma4`: `<|"|>`
around strings, and nested objects and arrays); or `name<arg_key>x</arg_key><arg_value>1</arg_value>` (mlx-lm's
`glm47`: a string parameter raw, others JSON), `<invoke name="f">` / `<parameter name="x">` lines (`minimax_m2`),
`<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|>` (`kimi_k2`) or
`"f"><param name="x">1</param>` after `<function name=` (`minicpm5`); `minimax_m2` and `minicpm5` convert a
value back by its parameter's declared type, Kimi's arguments are JSON; or LongCat's `<longcat_arg_key>` (as
GLM's; a call without arguments as JSON), Muse Spark's `<atem:invoke>` (values JSON) and Kimi K3's XTML
`<|open|>call tool="f" ...` (a string parameter raw, others JSON): every format mlx-lm 0.32 infers. A parameter a
markup cannot write back exactly is refused by name. No string or key of a JSON value in a call holds one of the
markup's markers (`ToolCallFormat.markers`), where its parser would end the value or the call (`_markerless`).
With tools offered on "auto" and an output format, the answer is either calls or that format.

A thinking model whose prompt opens the reasoning reasons freely: the constraint starts after its end marker
(`StructuredOutput.after`), and may follow the blank line the model writes there (up to 4 whitespace characters:
unbounded, a model the grammar keeps from its own answer would write whitespace until max_tokens).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..execution.structured import JSON_OPTIONS
from ..request import StructuredKind, StructuredOutput
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .tool_calls import CallShape, ToolCallFormat

_WS = 'WS: /[ \\t\\r\\n]{1,4}/'
_COMMA, _CLOSE = json.dumps(", "), json.dumps(")")


def output_constraint(body: ChatCompletionRequest | CompletionRequest, tool_format: ToolCallFormat | None,
                      tools: list[dict[str, Any]] | None, reasoning_end: str | None) -> StructuredOutput | None:
    """The constraint ``body`` asks for, or None. ``tool_format`` / ``tools``: the model's call markup and the
    tools offered (None: no tool calling); ``reasoning_end``: the end marker when the prompt opens the
    reasoning. Raises APIError (400) naming the field where the model cannot keep to it."""
    forced = isinstance(body, ChatCompletionRequest) and body.forces_tool_call()
    fmt = _output_format(body)
    if forced or (fmt is not None and tools):
        param = ("tool_choice" if forced else "response_format" if body.output_format_given()
                 else "structured_outputs")
        if tool_format is None or tool_format.shape is None:
            raise APIError(400, f"{param}: this model's tool calls are in none of the markups of mlx-lm's tool "
                                "parsers that a grammar writes (scheduler/server/tool_calls.py, CallShape), so calls "
                                "cannot be constrained here", param)
        calls = _calls_rule(body, tool_format, tools or [], param)
        if forced:
            return StructuredOutput.grammar(f"start: WS? calls\n{calls}\n{_WS}", reasoning_end or "")
        if fmt.kind not in (StructuredKind.JSON, StructuredKind.JSON_OBJECT):
            raise APIError(400, "structured_outputs: with tools offered, only a JSON format can stand beside the "
                                "calls", "structured_outputs")
        return StructuredOutput.grammar(f"start: WS? (calls | %json {_schema_text(fmt)})\n{calls}\n{_WS}",
                                        reasoning_end or "")
    if fmt is None:
        return None
    if reasoning_end and fmt.kind in (StructuredKind.JSON, StructuredKind.JSON_OBJECT):
        return StructuredOutput.grammar(f"start: WS? %json {_schema_text(fmt)}\n{_WS}", reasoning_end)
    return StructuredOutput(fmt.kind, fmt.spec, reasoning_end or "")


def _output_format(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    """response_format or structured_outputs as a constraint (the protocol lets at most one through)."""
    if body.output_format_given():
        rf = body.response_format
        if rf.type == "json_object":
            return StructuredOutput.json_object()
        return StructuredOutput.json(rf.json_schema.schema_)
    so = body.structured_outputs
    if so is None:
        return None
    if so.json_ is not None:
        return StructuredOutput.json(so.json_)
    if so.regex is not None:
        return StructuredOutput.regex(so.regex)
    if so.choice is not None:
        return StructuredOutput.choice(so.choice)
    if so.grammar is not None:
        return StructuredOutput.grammar(so.grammar)
    return StructuredOutput.json_object()


def _schema_text(fmt: StructuredOutput) -> str:
    """A JSON format's schema for Lark's `%json`, with the engine's whitespace rules unless it sets its own."""
    schema = json.loads(fmt.spec) if fmt.kind is StructuredKind.JSON else {"type": "object"}
    return json.dumps({"x-guidance": JSON_OPTIONS, **schema})


def _calls_rule(body: Any, fmt: ToolCallFormat, tools: list[dict[str, Any]], param: str) -> str:
    """The `calls` rule: one call of the named tool, one call of any (parallel_tool_calls false), or several, in
    the model's markup (`ToolCallFormat.shape`, written by its `_CALL_WRITERS` entry). ``param``: the request
    field an unwritable tool is refused in."""
    choice = getattr(body, "tool_choice", None)
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
    single = isinstance(choice, NamedToolChoice) or getattr(body, "parallel_tool_calls", None) is False
    calls = _CALL_WRITERS[fmt.shape](fmt, tools, param)
    more = "" if single else f" ({calls.between} call)*"
    rules = f"calls: {calls.before}call{more}{calls.after}\ncall: {calls.call}"
    used = {name: lark for name, lark in _TERMINALS.items() if re.search(rf"\b{name}\b", rules)}
    return "\n".join([_markers_kept_out(rules, fmt.markers), *(f"{name}: {lark}" for name, lark in used.items())])


@dataclass(frozen=True)
class _Calls:
    """One markup's calls in Lark: the alternatives of one call, what goes between two calls, and what goes
    around them all (the pythonic list, inside one pair of markers)."""

    call: str
    between: str = ""
    before: str = ""
    after: str = ""


def _marker(text: str) -> str:
    return f" {json.dumps(text)}" if text else ""


def _json_calls(fmt: ToolCallFormat, tools: list[dict[str, Any]], param: str) -> _Calls:
    """`<tool_call>` / `{"name": ..., "arguments": ...}` / `</tool_call>` lines, the arguments JSON of the schema."""
    bodies = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
               "properties": {"name": {"const": t["function"]["name"]},
                              "arguments": t["function"].get("parameters") or {"type": "object"}}} for t in tools]
    schema = json.dumps({"x-guidance": JSON_OPTIONS, "anyOf": bodies})
    return _Calls(f"{json.dumps(fmt.start + chr(10))} %json {schema} {json.dumps(chr(10) + fmt.end)}", "NL")


def _name_args_calls(fmt: ToolCallFormat, tools: list[dict[str, Any]], param: str) -> _Calls:
    """`[TOOL_CALLS]name[ARGS]{...}`, one after another."""
    names = " | ".join(f"{json.dumps(t['function']['name'] + '[ARGS]')} %json {_arguments_schema(t)}" for t in tools)
    return _Calls(f"{json.dumps(fmt.start)} ({names}){_marker(fmt.end)}")


def _pythonic_calls(fmt: ToolCallFormat, tools: list[dict[str, Any]], param: str) -> _Calls:
    """`[a(x=1), b(y="z")]` between one pair of markers."""
    calls = _one_of(tools, param, r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", "[name(x=...)]", lambda name, t: (
        f"{json.dumps(name + '(')} {_arguments(t, param, _PYTHONIC_ARGUMENTS)} {_CLOSE}"))
    return _Calls(calls, _COMMA, f"{json.dumps(fmt.start + '[')} ", f" {json.dumps(']')}{_marker(fmt.end)}")


def _xml_calls(fmt: ToolCallFormat, tools: list[dict[str, Any]], param: str) -> _Calls:
    """One `<tool_call>` / `<function=name>` block per call."""
    calls = _one_of(tools, param, r"[^\s<>]+", "<function=name>", lambda name, t: (
        f"{json.dumps(fmt.start + chr(10) + '<function=' + name + '>' + chr(10))} "
        f"{_arguments(t, param, _XML_ARGUMENTS)} {json.dumps('</function>' + chr(10) + fmt.end)}"))
    return _Calls(calls, "NL")


def _braced_calls(fmt: ToolCallFormat, tools: list[dict[str, Any]], param: str) -> _Calls:
    """`call:name{x:1,s:<escape>a<escape>}`, one per pair of markers."""
    gemma4 = fmt.shape is CallShape.GEMMA4
    how = _braced_arguments(fmt.shape.string_delimiter, nested=gemma4)
    calls = _one_of(tools, param, r"[\w-]+" if gemma4 else r"\w+", "call:name{...}", lambda name, t: (
        f"{json.dumps(f'call:{name}' + '{')} {_arguments(t, param, how)} {json.dumps('}')}"))
    return _Calls(f"{json.dumps(fmt.start)} ({calls}){_marker(fmt.end)}")


def _arg_key_calls(fmt: ToolCallFormat, tools: list[dict[str, Any]], param: str) -> _Calls:
    """`<tool_call>name<arg_key>x</arg_key><arg_value>1</arg_value>...</tool_call>`, one per pair of markers. GLM's
    templates differ in the newlines between the parts (4.5 writes them, 4.7 does not) and the parser skips
    whitespace there, so a newline may stand before each key, value and the end marker: the model writes its own.
    LongCat's tags are `longcat_arg_key` / `longcat_arg_value`, and its parser reads a call without arguments only
    as JSON, so that call is `{"name": ..., "arguments": {}}` and the others have at least one argument."""
    key, value = fmt.shape.key_value_tags
    how = _key_value_arguments(key, value)
    longcat = fmt.shape is CallShape.LONGCAT
    calls = []
    for tool in tools:
        name = _tool_name(tool, r"[^\s<>]+", f"name<{key}>...", param)
        arguments = _arguments(tool, param, how, least_one=longcat)
        if arguments or not longcat:
            calls.append(f"{json.dumps(fmt.start + name)} {arguments} NL? {json.dumps(fmt.end)}")
        if longcat and _may_have_no_arguments(tool):
            calls.append(json.dumps(fmt.start + json.dumps({"name": name, "arguments": {}}) + fmt.end))
    return _Calls(" | ".join(calls), "NL")


def _may_have_no_arguments(tool: dict[str, Any]) -> bool:
    listed, free = _parameters(tool)
    return free or not any(required for _, _, required in listed)


def _invoke_calls(fmt: ToolCallFormat, tools: list[dict[str, Any]], param: str) -> _Calls:
    """`<invoke name="f">` / `<parameter name="x">1</parameter>` lines / `</invoke>`, the calls on lines of their
    own between one pair of markers (MiniMax M2's template)."""
    calls = _one_of(tools, param, r'[^\s<>"]+', '<invoke name="...">', lambda name, t: (
        f"{json.dumps(f'<invoke name={chr(34)}{name}{chr(34)}>' + chr(10))} "
        f"{_arguments(t, param, _INVOKE_ARGUMENTS)} {json.dumps('</invoke>')}"))
    return _Calls(calls, "NL", f"{json.dumps(fmt.start + chr(10))} ", f" {json.dumps(chr(10) + fmt.end)}")


def _kimi_calls(fmt: ToolCallFormat, tools: list[dict[str, Any]], param: str) -> _Calls:
    """`<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}<|tool_call_end|>`, one after another
    between one pair of markers (Kimi K2's template; the number is the call's index, which the parser keeps in
    the call's id), the arguments JSON of the tool's schema."""
    calls = _one_of(tools, param, r"[\w.-]+", "functions.name:0", lambda name, t: (
        f"{json.dumps('<|tool_call_begin|>functions.' + name + ':')} /[0-9]{{1,3}}/ "
        f"{json.dumps('<|tool_call_argument_begin|>')} %json {_listed_arguments_schema(t)} "
        f"{json.dumps('<|tool_call_end|>')}"))
    return _Calls(calls, "", f"{json.dumps(fmt.start)} ", f" {json.dumps(fmt.end)}")


def _param_tag_calls(fmt: ToolCallFormat, tools: list[dict[str, Any]], param: str) -> _Calls:
    """`<function name="f"><param name="x">1</param></function>`, one block per call (MiniCPM5's template: the
    start marker is `<function name=`)."""
    calls = _one_of(tools, param, r'[^\s<>"]+', '<function name="...">', lambda name, t: (
        f"{json.dumps(fmt.start + chr(34) + name + chr(34) + '>')} "
        f"{_arguments(t, param, _PARAM_TAG_ARGUMENTS)} {json.dumps(fmt.end)}"))
    return _Calls(calls, "NL?")


def _atem_calls(fmt: ToolCallFormat, tools: list[dict[str, Any]], param: str) -> _Calls:
    """`<atem:invoke name="f"><atem:parameter name="x">1</atem:parameter></atem:invoke>`, the calls between one
    pair of markers (Muse Spark's), each value JSON (its parser reads JSON first, else the stripped text: a string
    written raw would come back a number where it reads as one); a newline may stand between the parts."""
    calls = _one_of(tools, param, r'[^\s<>"]+', '<atem:invoke name="...">', lambda name, t: (
        f"{json.dumps(f'<atem:invoke name={chr(34)}{name}{chr(34)}>')} "
        f"{_arguments(t, param, _ATEM_ARGUMENTS)} NL? {json.dumps('</atem:invoke>')}"))
    return _Calls(calls, "NL?", f"{json.dumps(fmt.start)} NL? ", f" NL? {json.dumps(fmt.end)}")


def _xtml_calls(fmt: ToolCallFormat, tools: list[dict[str, Any]], param: str) -> _Calls:
    """`<|open|>call tool="f" index="1"<|sep|>` / arguments / `<|close|>call<|sep|>`, the calls between one pair of
    markers (Kimi K3's XTML), each argument `<|open|>argument key="x" type="T"<|sep|>value<|close|>argument<|sep|>`;
    up to 8 whitespace characters may stand between the parts (its parser's own example indents them)."""
    calls = _one_of(tools, param, r'[^\s<>"&]+', '<|open|>call tool="..."', lambda name, t: (
        f"{json.dumps(f'<|open|>call tool={chr(34)}{name}{chr(34)} index={chr(34)}')} /[0-9]{{1,3}}/ "
        f"{json.dumps(chr(34) + '<|sep|>')} {_arguments(t, param, _XTML_ARGUMENTS)} GAP? "
        f"{json.dumps('<|close|>call<|sep|>')}"))
    return _Calls(calls, "GAP?", f"{json.dumps(fmt.start)} GAP? ", f" GAP? {json.dumps(fmt.end)}")


_CALL_WRITERS = {CallShape.JSON_OBJECT: _json_calls, CallShape.NAME_ARGS: _name_args_calls,
                 CallShape.PYTHONIC: _pythonic_calls, CallShape.XML_PARAMETERS: _xml_calls,
                 CallShape.FUNCTION_GEMMA: _braced_calls, CallShape.GEMMA4: _braced_calls,
                 CallShape.ARG_KEY: _arg_key_calls, CallShape.LONGCAT: _arg_key_calls, CallShape.INVOKE: _invoke_calls,
                 CallShape.KIMI: _kimi_calls, CallShape.PARAM_TAGS: _param_tag_calls, CallShape.ATEM: _atem_calls,
                 CallShape.XTML: _xtml_calls}


def _parameters(tool: dict[str, Any]) -> tuple[list[tuple[str, dict, bool]], bool]:
    """A tool's parameters: `_properties` of its `parameters` schema."""
    return _properties(tool["function"].get("parameters") or {"type": "object"})


def _properties(schema: dict[str, Any]) -> tuple[list[tuple[str, dict, bool]], bool]:
    """An object schema's properties as (name, schema, required) in the schema's order (required ones it does not
    list last, any value), and whether it lists none at all (no `properties`: any names). An object with empty
    `properties` has none."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    listed = [(name, sub if isinstance(sub, dict) else {}, name in required) for name, sub in properties.items()]
    listed += [(name, {}, True) for name in schema.get("required") or () if name not in properties]
    return listed, not listed and "properties" not in schema


def _sequence(items: list[tuple[str, bool]], separator: str, least_one: bool = False) -> str:
    """Lark for the present items in order, each required one always and each optional one or not, joined by
    ``separator`` (a Lark literal or ""): the first present item decides where the separators start. With
    ``least_one``, at least one item even where none is required."""
    def tail(rest):
        return " ".join(f"({separator} {item})" + ("" if required else "?") for item, required in rest)

    starts = []
    for i, (item, required) in enumerate(items):
        starts.append(f"{item} {tail(items[i + 1:])}".strip())
        if required:
            break
    return f"({' | '.join(starts)})" + ("" if least_one or any(required for _, required in items) else "?")


def _refuse(param: str, tool: dict[str, Any], name: str, why: str) -> APIError:
    return APIError(400, f"{param}: parameter {name!r} of tool {tool['function']['name']!r} {why}", param)


@dataclass(frozen=True)
class _Arguments:
    """How a markup writes a call's arguments (`_arguments`): the names it can write, one argument's Lark from
    its name's and value's, a value's Lark from its parameter's schema (None: the parser cannot read it back
    exactly), and what goes between two arguments."""

    names: str  # a regex every parameter name must match
    name_rule: str  # the Lark regex of a name, where the schema lists none
    cannot_name: str  # why a name outside `names` is refused
    item: Callable[[str, str], str]  # (name's Lark, value's Lark) -> one argument's Lark
    value: Callable[[dict[str, Any]], str | None]
    cannot_write: str  # why a schema `value` gives None for is refused
    separator: str = ""


def _arguments(tool: dict[str, Any], param: str, how: _Arguments, least_one: bool = False) -> str:
    """A call's arguments in a markup: the listed parameters in order (optional ones may be left out), or any
    names where the schema lists none; with ``least_one``, at least one argument ("" where the tool has no
    parameter at all)."""
    listed, free = _parameters(tool)
    if free:
        pair = how.item(how.name_rule, how.value({}))
        return f"({pair} ({how.separator} {pair})*)" + ("" if least_one else "?")
    items = []
    for name, schema, required in listed:
        if not re.fullmatch(how.names, name):
            raise _refuse(param, tool, name, how.cannot_name)
        value = how.value(schema)
        if value is None:
            raise _refuse(param, tool, name, how.cannot_write)
        items.append((how.item(json.dumps(name), value), required))
    return _sequence(items, how.separator, least_one) if items else ""


_PYTHONIC_ARGUMENTS = _Arguments(  # `x=1, y="a"`: the parser reads JSON's true / false / null as Python's
    names=r"[A-Za-z_][A-Za-z0-9_]*", name_rule="/[A-Za-z_][A-Za-z0-9_]*/",
    cannot_name="is not an ASCII Python identifier, which [name(x=...)] calls cannot write",
    item=lambda name, value: f'{name} "=" {value}', value=lambda schema: f"%json {_json_schema(schema)}",
    cannot_write="", separator=_COMMA)


def _xml_value(schema: dict[str, Any]) -> str | None:
    """The Lark of one parameter's value and its closing `\\n</parameter>\\n` as mlx-lm's `qwen3_coder` parser reads
    it (see `_xml_bare_value`). A string's text and its closing are one terminal (`XML_TEXT`): a text may hold a
    newline, and llguidance's lexer, inside a terminal at a newline, does not step back out of it when the newline
    turns out to begin the closing (a text then a separate closing literal could never end)."""
    value = _xml_bare_value(schema)
    return value if value is None or value == "XML_TEXT" else f'{value} "\\n</parameter>\\n"'


def _xml_bare_value(schema: dict[str, Any]) -> str | None:
    """A value as the `qwen3_coder` parser reads it: a string is the raw text (never "null" in any case, which it
    reads as None), a boolean `true` / `false`, other types JSON; None for a schema it cannot read back
    exactly."""
    kind = schema.get("type")
    if kind is not None and not isinstance(kind, str):
        return None
    if "enum" in schema:
        values = schema["enum"]
        if kind in (None, "string") and all(isinstance(v, str) and v.lower() != "null" for v in values) and values:
            return "(" + " | ".join(json.dumps(v) for v in values) + ")"
        if kind in ("integer", "number", "boolean") and values:
            return "(" + " | ".join(json.dumps(json.dumps(v)) for v in values) + ")"
        return None
    return _by_declared_type(kind, schema, "XML_TEXT")


# The terminals a calls rule may name (Lark's `&` and `~` are for terminals only), each defined where it is used:
_TERMINALS = {
    "NL": '"\\n"',
    # a `<parameter=x>` string value and its closing line: free text without "<" (the parser ends a value at the
    # first `</parameter>`, and a newline before the closing one is the markup's), and not "null" in any case,
    # which the parser reads as None; pattern, format and length keywords are not enforced
    "XML_TEXT": r"/([^<\n]|\n[^<])*\n<\/parameter>\n/ & ~/(?i:null)\n<\/parameter>\n/",
    # a string value between tags that the parser strips: no "<", no whitespace at either end
    "TAG_TEXT": r"/([^<\s]([^<]*[^<\s])?)?/",
    # the same where the parser reads "null" in any case as None (`minimax_m2`, `minicpm5`)
    "TYPED_TEXT": r"/([^<\s]([^<]*[^<\s])?)?/ & ~/(?i:null)/",
    # whitespace between the parts of a Kimi K3 call
    "GAP": r"/[ \t\r\n]{1,8}/",
    # a Kimi K3 string argument: raw, not stripped, without "<" (its closing begins with one)
    "XTML_TEXT": r"/[^<]*/",
}

_XML_ARGUMENTS = _Arguments(  # `<parameter=x>` / value / `</parameter>` lines
    names=r"[^\s<>]+", name_rule=r"/[^\s<>]+/",
    cannot_name="has whitespace or < > in its name (or none), which <parameter=x> cannot write",
    item=lambda name, value: f'"<parameter=" {name} ">\\n" {value}', value=_xml_value,
    cannot_write="has a schema the <parameter=x> markup cannot write back exactly (its type must be one of string, "
                 "integer, number, boolean, object, array, null, or absent; an enum's values strings or of that "
                 "type)")


def _arg_key_value(schema: dict[str, Any]) -> str | None:
    """One value in `<arg_value>...</arg_value>` as mlx-lm's `glm47` reads it: a parameter typed "string" raw
    (stripped), any other JSON (the parser tries JSON first); None for a string enum it cannot read back."""
    if schema.get("type") != "string":
        return f"%json {_json_schema(schema)}"
    if "enum" in schema:
        return _raw_enum(schema["enum"], str, lambda v: not re.search(r"<|^\s|\s$", v))
    return "TAG_TEXT"


def _typed_value(schema: dict[str, Any]) -> str | None:
    """One value between tags as mlx-lm's `minimax_m2` and `minicpm5` read it, by its parameter's declared type:
    a string raw (stripped; "null" in any case is None), an integer, number, object or array JSON, a boolean
    `true` / `false`; no type at all reads as a string. None for what it cannot read back exactly: a list of
    types, `anyOf` and its kin (the parser merges their types), an enum of mixed types."""
    if any(key in schema for key in ("anyOf", "oneOf", "allOf")):
        return None
    kind = schema.get("type")
    if kind is not None and not isinstance(kind, str):
        return None
    if "enum" in schema:
        values = schema["enum"]
        if all(isinstance(v, str) for v in values) and kind in (None, "string"):
            return _raw_enum(values, str, lambda v: not re.search(r"<|^\s|\s$", v) and v.lower() != "null")
        if all(isinstance(v, bool) for v in values) and kind in (None, "boolean"):
            return _raw_enum(values, bool)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values) and kind in (None, "integer"):
            return _raw_enum(values, int)
        return None
    return _by_declared_type(kind, schema, "TYPED_TEXT")


def _by_declared_type(kind: str | None, schema: dict[str, Any], text: str) -> str | None:
    """A value as the tag parsers convert it by its parameter's declared type ``kind``: ``text`` (a terminal) for
    a string or no type, `true` / `false`, `null`, JSON for the other JSON types; None for any other type."""
    if kind in (None, "string"):
        return text
    if kind == "boolean":
        return '("true" | "false")'
    if kind == "null":
        return '"null"'
    if kind in ("integer", "number", "object", "array"):
        return f"%json {_json_schema(schema)}"
    return None


def _raw_enum(values: list, kind: type, writable: Callable[[Any], bool] = lambda v: True) -> str | None:
    """An enum's values as the tag markups write them (strings raw, others JSON), or None where one of them is not
    of ``kind`` or cannot be written."""
    if not values or not all(isinstance(v, kind) and writable(v) for v in values):
        return None
    return "(" + " | ".join(json.dumps(v if isinstance(v, str) else json.dumps(v)) for v in values) + ")"


_TAGGED = ("string, integer, number, boolean, object, array, null, or absent; an enum's values strings, "
           "integers or booleans")


def _key_value_arguments(key: str, value: str) -> _Arguments:
    """`<key>x</key><value>1</value>` (GLM's `arg_key` / `arg_value`, LongCat's), a newline allowed before each."""
    return _Arguments(
        names=r"[^\s<>]+", name_rule=r"/[^\s<>]+/",
        cannot_name=f"has whitespace or < > in its name (or none), which <{key}>x</{key}> cannot write",
        item=lambda name, lark: f'NL? "<{key}>" {name} "</{key}>" NL? "<{value}>" {lark} "</{value}>"',
        value=_arg_key_value,
        cannot_write=f"has a string enum <{value}> cannot write back exactly (a value with < or whitespace at an end)")


def _xtml_value(schema: dict[str, Any]) -> str | None:
    """An argument's type attribute, its end and its value as mlx-lm's `kimi_k3` reads them: `string"<|sep|>` then
    the raw text (without "<") for a parameter typed "string", else the schema's type (`json` where it has none
    or several) then JSON."""
    kind = schema.get("type")
    if kind == "string":
        text = _raw_enum(schema["enum"], str, lambda v: "<" not in v) if "enum" in schema else "XTML_TEXT"
        return None if text is None else f'{json.dumps("string" + chr(34) + "<|sep|>")} {text}'
    attribute = kind if isinstance(kind, str) else "json"
    return f'{json.dumps(attribute + chr(34) + "<|sep|>")} %json {_json_schema(schema)}'


_ATEM_ARGUMENTS = _Arguments(  # `<atem:parameter name="x">1</atem:parameter>`, a newline allowed before each
    names=r'[^\s<>"]+', name_rule=r'/[^\s<>"]+/',
    cannot_name='has whitespace, < > or " in its name (or none), which <atem:parameter name="x"> cannot write',
    item=lambda name, value: f"NL? {json.dumps('<atem:parameter name=' + chr(34))} {name} "
                             f"{json.dumps(chr(34) + '>')} {value} {json.dumps('</atem:parameter>')}",
    value=lambda schema: f"%json {_json_schema(schema)}", cannot_write="")

_XTML_ARGUMENTS = _Arguments(  # `<|open|>argument key="x" type="integer"<|sep|>1<|close|>argument<|sep|>`
    names=r'[^\s<>"&]+', name_rule=r'/[^\s<>"&]+/',
    cannot_name='has whitespace, < > " or & in its name (or none), which <|open|>argument key="x" cannot write',
    item=lambda name, value: f"GAP? {json.dumps('<|open|>argument key=' + chr(34))} {name} "
                             f"{json.dumps(chr(34) + ' type=' + chr(34))} {value} "
                             f"{json.dumps('<|close|>argument<|sep|>')}",
    value=_xtml_value, cannot_write="has a string enum with < in a value, which Kimi K3's argument cannot write")

def _named_tag_arguments(tag: str, after: str) -> _Arguments:
    """`<tag name="x">1</tag>` then ``after`` (MiniMax M2's `parameter` lines, MiniCPM5's `param`), each value by its
    parameter's declared type (`_typed_value`)."""
    return _Arguments(
        names=r'[^\s<>"]+', name_rule=r'/[^\s<>"]+/',
        cannot_name=f'has whitespace, < > or " in its name (or none), which <{tag} name="x"> cannot write',
        item=lambda name, value: f"{json.dumps(f'<{tag} name=' + chr(34))} {name} {json.dumps(chr(34) + '>')} "
                                 f"{value} {json.dumps(f'</{tag}>' + after)}",
        value=_typed_value,
        cannot_write=f'has a schema <{tag} name="x"> cannot write back exactly (its type must be one of {_TAGGED})')


_INVOKE_ARGUMENTS = _named_tag_arguments("parameter", "\n")
_PARAM_TAG_ARGUMENTS = _named_tag_arguments("param", "")


def _one_of(tools: list[dict[str, Any]], param: str, allowed: str, markup: str,
            write: Callable[[str, dict[str, Any]], str]) -> str:
    """One call's alternatives, one per tool, each ``write(name, tool)``: the tool's name is checked against
    ``allowed``, the names the markup's parser reads back (``markup`` names it in a refusal)."""
    return " | ".join(write(_tool_name(t, allowed, markup, param), t) for t in tools)


def _tool_name(tool: dict[str, Any], allowed: str, markup: str, param: str) -> str:
    """The tool's name where the markup's parser reads back names matching ``allowed``, else refused."""
    name = tool["function"]["name"]
    if not re.fullmatch(allowed, name):
        raise APIError(400, f"{param}: tool {name!r} has a name that {markup} cannot write", param)
    return name


def _braced_arguments(quote: str, nested: bool) -> _Arguments:
    """`x:1,s:<escape>text<escape>`: bare word keys, strings between ``quote``, numbers, booleans and null as
    JSON, and with ``nested`` (Gemma 4, whose parser matches braces) objects `{k:...}` and arrays `[...]` of the
    same; FunctionGemma's parser cuts the arguments at the first comma or closing brace, so scalars only."""
    shapes = "string, integer, number, boolean, null" + (", object, array" if nested else "")
    return _Arguments(
        names=r"\w+", name_rule="/[A-Za-z0-9_]+/",
        cannot_name="is not a bare word, which call:name{key:...} cannot write",
        item=lambda name, value: f'{name} ":" {value}', value=lambda schema: _braced_value(schema, quote, nested),
        cannot_write=f"has a schema call:name{{key:...}} cannot write back (its type, and its items' and "
                     f"properties', must be one of {shapes}, or absent; an enum's values of that type; keys bare "
                     f"words)", separator=_COMMA_BARE)


_COMMA_BARE = json.dumps(",")


def _braced_value(schema: dict[str, Any], quote: str, nested: bool) -> str | None:
    """One value in `call:name{...}`: a string between ``quote`` (text without "<", "{" or "}"), a number, boolean
    or null as JSON, with ``nested`` an object or array of such values; None for what the parser cannot read
    back."""
    kind = schema.get("type")
    if kind is not None and not isinstance(kind, str):
        return None
    if "enum" in schema:
        values = schema["enum"]
        if not values or not all(isinstance(v, (str, int, float, bool)) for v in values):
            return None
        if any(isinstance(v, str) and re.search(r"[<{}]", v) for v in values):
            return None
        return "(" + " | ".join(json.dumps(quote + v + quote if isinstance(v, str) else json.dumps(v))
                                for v in values) + ")"
    if kind in (None, "string"):
        return f"{json.dumps(quote)} /[^<{{}}]*/ {json.dumps(quote)}"
    if kind == "boolean":
        return '("true" | "false")'
    if kind == "null":
        return '"null"'
    if kind in ("integer", "number"):
        return f"%json {_json_schema(schema)}"
    if nested and kind == "object":
        fields = _braced_fields(schema, quote)
        return None if fields is None else f"{json.dumps('{')} {fields} {json.dumps('}')}"
    if nested and kind == "array":
        item = _braced_value(schema.get("items") if isinstance(schema.get("items"), dict) else {}, quote, nested)
        return None if item is None else _bounded_list(item, schema.get("minItems", 0), schema.get("maxItems"))
    return None


def _braced_fields(schema: dict[str, Any], quote: str) -> str | None:
    """A nested object's `k:v,...` (its listed properties in order, optional ones may be left out; any bare-word
    keys where it lists none), or None where one of them cannot be written."""
    listed, free = _properties(schema)
    if free:
        pair = f'/[A-Za-z0-9_]+/ ":" {_braced_value({}, quote, True)}'
        return f"({pair} ({_COMMA_BARE} {pair})*)?"
    items = []
    for name, sub, required in listed:
        value = _braced_value(sub, quote, True)
        if value is None or not re.fullmatch(r"\w+", name):
            return None
        items.append((f'{json.dumps(name)} ":" {value}', required))
    return _sequence(items, _COMMA_BARE) if items else ""


def _bounded_list(item: str, least: int, most: int | None) -> str | None:
    """`[item,item,...]` with ``least`` to ``most`` (None: any number of) items."""
    if most is not None and most < least:
        return None
    if most == 0:
        return f"{json.dumps('[')} {json.dumps(']')}"
    more = f"({_COMMA_BARE} {item})"
    head = " ".join([item] + [more] * (max(least, 1) - 1))
    tail = f"{more}*" if most is None else " ".join([f"{more}?"] * (most - max(least, 1)))
    body = f"({head} {tail})" + ("?" if least == 0 else "")
    return f"{json.dumps('[')} {body} {json.dumps(']')}"


# ---- values that hold no marker ------------------------------------------------------------------------------
# A call's parser ends a value at the first closing tag and the splitter ends a call at the first end marker, so
# a JSON value inside a call must not hold them (`ToolCallFormat.markers`) in any string or key: the raw text
# values keep out `<` altogether (`_TERMINALS`), and every JSON schema the calls embed is rewritten so its strings
# and keys match `_without(markers)`: a `pattern` wherever a string may stand, an object's free keys through
# `patternProperties` (llguidance has no `propertyNames`), and a subschema that allows any value a reference to
# `_MARKERLESS`, any JSON whose strings and keys hold none (a plain string one to `_MARKERLESS_TEXT`, so the long
# pattern stands once per schema where it can).
_MARKERLESS = "mlxsched_markerless"
_MARKERLESS_TEXT = "mlxsched_markerless_text"
_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly"})
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "contains", "not", "if", "then", "else", "additionalProperties")


def _without(markers: tuple[str, ...]) -> str:
    """A regex matching exactly the strings that hold none of ``markers``, each of which holds its first character
    at its start only (`ToolCallFormat.markers` cuts them so). Its states are the markers' proper prefixes (a trie):
    a prefix followed by a character that extends no marker and opens none goes back to the start; one followed by
    a marker's first character begins that marker's prefix. Written as nested groups over the trie, so its length
    grows with the markers' total length."""
    markers = tuple(m for m in markers if not any(o != m and o in m for o in markers))  # the shortest suffice
    firsts = {m[0] for m in markers}
    if any(set(m[1:]) & firsts for m in markers):
        raise ValueError(f"markers must hold their first characters at their start only: {markers}")
    after: dict[str, set[str]] = {}  # each proper prefix -> the characters that extend it
    for marker in markers:
        for i in range(1, len(marker)):
            after.setdefault(marker[:i], set()).add(marker[i])

    def text(chars: str) -> str:
        return "".join("\\" + c if c in r".^$*+?()[]{}|\/-" else c for c in chars)

    def other_than(chars: set[str]) -> str:
        return "[^" + text("".join(sorted(chars))) + "]"

    def deeper(prefix: str) -> list[str]:  # the prefixes one character longer (not whole markers)
        return [prefix + c for c in sorted(after.get(prefix, ())) if prefix + c in after]

    def partial(prefix: str) -> str:  # what may follow `prefix` and end the string, or meet a first character
        more = deeper(prefix)
        return "(?:" + "|".join(text(p[-1]) + partial(p) for p in more) + ")?" if more else ""

    def leave(prefix: str) -> str:  # what may follow `prefix` and go back to the start
        return "(?:" + "|".join([other_than(firsts | after[prefix])]
                                + [text(p[-1]) + leave(p) for p in deeper(prefix)]) + ")"

    opened = "(?:" + "|".join(text(f) + partial(f) for f in sorted(firsts)) + ")"
    closed = "(?:" + "|".join(text(f) + leave(f) for f in sorted(firsts)) + ")"
    return f"^(?:{other_than(firsts)}|{opened}*{closed})*{opened}*$"


def _markerless(schema: Any, pattern: str) -> Any:
    """``schema`` with every string and key it allows (at any depth) matching ``pattern``."""
    if schema is True or (isinstance(schema, dict) and set(schema) - {"x-guidance"} <= _ANNOTATIONS):
        options = {"x-guidance": schema["x-guidance"]} if isinstance(schema, dict) and "x-guidance" in schema else {}
        return {**options, "$ref": f"#/$defs/{_MARKERLESS}"}
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_markerless(s, pattern) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _markerless(s, pattern) for k, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = _markerless(out[key], pattern)
    kinds = out.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds or ())
    if kinds == {"string"} and set(out) - {"type"} <= _ANNOTATIONS:  # the common case: one definition for all
        return {"$ref": f"#/$defs/{_MARKERLESS_TEXT}"}
    composed = any(key in out for key in ("anyOf", "oneOf", "allOf", "$ref", "enum", "const"))
    if "string" in kinds or not (kinds or composed):  # (a union's branches, a fixed value: as they are)
        if "pattern" in out:  # its own and ours
            out["allOf"] = [*out.get("allOf", []), {"pattern": pattern}]
        else:
            out["pattern"] = pattern
    if "object" in kinds and out.get("additionalProperties", True) is not False:
        if "properties" in out:  # the keys it lists (as the markups write arguments: no free key)
            out["additionalProperties"] = False
        elif "patternProperties" not in out:  # any keys: markerless ones
            out["patternProperties"] = {pattern: out.pop("additionalProperties", {"$ref": f"#/$defs/{_MARKERLESS}"})}
            out["additionalProperties"] = False
    if "array" in kinds and "items" not in out and "prefixItems" not in out:
        out["items"] = {"$ref": f"#/$defs/{_MARKERLESS}"}
    return out


def _markers_kept_out(rules: str, markers: tuple[str, ...]) -> str:
    """``rules`` with each embedded JSON schema (`%json {...}`) rewritten by `_markerless`, its root given the
    `_MARKERLESS` definition."""
    if not markers:
        return rules
    pattern = _without(markers)
    text = {"type": "string", "pattern": pattern}
    anything = {"anyOf": [{"$ref": f"#/$defs/{_MARKERLESS_TEXT}"}, {"type": ["number", "boolean", "null"]},
                          {"type": "array", "items": {"$ref": f"#/$defs/{_MARKERLESS}"}},
                          {"type": "object", "patternProperties": {pattern: {"$ref": f"#/$defs/{_MARKERLESS}"}},
                           "additionalProperties": False}]}
    decoder, out, at = json.JSONDecoder(), [], 0
    while (found := rules.find("%json ", at)) >= 0:
        start = found + len("%json ")
        schema, end = decoder.raw_decode(rules, start)
        rewritten = _markerless(schema, pattern)
        used = json.dumps(rewritten)
        defs = {**({_MARKERLESS: anything, _MARKERLESS_TEXT: text} if f"#/$defs/{_MARKERLESS}\"" in used else {}),
                **({_MARKERLESS_TEXT: text} if f"#/$defs/{_MARKERLESS_TEXT}" in used else {})}
        if defs:  # (only where referenced: a tag markup embeds a schema per value)
            rewritten["$defs"] = {**rewritten.get("$defs", {}), **defs}
        out += [rules[at:start], json.dumps(rewritten)]
        at = end
    return "".join(out) + rules[at:]


def _json_schema(schema: dict[str, Any]) -> str:
    return json.dumps({"x-guidance": JSON_OPTIONS, **schema})


def _listed_arguments_schema(tool: dict[str, Any]) -> str:
    """The tool's arguments schema, keeping to the parameters it lists where it lists any (as the other markups'
    `_arguments` do): a call holds to its schema either way, and a free key is text the model may never end."""
    params = tool["function"].get("parameters") or {"type": "object"}
    if "properties" in params and "additionalProperties" not in params:
        params = {**params, "additionalProperties": False}
    return _json_schema(params)


def _arguments_schema(tool: dict[str, Any]) -> str:
    return _json_schema(tool["function"].get("parameters") or {"type": "object"})
