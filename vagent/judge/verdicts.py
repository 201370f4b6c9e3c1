"""Judge prompts (defaults; the recipe's config may replace them) and parsers of what judges answer.

Three modes:

* ``correct``: is the model's answer consistent with the gold answer? The judge ends with ``Judgement: 1`` or
  ``Judgement: 0``; score 1 or 0. The protocol of DeepEyes' accuracy judge (a Qwen2.5-72B behind vLLM; see
  Visual-Agent/DeepEyes ``verl/utils/reward_score/vl_agent.py``), in our own words and without its few-shot list.
* ``score``: a 0-10 grade against the gold answer, ``Score: N``; score N / 10.
* ``pairwise``: which of two answers is better, UnifiedReward-Think style: reasoning in ``<think>``, then
  ``<answer>Answer 1 is better</answer>`` or ``Answer 2 is better`` (its templates: CodeGoat24/Pref-GRPO
  ``fastvideo/rewards/templates.py``). Turned into per-sample win rates by ``vagent.rewards.pairwise_win_rates``.

Parsers never raise: an answer they cannot read gives ``score=None`` with ``error="unparseable"``, which the
reward turns into a neutral score and counts. They read the verdict from the ``<answer>`` block, else from what the
reply says after its ``</think>`` (all of it without a ``<think>``): a ``<think>`` never closed is reasoning cut
short, and has no verdict. (Judges trained on judgment rows are read strictly, by
``vagent.rewards.judgment.read_verdict``.)
"""

from __future__ import annotations

import base64
import io
import os
import re
from dataclasses import dataclass
from typing import Any

from PIL import Image

from vagent.media import MediaError, load_image
from vagent.types import Message

__all__ = ["MODES", "TEMPLATES", "Verdict", "chat_messages", "judge_messages", "parse_verdict"]

MODES = ("correct", "score", "pairwise")

TEMPLATES = {
    "correct": (
        "You compare a model's answer to a question with the standard answer and decide whether they agree.\n"
        "They agree when they mean the same thing, even if worded differently (e.g. 'pink' and 'it is pink'); "
        "extra correct detail is fine, a different or missing key fact is not.\n\n"
        "[Question]: {question}\n[Standard Answer]: {gold}\n[Model Answer]: {answer}\n\n"
        "Reply with one line: 'Judgement: 1' if they agree, 'Judgement: 0' if not."
    ),
    "score": (
        "Grade a model's answer to a question against the reference answer, from 0 (wrong or missing) to 10 "
        "(fully correct and complete). Judge correctness, not style.\n\n"
        "[Question]: {question}\n[Reference Answer]: {gold}\n[Model Answer]: {answer}\n\n"
        "Explain briefly, then end with one line 'Score: N' where N is an integer from 0 to 10."
    ),
    "pairwise": (
        "You are an objective judge of answers to a question about the given image(s). Compare Answer 1 and "
        "Answer 2 for correctness (against the reference answer when one is given), faithfulness to the image and "
        "helpfulness.\n\n[Question]: {question}\n[Reference Answer]: {gold}\n[Answer 1]: {answer1}\n"
        "[Answer 2]: {answer2}\n\nWrite your reasoning inside <think></think>, then the verdict inside "
        "<answer></answer>: exactly 'Answer 1 is better' or 'Answer 2 is better'."
    ),
}

_JUDGEMENT = re.compile(r"judge?ment\s*[:：]?\s*\**\s*([01])\b", re.IGNORECASE)
_SCORE = re.compile(r"score\s*[:：]?\s*\**\s*(\d+(?:\.\d+)?)\s*(?:/\s*10)?", re.IGNORECASE)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL | re.IGNORECASE)
_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.DOTALL | re.IGNORECASE)
_BETTER = re.compile(r"answer\s*([12])\s*is\s*(?:the\s*)?better", re.IGNORECASE)
_MAX_SIDE = 768  # px: judges see the image well enough, and a request stays small


@dataclass
class Verdict:
    """One judge call's outcome.

    Attributes:
        score: In [0, 1] (pointwise: correct = 1; pairwise: 1 = the first answer won, 0 = the second); None when
            the judge failed or its answer could not be read.
        reasoning: The judge's explanation (``<think>`` or the text before the verdict), for the viewer.
        raw: The judge's whole reply.
        error: None, ``unparseable``, or the client's failure (``timeout``, ``http 503: ...``).
    """

    score: float | None
    reasoning: str = ""
    raw: str = ""
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"score": self.score, "reasoning": self.reasoning, "raw": self.raw, "error": self.error}


def parse_verdict(text: str, mode: str) -> Verdict:
    """Read a judge's reply. Never raises.

    >>> parse_verdict("The colors match.\\nJudgement: 1", "correct").score
    1.0
    >>> parse_verdict("<think>2 misreads the sign</think><answer>Answer 1 is better</answer>", "pairwise").score
    1.0
    >>> parse_verdict("I cannot decide.", "score").error
    'unparseable'
    """
    if mode not in MODES:
        raise ValueError(f"unknown judge mode {mode!r}; known: {MODES}")
    text = text or ""
    think = _THINK.search(text)
    closes = list(re.finditer(r"</think>", text, re.I))  # on text itself: str.lower() can change its length
    said = text[closes[-1].end() :] if closes else "" if re.search(r"<think>", text, re.I) else text
    if mode == "pairwise":
        block = _ANSWER.search(text)
        verdicts = {m.group(1) for m in _BETTER.finditer(block.group(1) if block else said)}
        score = (1.0 if verdicts == {"1"} else 0.0) if len(verdicts) == 1 else None  # both or neither: unreadable
        reasoning = think.group(1).strip() if think else text[: block.start()].strip() if block else text.strip()
    elif mode == "correct":
        hits = _JUDGEMENT.findall(said)
        bare = said.strip().strip(".*").lower()
        words = {"1": 1.0, "0": 0.0, "correct": 1.0, "incorrect": 0.0, "yes": 1.0, "no": 0.0}
        score = float(hits[-1]) if hits else words.get(bare)
        reasoning = (think.group(1) if think else _JUDGEMENT.split(text)[0]).strip()
    else:
        hits = [float(h) for h in _SCORE.findall(said)]
        score = hits[-1] / 10 if hits and 0 <= hits[-1] <= 10 else None
        reasoning = (think.group(1) if think else _SCORE.split(text)[0]).strip()
    return Verdict(score, reasoning, text, None if score is not None else "unparseable")


def judge_messages(template: str, fields: dict[str, str], images: list[Any] | None = None,
                   urls: dict[Any, str] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The chat messages of one judge call: the template filled with ``fields`` (``{question}``, ``{gold}``,
    ``{answer}`` or ``{answer1}``/``{answer2}``), after the row's images as data URLs (for VLM judges).
    Images that cannot be read are left out (the text still goes). ``urls``: see ``chat_messages``."""
    content: list[dict[str, Any]] = []
    for image in images or []:
        try:
            content.append({"type": "image_url", "image_url": {"url": _image_url(image, urls, _MAX_SIDE)}})
        except MediaError:
            continue
    content.append({"type": "text", "text": template.format_map(_Fields(fields))})
    return [{"role": "user", "content": content}]


def chat_messages(messages: list[Message], urls: dict[Any, str] | None = None) -> list[dict[str, Any]]:
    """vagent messages as an OpenAI chat request's ``messages``: text parts as text, images (paths or PIL images) as
    PNG data URLs at full resolution, so a judge trained by vagent sees the pixels its training rows showed it
    (the server resizes them as training did). Used for judges trained on judgment rows, whose prompt is built
    by the rollout engine's ``prompt_messages``.

    Full resolution, not the view a vagent judge's pixel budget makes of it: the client does not know the server's
    budget, and a view made for another budget would be resized twice. Encoding is the cost (a 2000x1500 PNG takes
    0.7 s and 11.5 MiB as a data URL), so a batch of requests about the same images passes one ``urls`` dict
    (image path -> data URL): each image is encoded once and every request holds the same string.

    Raises:
        MediaError: an image that cannot be read (the request would not be the prompt the judge was trained on).
    """
    out = []
    for message in messages:
        content: list[dict[str, Any]] = []
        for part in message.content:
            if part.type == "text":
                content.append({"type": "text", "text": part.text or ""})
            elif part.type == "image":
                image = part.image if part.image is not None else part.path
                content.append({"type": "image_url", "image_url": {"url": _image_url(image, urls, None)}})
            else:
                raise MediaError(f"a {part.type} part cannot be sent to an OpenAI-compatible judge (images only)")
        if message.role == "system" and all(c["type"] == "text" for c in content):
            out.append({"role": "system", "content": "".join(c["text"] for c in content)})
        else:
            out.append({"role": message.role, "content": content})
    return out


class _Fields(dict):
    """Leaves unknown ``{names}`` in a user's template as they are instead of raising."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _image_url(image: Any, urls: dict[Any, str] | None, max_side: int | None) -> str:
    """The data URL of ``image`` (a path or a PIL image); a path's is made once per ``urls`` memo. (In-memory
    images are not memoized: an ``id`` can be reused once its image is freed.)"""
    if urls is None or not isinstance(image, (str, os.PathLike)):
        return _data_url(load_image(image), max_side)
    key = (os.fspath(image), max_side)
    if key not in urls:
        urls[key] = _data_url(load_image(image), max_side)
    return urls[key]


def _data_url(image: Image.Image, max_side: int | None = _MAX_SIDE) -> str:
    if max_side is not None:
        image = image.copy()
        image.thumbnail((max_side, max_side))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
