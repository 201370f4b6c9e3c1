"""Property test: thousands of random and mutated model outputs through the parser and tool dispatch.

Whatever the model writes, nothing escapes as an exception: every ``<tool_call>`` block yields one
Observation, and every failure is an error Observation with a kind and a message. Arguments are
drawn per tool from its own schema (well-typed values, edge values such as NaN and huge numbers,
wrong types, missing and extra keys), so a new tool in ``TOOLS`` is fuzzed without editing this file.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from videos import write_video

from vagent.chat import parse_turn
from vagent.rollout import act
from vagent.toolbox import TOOLS, ToolContext
from vagent.toolbox.sandbox import Sandbox
from vagent.types import Observation

# Derandomized so CI is stable; the example count is what makes it thorough.
FUZZ = settings(
    max_examples=1500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

NUMBERS = st.one_of(
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1e308, -0.0, 2**63, 0.5]),
)
JSON_LEAF = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=20))
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _typed(spec: dict) -> st.SearchStrategy:
    """A value of the schema's type, biased toward edges (bounds, NaN, empty, oversize)."""
    kind = spec.get("type")
    if "enum" in spec:
        return st.sampled_from(spec["enum"]) | st.text(max_size=10)
    if kind == "number":
        return NUMBERS
    if kind == "integer":
        return st.integers(-5, 50) | st.sampled_from([2**31, -(2**31)])
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        # code-like and query-like strings, including ones that do something when run
        return st.text(max_size=40) | st.sampled_from(["print(1)", "1/0", "while True: pass", "import os", "cat dog"])
    if kind == "array":
        items = _typed(spec.get("items", {}))
        return st.lists(items, max_size=6) | st.lists(NUMBERS, min_size=4, max_size=4)
    if kind == "object":
        return st.dictionaries(st.text(max_size=8), JSON_VALUE, max_size=3)
    return JSON_VALUE


def _sane(spec: dict) -> st.SearchStrategy:
    """A value a reasonable model would write: right type, within the schema's bounds, plausible sizes."""
    kind = spec.get("type")
    if "enum" in spec:
        return st.sampled_from(spec["enum"])
    if kind == "number":
        low, high = spec.get("minimum", -20), spec.get("maximum", 1200)
        return st.floats(low, high, allow_nan=False) | st.integers(math.ceil(low), math.floor(high))
    if kind == "integer":
        return st.integers(spec.get("minimum", 0), min(spec.get("maximum", 3), 40))
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.sampled_from(["print(1)", "print(images[0].size)", "show(images[0].rotate(90))", "cat", "dog here"])
    if kind == "array":
        low = spec.get("minItems", 1)
        return st.lists(_sane(spec.get("items", {})), min_size=low, max_size=spec.get("maxItems", max(low, 4)))
    return JSON_VALUE


@st.composite
def tool_call_text(draw) -> str:
    name = draw(st.sampled_from([*TOOLS, "teleport", ""]))
    properties = TOOLS[name].SCHEMA["parameters"].get("properties", {}) if name in TOOLS else {}
    # Half the calls are what a sensible model writes (so the tools' success paths run), half are wild.
    value = _sane if draw(st.booleans()) else (lambda spec: _typed(spec) | JSON_VALUE)
    arguments = {}
    for key, spec in properties.items():
        if key in TOOLS[name].SCHEMA["parameters"].get("required", []) or draw(st.booleans()):
            arguments[key] = draw(value(spec))
    if draw(st.integers(0, 9)) == 0:
        arguments[draw(st.text(max_size=6))] = draw(JSON_VALUE)  # an extra, unknown argument
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<think>{draw(st.text(max_size=20))}</think><tool_call>\n{body}\n</tool_call>"


@st.composite
def mutated(draw, base: st.SearchStrategy[str]) -> str:
    """Character-level damage of the kind sampling produces: deletions, insertions, truncation, repeats."""
    text = draw(base)
    for _ in range(draw(st.integers(0, 4))):
        if not text:
            break
        i = draw(st.integers(0, len(text) - 1))
        op = draw(st.sampled_from(["delete", "insert", "truncate", "repeat", "quote"]))
        if op == "delete":
            text = text[:i] + text[i + 1 :]
        elif op == "insert":
            text = text[:i] + draw(st.sampled_from([*list("{}[]\",:'<>/ \n"), "</tool_call>", "<answer>"])) + text[i:]
        elif op == "truncate":
            text = text[:i]
        elif op == "repeat":
            text = text[:i] + text[i:] * 2
        else:
            text = text.replace('"', "'", 1)
    return text


RANDOM_OUTPUT = st.text(alphabet=st.sampled_from(list("<>/{}[]\"':, \ntool_cal answerthink0123.-")), max_size=300)
MODEL_OUTPUT = st.one_of(tool_call_text(), mutated(tool_call_text()), RANDOM_OUTPUT)


@pytest.fixture(scope="module")
def context_factory(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    video = str(write_video(tmp / "clip.mp4", frames=16, step=12))
    broken = tmp / "broken.mp4"
    broken.write_bytes(b"\x00not a video")
    search = None
    if "search" in TOOLS:
        from vagent.toolbox.search import BM25Backend

        search = BM25Backend.from_records(
            [{"title": f"doc {i}", "text": f"the {w} is here", "url": f"u{i}"} for i, w in enumerate("cat dog".split())]
        )
    image = Image.new("RGB", (640, 480), (200, 180, 160))
    sandbox = Sandbox(timeout_s=0.5)  # `while True: pass` is a likely draw; the limit, not the loop, sets the cost

    def make() -> ToolContext:
        # A fresh context per example: tool outputs appended by one example must not leak into the next.
        return ToolContext(
            images=[image, image.resize((100, 50))],
            model_sizes=[(644, 476), (112, 56)],
            min_pixels=28 * 28 * 4,
            max_pixels=28 * 28 * 64,
            videos=[video, str(broken)],
            max_frames=4,
            search=search,
            sandbox=sandbox,
        )

    return make


def _check(observation: Observation, context: ToolContext) -> None:
    assert isinstance(observation, Observation)
    assert isinstance(observation.text, str) and observation.text
    if observation.error is not None:
        assert isinstance(observation.error, str) and observation.error
        return
    for image in observation.images:
        assert isinstance(image, Image.Image) and image.width > 0 and image.height > 0
        # resized within the pixel budget, never below the processor's minimum
        assert image.width * image.height <= max(context.max_pixels, context.frame_max_pixels) * 1.01
        assert image.width * image.height >= context.min_pixels * 0.99
    for t in observation.timestamps or []:
        assert math.isfinite(t) and t >= 0


@FUZZ
@given(text=MODEL_OUTPUT)
def test_any_model_output_yields_one_observation_per_call(context_factory, text):
    turn = parse_turn(text)
    assert all(e.kind and e.message for e in turn.errors)
    context = context_factory()
    observations = act(turn, context, offered=list(TOOLS))
    assert len(observations) == len(turn.actions)
    for observation in observations:
        _check(observation, context)
