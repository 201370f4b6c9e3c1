"""``chain-of-focus``: Chain-of-Focus / Adaptive-CoF (xtong-zhang/Chain-of-Focus), adaptive zooming on Qwen2.5-VL.

Taken from the agent's own evaluation code (github.com/xtong-zhang/Chain-of-Focus, ``eval/vstar/vllm_inference.py``
with the settings of ``slurm_jobs/eval/inference_vstar.sh``):

* The system prompt (``SYSTEM_PROMPT``: an ``image_zoom_in_tool(bbox_2d, label)`` schema in ``<tools>``, calls in
  ``<tool_call>`` JSON) and the user turn: the image, then ``"Question: {text}"`` + ``USER_PROMPT``. The image is
  the original resized by ``smart_resize`` (``min_pixels=112*112`` from ``--min_resolution 112``,
  ``max_pixels=3840*3840``); boxes are **absolute pixels of that view** (Qwen2.5-VL's own frame).
* The loop: a turn containing ``<tool_call>`` is a call, and only the **first** ``<tool_call>...</tool_call>`` is read
  (``re.search``; the tool name is not checked); any other turn is final. ``find_absolute_bboxes`` checks the box
  (a list of 4 numbers, ``0 <= x0 < w``, ``0 <= y0 < h``, ``0 < x1 <= w``, ``0 < y1 <= h``, ``x1 > x0``, ``y1 > y0``)
  and enlarges it 1.5x about its centre (``--enlarge_factor 1.5``), clipped to the view, sides truncated to ints;
  ``do_crop`` cuts it **from the first image's view** (never from an earlier crop) and resizes it to twice its size
  (``--scaleup_factor 2``) through ``smart_resize`` (same pixel bounds). The result comes back as a user turn: the
  crop, then ``USER_PROMPT``. There is no error text: a call it cannot read (no closed block, bad JSON, a box that
  fails the checks) gets ``Image.crop(None)``, the **whole view** at twice its size; one that raises (no
  ``arguments``/``bbox_2d``, not 4 values) gets the **view itself**.
* ``max_iterations = 6`` calls (the loop stops after the 6th call's image, without an answer), ``--max_new_tokens
  512`` a turn, vLLM's ``limit_mm_per_prompt={"image": 6}``.
* ``eval/vstar/judge_result.py``: the answer is the first ``<answer>\\s*(.*?)\\s*</answer>`` on one line (no DOTALL).

Mapping: the zoom -> vagent ``crop`` on image 1 (box converted from the view the policy saw by
``geometry.model_to_original``, cut at full resolution, then sized as CoF sizes its crop). The RL stage
(``verl/recipe/zoomin``, sglang multi-turn with 4 assistant turns and tool-role results) is not what this profile
follows: the evaluation loop above is. Not applied: the 512-token turn cap (``MAX_NEW_TOKENS``; pass
``--max-new-tokens 512``). CoF's view is ``smart_resize`` within 112x112..3840x3840 pixels; give the policy that
budget (``min_pixels=12544``, ``max_pixels=14745600``) or its boxes are read in a smaller view's pixels.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from PIL import Image

from vagent.agents.profile import AgentLimits, image_parts, original_context, run_tool
from vagent.chat import ParsedTurn, ParseError
from vagent.geometry import model_to_original
from vagent.media import MediaError, smart_resize
from vagent.toolbox import ToolContext
from vagent.types import ContentPart, Message, Observation, ToolCall

__all__ = ["PROFILE", "ChainOfFocusProfile"]

SYSTEM_PROMPT = (
    "You are a helpful assistant.\n\n# Tools\nYou may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name":"image_zoom_in_tool","description":"Zoom in on a specific region of an '
    'image by cropping it based on a bounding box (bbox_2d) and an optional object label.","parameters":{"properties":'
    '{"bbox_2d":{"type":"array","items":{"type":"number"},"minItems":4,"maxItems":4,"description":"The bounding box '
    "of the region to zoom in, as [x1, y1, x2, y2], where (x1, y1) is the top-left corner and (x2, y2) is the "
    'bottom-right corner."},"label":{"type":"string","description":"The name or label of the object in the specified '
    'bounding box (optional)."}},"required":["bbox_2d"], "type":"object"},"args_format": "Format the arguments as a '
    'JSON object."}}\n</tools>\n\nFor the function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)
USER_PROMPT = (
    "\nThink in the mind first, and then decide whether to call tools one or more times OR provide final answer. "
    "Format strictly as: <think>...</think> <tool_call>...</tool_call> <tool_call>...</tool_call> (if any tools "
    "needed) OR <answer>...</answer> (if no tools needed)."
)
ENLARGE, SCALE_UP = 1.5, 2  # --enlarge_factor, --scaleup_factor
MIN_PIXELS, MAX_PIXELS = 112 * 112, 3840 * 3840  # --min_resolution 112; resize_image's max_pixels
MAX_NEW_TOKENS = 512  # --max_new_tokens (not an AgentLimits field: pass --max-new-tokens)
WHOLE, VIEW = "whole", "view"  # what CoF shows for a call it cannot use (see the module docstring)
_ERROR_KINDS = {WHOLE: "bad_box", VIEW: "bad_call"}  # a box that fails its checks; a call its code raises on

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>")  # one line, as judge_result.py reads it


class ChainOfFocusProfile:
    """Chain-of-Focus' protocol (see the module docstring)."""

    name = "chain-of-focus"
    stop_strings: tuple[str, ...] = ()  # vLLM's chat() reads whole turns
    inline = False
    # max_iterations = 6; limit_mm_per_prompt image 6; resize_image's max_pixels; the region cut as CoF cuts it
    limits = AgentLimits(max_turns=6, max_images=6, tool_max_pixels=MAX_PIXELS, tool_min_pixels=1)
    tools = ("crop",)

    def prompt(self, question: str, images: Sequence[Image.Image | str], videos: Sequence[str],
               tools: Sequence[str], frames: int | None = None) -> list[Message]:  # fmt: skip
        user = Message("user", [*image_parts(images), ContentPart("text", f"Question: {question}{USER_PROMPT}")])
        return [Message.text("system", SYSTEM_PROMPT), user]

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        if "<tool_call>" not in text:
            answer = _ANSWER.search(text)
            turn.answer = answer.group(1) if answer else None
            return turn
        block = _CALL.search(text)
        if block is None:
            turn.actions = [ParseError("unclosed_tag", "no <tool_call>...</tool_call> block")]
        else:
            raw = block.group(1).strip()
            try:
                data = json.loads(raw)
            except json.JSONDecodeError as e:
                turn.actions = [ParseError("bad_json", f"Failed to parse tool_call JSON: {e}")]
            else:
                name = data.get("name") if isinstance(data, dict) else None
                call = ToolCall(name if isinstance(name, str) else "", {"call": data}, raw)
                turn.actions, turn.tool_calls = [call], [call]
        turn.errors = [a for a in turn.actions if isinstance(a, ParseError)]
        return turn

    def tool_for(self, call: ToolCall) -> str | None:
        return "crop"  # CoF crops whatever the call is named

    def act(self, parsed: ParsedTurn, context: ToolContext, offered: Sequence[str]) -> list[Observation]:
        return [self._act_one(action, context) for action in parsed.actions]

    def _act_one(self, action: ToolCall | ParseError, context: ToolContext) -> Observation:
        view = context.model_sizes[0]
        box = WHOLE if isinstance(action, ParseError) else cof_box(action.arguments["call"], view)
        error = action.kind if isinstance(action, ParseError) else _ERROR_KINDS.get(str(box))
        region = box if isinstance(box, list) else [0, 0, *view]
        size = view if box == VIEW else _sized((region[2] - region[0]) * SCALE_UP, (region[3] - region[1]) * SCALE_UP)
        if size is None:  # smart_resize refuses the crop (e.g. an aspect ratio over 200): do_crop's except
            region, size, error = [0, 0, *view], view, error or _ERROR_KINDS[VIEW]
        original = model_to_original(region, "absolute", view, context.images[0].size)
        result = run_tool("crop", {"bbox": list(original), "image_index": 0}, original_context(context, self.limits))
        if not result.ok:
            return Observation(text=USER_PROMPT, error=result.error or "tool_exception", metadata=result.metadata)
        crop = result.images[0]
        if crop.size != size:  # the crop tool sized it for the policy; CoF resizes it its own way
            crop = crop.resize(size, Image.Resampling.LANCZOS)
        metadata = {**result.metadata, "box_view": region}
        return Observation(text=USER_PROMPT, images=[crop], error=error, metadata=metadata)

    def observation_message(self, observation: Observation) -> Message:
        return Message("user", [*image_parts(observation.images), ContentPart("text", observation.text)])

    def prefill(self, turn: int) -> str:
        return ""

    def forced_spans(self, text: str, turn: int) -> list[tuple[int, int]]:
        return []


def cof_box(call: object, view: tuple[int, int]) -> list[int] | str:
    """CoF's ``find_absolute_bboxes`` on a parsed call, for a view of ``view`` (width, height) pixels: the enlarged
    integer box in view pixels, or ``WHOLE`` (it returns None) / ``VIEW`` (it raises).

    >>> cof_box({"arguments": {"bbox_2d": [100, 100, 200, 140]}}, (1000, 800))
    [75, 90, 225, 150]
    """
    try:
        bbox = call["arguments"]["bbox_2d"]  # type: ignore[index]
        x0, y0, x1, y1 = bbox
    except (KeyError, TypeError, ValueError):
        return VIEW
    w, h = view
    numbers = all(isinstance(v, (int, float)) for v in (x0, y0, x1, y1))  # bool passes, as in CoF's isinstance
    if not (isinstance(bbox, list) and numbers and 0 <= x0 < w and 0 <= y0 < h and 0 < x1 <= w and 0 < y1 <= h):
        return WHOLE
    if x1 <= x0 or y1 <= y0:
        return WHOLE
    cx, cy, bw, bh = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) * ENLARGE, (y1 - y0) * ENLARGE
    box = [int(max(0, cx - bw / 2)), int(max(0, cy - bh / 2)), int(min(w, cx + bw / 2)), int(min(h, cy + bh / 2))]
    return box if box[2] > box[0] and box[3] > box[1] else VIEW  # an empty crop fails in do_crop's try


def _sized(width: int, height: int) -> tuple[int, int] | None:
    """CoF's ``resize_image`` on a size: ``smart_resize`` within its pixel bounds, (width, height); None if refused."""
    try:
        h, w = smart_resize(height, width, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    except MediaError:
        return None
    return w, h


PROFILE = ChainOfFocusProfile()
