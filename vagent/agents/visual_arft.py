"""``visual-arft``: Visual-ARFT (Liuziyu77/Visual-RFT, ``Visual-ARFT/``), agentic search and coding with RFT.

Taken from the agent's own code (github.com/Liuziyu77/Visual-RFT):

* ``Visual-ARFT/evaluation_search/MAT-Search-Benchmark/evaluation_mat_search_ngpu_7b_visual_arft.py``: the search
  agent: one user message, the image then ``system_prompt + "\\n<query> {q} </query>"``; each step the model
  writes ``<think>`` and ``<search>`` or ``<answer>``; results are ``"<information> " + "1. Content:..." ... +
  " </information> "`` (the hits' bodies; 4 per search there).
* ``Visual-ARFT/evaluation_coding/evaluation_mat_coding_visual_arft.py``: the coding agent: ``system_prompt +
  "<query> {q} <query>"`` (sic); ``<problem> {...} </problem>`` gets a ``<tips> ... </tips>`` line back (crop /
  none / other problems); ``<code>`` holds a fenced python block that reads ``path_to_input_image.jpg`` and
  writes ``path_to_output_image.jpg``, and the output image **replaces** the input for the next step; at most 5
  steps; answers in ``<answer>``; questions give boxes on the 0-1000 grid.

How it runs here, and what differs: Visual-ARFT rebuilds **one user message** every step (the image, the prompt,
and the whole chain so far as text, the model's own outputs included), so each step's context is a new prompt,
not an extension of the last; one token sequence cannot hold that (token-in/token-out would break). vagent keeps
the model's steps as assistant turns and sends each result as a user turn (``<information> ... </information> ``,
the ``<tips>`` line, or the new image), the same text in a different role. The coding harness's rewrite of crop
slices from the question's 0-1000 box (``extract_coordinates`` + ``int(v / 1000 * size)``) is not done: the
profile sees no question when the code runs, so the model's own slice runs; ``geometry.norm1000_to_original`` is
the conversion a data converter uses for those boxes. Search variant when ``search`` is offered, else coding.

Mapping: ``<search>`` -> vagent ``search``; ``<code>`` -> vagent ``code`` on the newest image (its paths rewritten
to the sandbox's file names); ``<problem>`` -> no tool, the tips.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence

from PIL import Image

from vagent.agents.profile import AgentLimits, image_parts, run_tool
from vagent.chat import ParsedTurn, ParseError
from vagent.toolbox import ToolContext
from vagent.types import ContentPart, Message, Observation, ToolCall

__all__ = ["PROFILE", "VisualARFTProfile"]

SEARCH_PROMPT = (
    "# Role  \n"
    "You are a step-by-step multimodal reasoning assistant.  \n"
    "Given an image, a question, and optional partial reasoning chain, your task is to solve the problem "
    "**one substep at a time**.  \n"
    "\n"
    "# Guiding Principles  \n"
    "At each turn, you must **either**:  \n"
    "1. Issue **one specific, text-only search** enclosed in <search> </search> tags,  \n"
    "2. Or provide the **final answer** enclosed in <answer> </answer> tags.  \n"
    "\n"
    "All outputs **must begin with a thought** enclosed in <think> </think> tags, explaining your "
    "current reasoning and what to do next.  \n"
    "\n"
    "- Do not reference “the image” in your searches.  \n"
    "- Do not repeat past queries.  \n"
    "- Only output **one action per step**: either <search> or <answer>, never both.  \n"
    "- When ready to conclude, summarize reasoning and give a final answer.\n"
    "\n"
    "# Output Format (strict):  \n"
    "Always start with <think>. Do not output the previous reasoning chain. Then, depending on the case, "
    "output one of the following:\n"
    "\n"
    "## 1. If reasoning continues:  \n"
    "<think> Your current reasoning and next plan </think>  \n"
    "<search> One precise, retrievable textual query </search>\n"
    "\n"
    "## 2. If ready to conclude:  \n"
    "<think> Summarize all reasoning and derive the answer </think>  \n"
    "<answer> Final answer, as briefly as possible </answer>\n"
    "\n"
    "# Current reasoning chain:\n"
)
CODING_PROMPT = (
    "# Role\n"
    "You are a step-by-step image processing assistant.\n"
    "Your task is to solve an image-based task by applying OpenCV operations one step at a time, "
    "optionally using a reasoning chain.\n"
    "\n"
    "# Output Format\n"
    "At each step, output **only one** of the following, preceded by a <think> tag:\n"
    "1. <problem> Describe the image issue from {'rotation90', 'rotation180', 'dark', 'overexposure', "
    "'blur', 'noise', 'crop', 'none'} </problem>\n"
    "2. <code> OpenCV code to process and save the image </code>\n"
    "3. <answer> Final answer based on the processed image </answer>\n"
    "\n"
    "# Image Processing Rules\n"
    "- Always read from `'path_to_input_image.jpg'` and write to `'path_to_output_image.jpg'`.\n"
    "\n"
    "# Output Format (strict):\n"
    "Always begin with <think>. Then, depending on current reasoning chain, output one of the following:\n"
    "\n"
    "## 1. If this is the first step and only the query is given, output in the following format:\n"
    "<think> Initial analysis of the image issue. </think>\n"
    "<problem> {'problem1', ...} </problem>\n"
    "\n"
    "## 2. If <problem> is given, continue with image operations:\n"
    "<think> Explain what to fix next. </think>\n"
    "<code>\n"
    "```python\n"
    "One Python code block using OpenCV to perform the operation, and save the processed images.\n"
    "```\n"
    "</code>\n"
    "\n"
    "## 3. If ready to conclude:\n"
    "<think> Summarize the processing steps and provide the result or outcome </think> \n"
    "<answer> Final answer, as briefly as possible</answer>\n"
    "\n"
    "# Current reasoning chain:\n"
)
TIPS_CROP = ("<tips> We now need to crop the image. Please provide the Python code. Use [x_min, y_min, x_max, y_max] "
             "to represent the bounding box coordinates. </tips>")  # fmt: skip
TIPS_NONE = "<tips> The image has no issues, so no code is needed in the next step. You can directly provide the answer. </tips>"
TIPS_OTHER = ("<tips> Now that we have identified the issue in the image: {problems}, please proceed to address it by "
              "outputting the python code. </tips>")  # fmt: skip
OUTPUT = "output.png"

_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_SEARCH = re.compile(r"<search>\s*(.*?)\s*</search>", re.DOTALL)
_CODE = re.compile(r"<code>\s*```python(.*?)```.*?</code>", re.DOTALL)
_PROBLEM = re.compile(r"<problem>\s*\{(.*?)\}\s*</problem>", re.DOTALL)


class VisualARFTProfile:
    """Visual-ARFT's protocol, with each step's result as a user turn (see the module docstring)."""

    name = "visual-arft"
    stop_strings: tuple[str, ...] = ()
    inline = False
    limits = AgentLimits(max_turns=5)  # `for _ in range(5): # max iteration number`
    tools = ("search", "code")

    def prompt(self, question: str, images: Sequence[Image.Image | str], videos: Sequence[str],
               tools: Sequence[str], frames: int | None = None) -> list[Message]:  # fmt: skip
        text = (f"{SEARCH_PROMPT}\n<query> {question} </query>" if "search" in tools
                else f"{CODING_PROMPT}<query> {question} <query>")  # fmt: skip
        return [Message("user", [*image_parts(images), ContentPart("text", text)])]

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        if "<answer>" in text:
            found = _ANSWER.search(text)
            turn.answer = found.group(1).strip() if found else ""
            return turn
        if "<problem>" in text:
            found = _PROBLEM.search(text)
            problems = sorted(re.findall(r"'([^']+)'", found.group(1))) if found else []
            action = ToolCall("problem", {"problems": problems}, text) if problems else ParseError(
                "bad_call", "<problem> must list the issues as {'name', ...}")  # fmt: skip
        elif "<code>" in text:
            found = _CODE.search(text)
            action = ToolCall("code", {"code": found.group(1)}, found.group(1)) if found else ParseError(
                "bad_call", "Code is not extracted successfully")  # fmt: skip
        elif "<search>" in text:
            found = _SEARCH.search(text)
            action = ToolCall("search", {"query": found.group(1)}, found.group(1)) if found else ParseError(
                "unclosed_tag", "<search> was not closed")  # fmt: skip
        else:
            return turn
        turn.actions = [action]
        turn.tool_calls = [action] if isinstance(action, ToolCall) else []
        turn.errors = [action] if isinstance(action, ParseError) else []
        return turn

    def tool_for(self, call: ToolCall) -> str | None:
        return {"search": "search", "code": "code"}.get(call.name)

    def act(self, parsed: ParsedTurn, context: ToolContext, offered: Sequence[str]) -> list[Observation]:
        return [self._act_one(action, context) for action in parsed.actions]

    def _act_one(self, action: ToolCall | ParseError, context: ToolContext) -> Observation:
        if isinstance(action, ParseError):
            return Observation(text=action.message, error=action.kind)
        if action.name == "problem":
            problems = action.arguments["problems"]
            tips = TIPS_CROP if problems[0] == "crop" else TIPS_NONE if problems[0] == "none" else TIPS_OTHER
            return Observation(text=tips.format(problems=problems))
        if action.name == "search":
            result = run_tool("search", {"query": action.arguments["query"]}, context)
            if not result.ok:
                return Observation(text=result.text, error=result.error)
            hits = result.metadata.get("results", [])
            body = "".join(f"{i + 1}. Content:{h['snippet']}" for i, h in enumerate(hits))
            return Observation(text=f"<information> {body} </information> ", metadata=result.metadata)
        newest = len(context.images) - 1
        code = action.arguments["code"].replace("path_to_input_image.jpg", f"image_{newest}.png")
        code = code.replace("path_to_output_image.jpg", OUTPUT)
        try:
            ast.parse(code)
        except SyntaxError as e:
            return Observation(text=f"Code Error {e}", error="code_error")
        result = run_tool("code", {"code": code}, context)
        if not result.ok or not result.images:  # `flage` False: the chain goes on with the old image
            return Observation(text=result.text, error=result.error or "no_image", metadata=result.metadata)
        return Observation(text="", images=result.images[-1:], metadata=result.metadata)

    def observation_message(self, observation: Observation) -> Message:
        parts = image_parts(observation.images)
        return Message(
            "user", [*parts, ContentPart("text", observation.text)] if observation.text or not parts else parts
        )

    def prefill(self, turn: int) -> str:
        return ""

    def forced_spans(self, text: str, turn: int) -> list[tuple[int, int]]:
        return []


PROFILE = VisualARFTProfile()
