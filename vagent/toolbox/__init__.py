"""The agent's tools. Each tool is a module with ``NAME``, ``SCHEMA`` (JSON schema) and
``call(arguments, context) -> Observation``; ``TOOLS`` lists them explicitly.

``call_tool`` is the only entry point the rollout uses: it checks the call against the schema and
turns every failure (unknown tool, bad arguments, an exception inside the tool) into an error
``Observation``, so no tool can crash a rollout.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, runtime_checkable

import jsonschema

from vagent.toolbox import code, crop, crop_clip, draw, enhance, flip, rotate, sample_frames, search, zoom_in
from vagent.toolbox.context import ToolContext, ToolServices
from vagent.types import Observation, ToolCall

__all__ = ["TOOLS", "Tool", "ToolContext", "ToolServices", "call_tool", "check_arguments", "check_call", "tool_schemas"]


@runtime_checkable
class Tool(Protocol):
    """What every tool module provides (a module satisfies a Protocol: PEP 544)."""

    NAME: str
    SCHEMA: dict[str, Any]  # OpenAI/Qwen function schema: {"name", "description", "parameters": JSON schema}

    def call(self, arguments: dict[str, Any], context: ToolContext) -> Observation:
        """Run the tool on validated ``arguments``; failures come back as an error ``Observation``."""
        ...


TOOLS: dict[str, Tool] = {
    crop.NAME: crop,
    code.NAME: code,
    zoom_in.NAME: zoom_in,
    rotate.NAME: rotate,
    flip.NAME: flip,
    enhance.NAME: enhance,
    draw.NAME: draw,
    search.NAME: search,
    sample_frames.NAME: sample_frames,
    crop_clip.NAME: crop_clip,
}


def tool_schemas(names: list[str]) -> list[dict[str, Any]]:
    """Schemas of the named tools, for the system prompt. Unknown names raise (a config error)."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise KeyError(f"unknown tool(s) {unknown}; available: {sorted(TOOLS)}")
    return [TOOLS[n].SCHEMA for n in names]


@functools.cache
def _validator(name: str) -> jsonschema.protocols.Validator:
    # Extra arguments are an error (a typo like "bbx" must not silently fall back to a default).
    schema = {"additionalProperties": False, **TOOLS[name].SCHEMA["parameters"]}
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def check_arguments(arguments: dict[str, Any], name: str) -> str | None:
    """Validate a call's arguments against the tool's JSON schema. Returns a message for the model, or None.

    >>> check_arguments({"bbox": [1, 2, 3, 4], "zoom": 2}, "crop")
    "bad arguments for 'crop': Additional properties are not allowed ('zoom' was unexpected)"
    """
    error = jsonschema.exceptions.best_match(_validator(name).iter_errors(arguments))
    if error is None:
        return None
    where = "".join(f"[{p!r}]" for p in error.absolute_path)
    return f"bad arguments for {name!r}: " + (f"argument{where}: " if where else "") + error.message


def check_call(call: ToolCall, offered: list[str] | None = None) -> Observation | None:
    """Whether a call may run, without running it: the error Observation (``unknown_tool``,
    ``bad_arguments``) or None. ``offered`` limits the names (default: every tool)."""
    names = offered if offered is not None else list(TOOLS)
    if call.name not in names or call.name not in TOOLS:
        return Observation(text=f"unknown tool {call.name!r}; available tools: {names}.", error="unknown_tool")
    problem = check_arguments(call.arguments, call.name)
    if problem is not None:
        return Observation(text=problem + ".", error="bad_arguments")
    return None


def call_tool(call: ToolCall, context: ToolContext, offered: list[str] | None = None) -> Observation:
    """Run one tool call. Never raises: every failure is an error Observation with a kind."""
    refusal = check_call(call, offered)
    if refusal is not None:
        return refusal
    try:
        return TOOLS[call.name].call(call.arguments, context)
    except Exception as e:  # a bug in a tool must not end the episode; the model sees it, metrics count it
        return Observation(text=f"{call.name} failed: {type(e).__name__}: {e}", error="tool_exception")
