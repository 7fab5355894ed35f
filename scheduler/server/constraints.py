"""A request's output constraint: OpenAI's `response_format`, vLLM's `structured_outputs` and a forced tool call
(`tool_choice` "required" or a named function), as the engine's `StructuredOutput`.

A forced call is a Lark grammar over the model's own call markup, with each offered tool's parameters as the
arguments' schema (llguidance embeds a JSON schema in Lark with `%json`), one call or several, in the shape its
parser reads (`ToolCallFormat.shape`): a JSON body `{"name": ..., "arguments": ...}` between the markers, on
lines of their own (mlx-lm's `json_tools`, Qwen-style templates), or `name[ARGS]{...}` after the start marker
(mlx-lm's `mistral`, `[TOOL_CALLS]`). With tools offered on "auto" and an output format, the answer is either
calls or that format.

A thinking model whose prompt opens the reasoning reasons freely: the constraint starts after its end marker
(`StructuredOutput.after`), and may follow the blank line the model writes there (up to 4 whitespace characters:
unbounded, a model the grammar keeps from its own answer would write whitespace until max_tokens).
"""

from __future__ import annotations

import json
from typing import Any

from ..execution.structured import JSON_OPTIONS
from ..request import StructuredKind, StructuredOutput
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .tool_calls import CallShape, ToolCallFormat

_WS = 'WS: /[ \\t\\r\\n]{1,4}/'


def output_constraint(body: ChatCompletionRequest | CompletionRequest, tool_format: ToolCallFormat | None,
                      tools: list[dict[str, Any]] | None, reasoning_end: str | None) -> StructuredOutput | None:
    """The constraint ``body`` asks for, or None. ``tool_format`` / ``tools``: the model's call markup and the
    tools offered (None: no tool calling); ``reasoning_end``: the end marker when the prompt opens the
    reasoning. Raises APIError (400) naming the field where the model cannot keep to it."""
    forced = isinstance(body, ChatCompletionRequest) and body.forces_tool_call()
    fmt = _output_format(body)
    if forced or (fmt is not None and tools):
        if tool_format is None or tool_format.shape is None:
            param = ("tool_choice" if forced else "response_format" if body.output_format_given()
                     else "structured_outputs")
            raise APIError(400, f"{param}: this model's tool calls are neither JSON between markers nor "
                                "name[ARGS]{...}, so calls cannot be constrained here", param)
        calls = _calls_rule(body, tool_format, tools or [])
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


def _calls_rule(body: Any, fmt: ToolCallFormat, tools: list[dict[str, Any]]) -> str:
    """The `calls` rule: one call of the named tool, one call of any (parallel_tool_calls false), or several."""
    choice = getattr(body, "tool_choice", None)
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
    single = isinstance(choice, NamedToolChoice) or getattr(body, "parallel_tool_calls", None) is False
    if fmt.shape is CallShape.NAME_ARGS:  # `[TOOL_CALLS]name[ARGS]{...}`, one after another
        names = " | ".join(f"{json.dumps(t['function']['name'] + '[ARGS]')} %json {_arguments_schema(t)}"
                           for t in tools)
        end = f" {json.dumps(fmt.end)}" if fmt.end else ""
        return f"calls: call{'' if single else '+'}\ncall: {json.dumps(fmt.start)} ({names}){end}"
    bodies = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
               "properties": {"name": {"const": t["function"]["name"]},
                              "arguments": t["function"].get("parameters") or {"type": "object"}}} for t in tools]
    schema = json.dumps({"x-guidance": JSON_OPTIONS, "anyOf": bodies})
    return (f"calls: call{'' if single else ' (NL call)*'}\n"
            f"call: {json.dumps(fmt.start + chr(10))} %json {schema} {json.dumps(chr(10) + fmt.end)}\n"
            'NL: "\\n"')


def _arguments_schema(tool: dict[str, Any]) -> str:
    return json.dumps({"x-guidance": JSON_OPTIONS, **(tool["function"].get("parameters") or {"type": "object"})})
