"""``tool-star``: Tool-Star (dongguanting/Tool-Star), multi-tool reasoning with results inside the assistant turn.

Taken from the agent's own code (github.com/dongguanting/Tool-Star):

* ``Tool_Star_RL/src/verl/verl/utils/dataset/template.py``: the system prompt ``re_search_template_sys``
  (``<search>``, ``<python>``, ``<result>``, ``<answer>`` with ``\\boxed{}``); the user turn is the question
  (``rl_dataset.py``: system + user through the chat template).
* ``Tool_Star_RL/src/verl/verl/workers/rollout/vllm_rollout/vllm_rollout.py``: generation stops at ``</search>`` or
  ``</python>``; the query/code is the last such block of that piece of the turn; its result is appended
  **inside the same assistant turn** as the tokens of ``" <result>\\n{result}\\n</result>"`` (loss mask 0) and
  generation continues; at most 3 calls (the next one ends the turn); python's result is its stdout, or the
  executor's report when stdout is empty (``batch_python``).
* ``evaluation/evaluate/scripts/evaluate.py``: the answer is the last ``\\boxed{}``.

Mapping: ``<search>`` -> vagent ``search``; ``<python>`` -> vagent ``code``. Unverified: the exact text of a search
result depends on Tool-Star's retriever (local: the hits' ``contents`` joined by blank lines; web: summarised
snippets); vagent writes each hit as ``title`` then ``snippet``, joined by blank lines. The executor's report on
success (empty stdout) is written as ``Done``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from PIL import Image

from vagent.agents.profile import AgentLimits, image_parts, last_boxed, run_tool, tag_spans
from vagent.chat import ParsedTurn, ParseError
from vagent.toolbox import ToolContext
from vagent.types import ContentPart, Message, Observation, ToolCall

__all__ = ["PROFILE", "ToolStarProfile"]

SYSTEM_PROMPT = (
    "You are a helpful assistant that can solve the given question step by step with the help of the wikipedia "
    "search tool and python interpreter tool. Given a question, you need to first think about the reasoning process "
    "in the mind and then provide the answer. During thinking, you can invoke the wikipedia search tool to search "
    "and python interpreter tool to calculate the math problem for fact information about specific topics if "
    "needed. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags "
    "respectively, and the search query and result are enclosed within <search> </search> and <result> </result> "
    "tags respectively. For example, <think> This is the reasoning process. </think> <search> search query here "
    "</search> <result> search result here </result> <think> This is the reasoning process. </think> <python> "
    "python code here </python> <result> python interpreter result here </result> <think> This is the reasoning "
    "process. </think> <answer> The final answer is \\[ \\boxed{answer here} \\] </answer>. In the last part of the "
    "answer, the final exact answer is enclosed within \\boxed{} with latex format."
)
RESULT = " <result>\n{result}\n</result>"
MAX_CALLS = 3

_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)
_NATIVE = {"search": "search", "python": "code"}


class ToolStarProfile:
    """Tool-Star's protocol (see the module docstring)."""

    name = "tool-star"
    stop_strings = ("</search>", "</python>")
    inline = True
    limits = AgentLimits(max_turns=MAX_CALLS + 1, max_calls=MAX_CALLS)
    tools = ("search", "code")

    def prompt(self, question: str, images: Sequence[Image.Image | str], videos: Sequence[str],
               tools: Sequence[str], frames: int | None = None) -> list[Message]:  # fmt: skip
        return [
            Message.text("system", SYSTEM_PROMPT),
            Message("user", [*image_parts(images), ContentPart("text", question)]),
        ]

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        stripped = text.rstrip()
        for tag in ("search", "python"):
            if stripped.endswith(f"</{tag}>"):  # the stop string this piece of the turn ended at
                end = stripped.rindex(f"</{tag}>")
                start = stripped.rfind(f"<{tag}>", 0, end)
                if start < 0:
                    turn.actions = [ParseError("unclosed_tag", f"</{tag}> has no <{tag}>")]
                    turn.errors = list(turn.actions)
                    return turn
                body = stripped[start + len(tag) + 2 : end].strip()
                call = ToolCall(tag, {"query" if tag == "search" else "code": body}, body)
                turn.actions, turn.tool_calls = [call], [call]
                return turn
        answers = _ANSWER.findall(text)
        turn.answer = last_boxed(answers[-1]) if answers else last_boxed(text)
        if answers and turn.answer is None:
            turn.answer = answers[-1].strip()
        return turn

    def tool_for(self, call: ToolCall) -> str | None:
        return _NATIVE.get(call.name)

    def act(self, parsed: ParsedTurn, context: ToolContext, offered: Sequence[str]) -> list[Observation]:
        out = []
        for action in parsed.actions:
            if isinstance(action, ParseError):
                out.append(Observation(text=RESULT.format(result=action.message), error=action.kind))
            elif action.name == "search":
                if not action.arguments["query"]:
                    out.append(Observation(text=RESULT.format(result="invalid query"), error="bad_arguments"))
                    continue
                result = run_tool("search", {"query": action.arguments["query"]}, context)
                hits = result.metadata.get("results", [])
                text = "\n\n".join(f"{h['title']}\n{h['snippet']}" for h in hits).strip() if result.ok else result.text
                out.append(Observation(text=RESULT.format(result=text), error=result.error, metadata=result.metadata))
            else:
                result = run_tool("code", {"code": action.arguments["code"]}, context)
                stdout, stderr = result.metadata.get("stdout", ""), result.metadata.get("stderr", "")
                report = stderr.strip().splitlines()[-1] if result.error and stderr.strip() else result.text
                text = stdout.strip() or (report if result.error else "Done")
                out.append(Observation(text=RESULT.format(result=text), error=result.error, metadata=result.metadata))
        return out

    def observation_message(self, observation: Observation) -> Message:
        """Inline text: the engine appends its tokens to the open assistant turn."""
        return Message.text("assistant", observation.text)

    def prefill(self, turn: int) -> str:
        return ""

    def forced_spans(self, text: str, turn: int) -> list[tuple[int, int]]:
        return [
            (max(0, a - 1) if text[a - 1 : a] == " " else a, b) for a, b in tag_spans(text, "<result>", "</result>")
        ]


PROFILE = ToolStarProfile()
