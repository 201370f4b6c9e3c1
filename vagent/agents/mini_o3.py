"""``mini-o3``: Mini-o3 (Mini-o3/Mini-o3), deep multi-turn visual search with a grounding (zoom-in) action.

Taken from the agent's own code (github.com/Mini-o3/Mini-o3):

* ``verl/trainer/constants.py``: the system prompt ``TOOL_CROP_SYSTEM_PROMPT`` (``data.system_prompt="tool_crop"``
  in ``README.md``): a call is ``<grounding>{"bbox_2d": [x0, y0, x1, y1], "source": "original_image"}</grounding>``
  with the box in **0-1 fractions** of the source image ("suppose the width and height of the image are 1.0"), the
  source being ``original_image`` or ``observation_i``; the answer goes in ``<answer>``. The observation turn
  ``TOOL_CALL_CROP_MULTI_TRUN_PROMPT`` (``multi_turn_prompt_type="v2"``) and the error turn
  ``ERROR_INFO_MULTI_TURN_PROMPT``.
* ``verl/workers/rollout/vllm_rollout/vllm_async_engine.py`` (``rollout.mode="async"``): generation stops at
  ``</grounding>`` (``ppo_trainer.yaml``: ``stop``); a turn with a ``<grounding>...</grounding>`` block is a call,
  read with the regex ``.*<grounding>{"bbox_2d": (.*),.*"source": ['"](.*)['"]}</grounding>`` (so the **last**
  call, written exactly in that layout); any other turn is final. The loop writes ``<|im_end|>\\n<|im_start|>user\\n``
  + the observation + ``<|im_end|>\\n<|im_start|>assistant\\n``: ``After the above Action {k}, here is the the zoom-in
  image (Observation {k+1}):\\n`` + the crop + ``.\\nContinue your reasoning ...``, with ``k`` the 0-based turn;
  errors as ``ERROR occurs during grounding. Error Information: {e}.\\n`` + ``ERROR_INFO_MULTI_TURN_PROMPT``.
* ``verl/workers/rollout/vllm_rollout/function_tools.py`` (``prepare_grounding_inputs_multi_turn``, ``crop_image``
  with ``resize=1``): ``observation_i`` is the i-th returned crop (0 = the original), each kept at full resolution;
  the fractions are multiplied by that image's size (``use_relative_coordinates=True``), truncated to ints, the
  top-left raised to 0 and the bottom-right lowered to ``size - 1``; the box must be at least 1 pixel wide and high
  and its aspect ratio under 200.
* ``verl/utils/dataset/multimodal_dataset.py`` (``process_image``, ``make_conversation_multimodal``): images, the
  prompt's and each crop, are scaled (aspect kept, sides truncated) into ``data.min_pixels=40000`` ..
  ``data.max_pixels=2000000``; the user turn is the row's ``problem`` (``"<image>\\n"`` + question,
  ``docs/mini_o3_demo.md``).
* ``verl/utils/reward_score/general_qa_tool.py`` (the judged reward its evaluation runs with,
  ``use_hybrid_reward_manager=True``, ``extract_answer_tags="strict"``): the answer is the first
  ``<answer>...</answer>`` of the episode's turns joined; the profile reads the first of the final turn (a call turn
  with an ``<answer>`` fails its format reward). Its rule-based ``general_qa_tool_mc.py`` reads the last one.
* Limits (``README.md``, evaluation = the validation settings): ``val_max_generation_round=12`` turns,
  ``val_limit_mm_per_prompt={'image': 12}`` images; a call at the last turn or at 12 images ends the episode.

Mapping: ``<grounding>`` -> vagent ``crop`` on the named image, the box converted by ``geometry.model_to_original``
(a 0-1 box is a box in a 1x1 frame) and cut exactly as Mini-o3 accepted it. Differences: the bbox list is read with
``ast.literal_eval`` where Mini-o3 ``eval``s it (expressions are an error here); ``Action``/``Observation`` are
numbered by the images so far, which is Mini-o3's turn count unless an earlier call failed (its own numbering then
disagrees with its ``observation_i`` indices); an observation that is later cropped again is the crop scaled into
40000..2000000 pixels where Mini-o3 keeps the unscaled crop (same region: the box is in fractions). Give the policy
Mini-o3's pixel budget (``min_pixels=40000``, ``max_pixels=2000000``) to see what it saw.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Sequence

from PIL import Image

from vagent.agents.profile import AgentLimits, image_parts, original_context, run_tool
from vagent.chat import ParsedTurn, ParseError
from vagent.geometry import model_to_original
from vagent.toolbox import ToolContext
from vagent.types import ContentPart, Message, Observation, ToolCall

__all__ = ["PROFILE", "MiniO3Profile"]

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the user's question based on the image provided. Output your thinking "
    "process within the <think> and </think> tags. Whenever you find anything unclear, you can zoom in a specific "
    'region in the given image to see more clearly by outputing <grounding>{"bbox_2d": [x0, y0, x1, y1], "source": '
    '"original_image"}</grounding>, where (x0, y0) and (x1, y1) are the top-left and bottom-right coordinates of the '
    "region that you want to zoom in, respectively (suppose the width and height of the image are 1.0), and 'source' "
    "refers to the image that you zoom in and could be either 'original_image' or 'observation_i'. Once the final "
    "answer is confirmed, put it within <answer> and </answer>."
)
IMAGE = "<image>"  # where the crop sits in the observation text (the loop writes the vision tokens there)
OBSERVATION = (
    "After the above Action {action}, here is the the zoom-in image (Observation {observation}):\n" + IMAGE + ".\n"
    "Continue your reasoning process inside <think> and </think>. If needed, you can continue to zoom in on the "
    "original image or any of the observations, by outputting <grounding> and </grounding> as before. If the final "
    "answer is confirmed, put your final answer inside <answer> and </answer>."
)
ERROR = "ERROR occurs during grounding. Error Information: {info}.\n"
ERROR_PROMPT = (
    "Please analyze the error information obtained from the function tool and adjust your response. Countinue your "
    "reasoning process inside <think> and </think>."
)
MIN_PIXELS, MAX_PIXELS = 40_000, 2_000_000  # data.min_pixels / data.max_pixels
MAX_ASPECT = 200

_BLOCK = re.compile(r"<grounding>(.*?)</grounding>", re.DOTALL)  # is this turn a call?
# The one layout Mini-o3 reads (greedy: the last call of the turn).
_CALL = re.compile(r'.*<grounding>\{"bbox_2d": (.*),.*"source": [\'"](.*)[\'"]\}</grounding>', re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_SOURCE = re.compile(r"observation_([0-9]*)")


class MiniO3Profile:
    """Mini-o3's protocol (see the module docstring)."""

    name = "mini-o3"
    stop_strings: tuple[str, ...] = ("</grounding>",)
    inline = False
    # README: val_max_generation_round=12, val_limit_mm_per_prompt image 12, data.max_pixels; boxes cut as accepted
    limits = AgentLimits(max_turns=12, max_images=12, tool_max_pixels=MAX_PIXELS, tool_min_pixels=1)
    tools = ("crop",)

    def prompt(self, question: str, images: Sequence[Image.Image | str], videos: Sequence[str],
               tools: Sequence[str], frames: int | None = None) -> list[Message]:  # fmt: skip
        user = Message("user", [*image_parts(images), ContentPart("text", "\n" + question)])  # "<image>\n" + question
        return [Message.text("system", SYSTEM_PROMPT), user]

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        if not _BLOCK.search(text):  # no call: the turn is final
            answer = _ANSWER.search(text)
            turn.answer = answer.group(1).strip() if answer else None
            return turn
        match = _CALL.match(text)
        if match is None:  # its `match.group(...)` on None
            turn.actions = [ParseError("bad_call", "'NoneType' object has no attribute 'group'")]
        else:
            try:
                bbox = ast.literal_eval(match.group(1).strip())
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
                turn.actions = [ParseError("bad_json", str(e))]
            else:
                call = ToolCall("grounding", {"bbox_2d": bbox, "source": match.group(2)}, match.group(0))
                turn.actions, turn.tool_calls = [call], [call]
        turn.errors = [a for a in turn.actions if isinstance(a, ParseError)]
        return turn

    def tool_for(self, call: ToolCall) -> str | None:
        return "crop" if call.name == "grounding" else None

    def act(self, parsed: ParsedTurn, context: ToolContext, offered: Sequence[str]) -> list[Observation]:
        return [self._act_one(action, context) for action in parsed.actions]

    def _act_one(self, action: ToolCall | ParseError, context: ToolContext) -> Observation:
        if isinstance(action, ParseError):
            return _error(action.message, action.kind)
        checked = _grounding(action.arguments["bbox_2d"], action.arguments["source"], context)
        if isinstance(checked, Observation):
            return checked
        index, box = checked
        result = run_tool("crop", {"bbox": box, "image_index": index}, original_context(context, self.limits))
        if not result.ok:
            return _error(result.text, result.error or "tool_exception")
        size = mini_o3_size(box[2] - box[0], box[3] - box[1])
        crop = result.images[0]
        if crop.size != size:  # the crop tool sized it for the policy; Mini-o3 scales it its own way
            crop = crop.resize(size, Image.Resampling.LANCZOS)
        landing = len(context.images)  # the crop becomes observation_{landing}
        text = OBSERVATION.format(action=landing - 1, observation=landing)
        return Observation(text=text, images=[crop], metadata=result.metadata)

    def observation_message(self, observation: Observation) -> Message:
        """A user turn; the crop sits where the text has ``<image>``."""
        if not observation.images:
            return Message.text("user", observation.text)
        before, after = observation.text.split(IMAGE, 1)
        parts = [ContentPart("text", before), *image_parts(observation.images), ContentPart("text", after)]
        return Message("user", parts)

    def prefill(self, turn: int) -> str:
        return ""

    def forced_spans(self, text: str, turn: int) -> list[tuple[int, int]]:
        return []


def _error(info: str, kind: str) -> Observation:
    return Observation(text=ERROR.format(info=info) + ERROR_PROMPT, error=kind)


def _grounding(bbox: object, source: str, context: ToolContext) -> tuple[int, list[int]] | Observation:
    """Mini-o3's checks, in its order: the image ``source`` names and the box in its pixels, or its error."""
    if not isinstance(bbox, list) or len(bbox) != 4:
        return _error("", "bad_box")  # a bare `assert`: empty message
    if source == "original_image":
        index = 0
    else:
        digits = _SOURCE.match(source)
        if digits is None or not digits.group(1):
            return _error(f"The 'source' argument \"{source}\" does not match the pattern 'observation_([0-9]*)'.",
                          "bad_arguments")  # fmt: skip
        index = int(digits.group(1))
    if index >= len(context.images):
        return _error(f'Error in predicting the source observation: "{source}".', "bad_arguments")
    bad = next((v for v in bbox if isinstance(v, bool) or not isinstance(v, (int, float))), None)
    if bad is not None:  # Python's words for `bbox[0] * w` on a non-number
        return _error(f"unsupported operand type(s) for *: '{type(bad).__name__}' and 'int'", "bad_box")
    if not all(math.isfinite(v) for v in bbox):  # literal_eval reads 1e999 as inf; int() refuses it
        return _error("cannot convert float infinity to integer", "bad_box")
    w, h = context.images[index].size
    # 0-1 fractions are a box in a 1x1 frame; unclamped, as Mini-o3 multiplies before it clips
    x1, y1, x2, y2 = (int(v) for v in model_to_original(bbox, "absolute", (1, 1), (w, h)))
    box = [max(x1, 0), max(y1, 0), min(x2, w - 1), min(y2, h - 1)]
    if not box[0] <= box[2] - 1:
        return _error(f"The bounding box is not valid in width: {box}", "bad_box")
    if not box[1] <= box[3] - 1:
        return _error(f"The bounding box is not valid in height: {box}", "bad_box")
    width, height = box[2] - box[0], box[3] - box[1]
    if width / height >= MAX_ASPECT or height / width >= MAX_ASPECT:
        return _error("The absolute aspect ratio of the bounding box exceeds 200, which is too large.", "bad_box")
    return index, box


def mini_o3_size(width: int, height: int) -> tuple[int, int]:
    """The size Mini-o3's ``process_image`` gives an image: scaled, aspect kept and sides truncated, into
    ``MIN_PIXELS``..``MAX_PIXELS``. ``mini_o3_size(100, 100) == (200, 200)``."""
    if width * height > MAX_PIXELS:
        scale = math.sqrt(MAX_PIXELS / (width * height))
        width, height = int(width * scale), int(height * scale)
    if width * height < MIN_PIXELS:
        scale = math.sqrt(MIN_PIXELS / (width * height))
        width, height = int(width * scale), int(height * scale)
    return width, height


PROFILE = MiniO3Profile()
