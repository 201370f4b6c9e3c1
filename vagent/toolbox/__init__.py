"""The agent's tools. Each tool is a module with ``NAME``, ``SCHEMA`` (JSON schema) and
``call(arguments, context) -> Observation``; ``TOOLS`` lists them explicitly.

``call_tool`` is the only entry point the rollout uses: it checks the call against the schema and
turns every failure (unknown tool, bad arguments, an exception inside the tool) into an error
``Observation``, so no tool can crash a rollout.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vagent.toolbox import crop
from vagent.toolbox.context import ToolContext
from vagent.types import Observation, ToolCall

__all__ = ["TOOLS", "ToolContext", "call_tool", "check_arguments", "tool_schemas"]

TOOLS: dict[str, ModuleType] = {
    crop.NAME: crop,
}

_JSON_TYPES = {
    "number": (int, float),
    "integer": (int,),
    "string": (str,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def tool_schemas(names: list[str]) -> list[dict[str, Any]]:
    """Schemas of the named tools, for the system prompt. Unknown names raise (a config error)."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise KeyError(f"unknown tool(s) {unknown}; available: {sorted(TOOLS)}")
    return [TOOLS[n].SCHEMA for n in names]


def _type_ok(value: Any, json_type: str) -> bool:
    if isinstance(value, bool) and json_type in ("number", "integer"):
        return False
    return isinstance(value, _JSON_TYPES.get(json_type, object))


def check_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """Validate arguments against a tool's flat JSON schema. Returns an error message or None."""
    params = schema["parameters"]
    properties = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing} for {schema['name']!r}"
    extra = [k for k in arguments if k not in properties]
    if extra:
        return f"unexpected argument(s) {extra} for {schema['name']!r}; accepted: {sorted(properties)}"
    for key, value in arguments.items():
        spec = properties[key]
        if not _type_ok(value, spec["type"]):
            return f"argument {key!r} of {schema['name']!r} must be of type {spec['type']}, got {type(value).__name__}"
        if spec["type"] == "array" and "items" in spec and not all(_type_ok(v, spec["items"]["type"]) for v in value):
            return f"argument {key!r} of {schema['name']!r} must hold items of type {spec['items']['type']}"
    return None


def call_tool(call: ToolCall, context: ToolContext, offered: list[str] | None = None) -> Observation:
    """Run one tool call. Never raises: every failure is an error Observation with a kind."""
    names = offered if offered is not None else list(TOOLS)
    if call.name not in names or call.name not in TOOLS:
        return Observation(text=f"unknown tool {call.name!r}; available tools: {names}.", error="unknown_tool")
    tool = TOOLS[call.name]
    problem = check_arguments(call.arguments, tool.SCHEMA)
    if problem is not None:
        return Observation(text=problem + ".", error="bad_arguments")
    try:
        return tool.call(call.arguments, context)
    except Exception as e:  # a bug in a tool must not end the episode; the model sees it, metrics count it
        return Observation(text=f"{call.name} failed: {type(e).__name__}: {e}", error="tool_exception")
