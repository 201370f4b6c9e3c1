"""Judgment rows: a canonical row whose question asks a judge to compare two candidates (pairwise) or grade one
(pointwise), and whose answer is the verdict. UnifiedReward-Think trains its CoT judge on such rows.

    {"id": "j7", "images": ["img/j7.png"], "question": "<the judge's prompt, rendered from the judgment>",
     "answer": "Answer 1 is better", "answer_type": "exact", "tools": [],
     "judgment": {"kind": "pairwise", "candidates": "answers", "question": "What digit is on the tile?",
                  "responses": ["It shows 3.", "It shows 7."], "reference": "3", "preferred": 1}}

The row is an ordinary canonical row: its ``question`` is the judge's prompt, its ``answer`` the verdict
(``exact`` for a pairwise verdict such as ``Answer 1 is better``, ``number`` for a pointwise score), so SFT,
distillation and GRPO read it like any other row. The ``judgment`` object keeps what was judged, so the label is
read from a field (the ``judgment`` reward), the pair can be shown the other way round (``swapped``, position bias
in ``vagent eval --benchmark judge-pairs``), and the same prompt can be rendered for a policy's answers
(``render``: the one template function shared by the training rows and the ``judge`` reward's requests).

Candidates are text ``answers`` (``responses``) or the row's ``images`` in order (two images generated for one
prompt; ``question`` is then the generation prompt). ``question`` may be null for a row whose prompt was kept
as a converter found it and could not be read back into fields: such a row trains and is scored like any other,
but cannot be re-rendered or swapped.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from vagent.data.rows import Row

__all__ = [
    "CANDIDATES",
    "KINDS",
    "TEMPLATES",
    "Judgment",
    "default_template",
    "parse_judgment",
    "render",
    "swapped",
    "swapped_row",
    "verdict_text",
]

KINDS = ("pairwise", "pointwise")
CANDIDATES = ("answers", "images")
_NOUN = {"answers": "Answer", "images": "Image"}
DEFAULT_SCALE = (1.0, 10.0)

# The default prompts. Short on purpose: a judge learns the task from its training rows, and every token here is
# read for every judgment. Placeholders: {question}, {response1}, {response2} (pointwise: {response1}),
# {reference} and {reference_line} (empty without a reference), {low}, {high}.
_FORMAT = "Reason inside <think></think>, then give the verdict inside <answer></answer>: exactly "
TEMPLATES: dict[tuple[str, str], str] = {
    ("pairwise", "answers"): (
        "Which answer to the question about the image is better? Compare Answer 1 and Answer 2 for correctness "
        f"and faithfulness to the image. {_FORMAT}'Answer 1 is better' or 'Answer 2 is better'.\n"
        "Question: {question}\n{reference_line}Answer 1: {response1}\nAnswer 2: {response2}"
    ),
    ("pairwise", "images"): (
        "Which of the two images better matches the prompt? Compare Image 1 and Image 2 for faithfulness to the "
        f"prompt and visual quality. {_FORMAT}'Image 1 is better' or 'Image 2 is better'.\nPrompt: {{question}}"
    ),
    ("pointwise", "answers"): (
        "Rate the answer to the question about the image from {low} to {high} ({high}: correct, faithful to the "
        "image and helpful). Reason inside <think></think>, then give only the score inside <answer></answer>.\n"
        "Question: {question}\n{reference_line}Answer: {response1}"
    ),
    ("pointwise", "images"): (
        "Rate how well the image matches the prompt from {low} to {high} ({high}: faithful and of high quality). "
        "Reason inside <think></think>, then give only the score inside <answer></answer>.\nPrompt: {question}"
    ),
}
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass
class Judgment:
    """What a judgment row judges, and its label.

    Attributes:
        kind: ``pairwise`` (which of two is better) or ``pointwise`` (a score).
        candidates: ``answers`` (text ``responses``) or ``images`` (the row's images, in order).
        question: The judged question (answers) or generation prompt (images); None when the row's prompt was
            kept as found and could not be read back into fields.
        responses: The candidate answers: two for pairwise, one for pointwise; empty for image candidates.
        reference: A reference answer shown to the judge, or None.
        preferred: Pairwise label: 1 or 2 (None where unknown, e.g. a policy's answers to be judged).
        score: Pointwise label, within ``scale``.
        scale: Pointwise ``(low, high)``.
        template: The prompt template the row was rendered with; None = ``TEMPLATES[kind, candidates]``.
    """

    kind: Literal["pairwise", "pointwise"]
    candidates: Literal["answers", "images"] = "answers"
    question: str | None = None
    responses: list[str] = field(default_factory=list)
    reference: str | None = None
    preferred: int | None = None
    score: float | None = None
    scale: tuple[float, float] = DEFAULT_SCALE
    template: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (optional fields only when set)."""
        out: dict[str, Any] = {"kind": self.kind, "candidates": self.candidates, "question": self.question}
        if self.responses:
            out["responses"] = list(self.responses)
        for name in ("reference", "preferred", "score", "template"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.kind == "pointwise":
            out["scale"] = list(self.scale)
        return out


def default_template(kind: str, candidates: str) -> str:
    """The prompt template vagent renders a judgment with when the row names none."""
    return TEMPLATES[kind, candidates]


def render(judgment: Judgment) -> str:
    """The judge's prompt for ``judgment``: its template with the fields filled in. Only the known ``{names}`` are
    replaced, so other braces in a template (a JSON example) stay as written.

    >>> render(Judgment("pairwise", question="What digit?", responses=["3", "7"], reference="3")).splitlines()[1:]
    ['Question: What digit?', 'Reference answer: 3', 'Answer 1: 3', 'Answer 2: 7']

    Raises:
        ValueError: the judgment has no ``question`` (its prompt cannot be rebuilt).
    """
    if judgment.question is None:
        raise ValueError("this judgment keeps its prompt as written (no 'question'): it cannot be re-rendered")
    responses = [*judgment.responses, "", ""]
    low, high = (_number_text(v) for v in judgment.scale)
    fields = {
        "question": judgment.question,
        "response1": responses[0],
        "response2": responses[1],
        "reference": judgment.reference if judgment.reference is not None else "(none given)",
        "reference_line": f"Reference answer: {judgment.reference}\n" if judgment.reference is not None else "",
        "low": low,
        "high": high,
    }
    template = judgment.template or default_template(judgment.kind, judgment.candidates)
    return _PLACEHOLDER.sub(lambda m: fields.get(m.group(1), m.group(0)), template)


def verdict_text(judgment: Judgment) -> str | float:
    """The label as the judge writes it inside ``<answer>``: ``Answer 2 is better`` / ``Image 1 is better``, or the
    score (a number) of a pointwise judgment.

    >>> verdict_text(Judgment("pairwise", "images", question="a red cat", preferred=2))
    'Image 2 is better'
    """
    if judgment.kind == "pointwise":
        if judgment.score is None:
            raise ValueError("a pointwise judgment needs a score")
        return judgment.score
    if judgment.preferred not in (1, 2):
        raise ValueError(f"a pairwise judgment needs preferred 1 or 2, got {judgment.preferred!r}")
    return f"{_NOUN[judgment.candidates]} {judgment.preferred} is better"


def swapped(judgment: Judgment) -> Judgment:
    """The same pairwise judgment with its candidates in the other order (the label follows the candidate). For
    image candidates the caller swaps the row's two images."""
    if judgment.kind != "pairwise":
        raise ValueError("only a pairwise judgment can be swapped")
    return replace(judgment, responses=list(reversed(judgment.responses)),
                   preferred=None if judgment.preferred is None else 3 - judgment.preferred)  # fmt: skip


def swapped_row(row: Row) -> Row | None:
    """A pairwise judgment row with its candidates in the other order: the images reversed (image candidates) or the
    prompt re-rendered with the answers reversed, the answer the verdict that follows the labelled candidate, and no
    gold ``messages`` (a chain of thought names positions). None when it cannot be swapped: a prompt kept as
    written (no ``question``) with text candidates."""
    judgment = row.judgment
    if judgment is None or judgment.kind != "pairwise":
        raise ValueError(f"row {row.id!r} is not a pairwise judgment row")
    other = swapped(judgment)
    if judgment.candidates == "images":
        question, images = row.question, list(reversed(row.images))
    elif judgment.question is not None:
        question, images = render(other), list(row.images)
    else:
        return None
    return dataclasses.replace(row, question=question, images=images, answer=verdict_text(other), judgment=other,
                               messages=None)  # fmt: skip


def parse_judgment(value: Any, *, question: str, answer: Any, answer_type: str, n_images: int) -> Judgment:
    """Check a row's ``judgment`` object against the row and build it.

    Checked: the kind and candidates, the label (``preferred`` 1/2; a finite ``score`` inside ``scale``), the
    number of candidates (two responses or two images for pairwise, one for pointwise), that the row's answer is
    the label as the judge writes it (``answer_type`` ``exact`` / ``number``), and, where the judgment has a
    ``question``, that the row's question is its rendered prompt (a pipeline that edits one and not the other
    fails here).

    Raises:
        ValueError: ``field 'judgment.<name>' ...`` (``rows.load_rows`` adds the file, line and row id).
    """
    if not isinstance(value, dict):
        raise _bad("", f"must be an object {{kind, candidates, question, ...}}, got {value!r}")
    unknown = sorted(set(value) - {"kind", "candidates", "question", "responses", "reference", "preferred", "score",
                                   "scale", "template"})  # fmt: skip
    if unknown:
        raise _bad("", f"has unknown key(s) {unknown}")
    kind, candidates = value.get("kind"), value.get("candidates", "answers")
    if kind not in KINDS:
        raise _bad(".kind", f"must be one of {list(KINDS)}, got {kind!r}")
    if candidates not in CANDIDATES:
        raise _bad(".candidates", f"must be one of {list(CANDIDATES)}, got {candidates!r}")
    for name in ("question", "reference", "template"):
        if value.get(name) is not None and not isinstance(value[name], str):
            raise _bad(f".{name}", f"must be a string or null, got {value[name]!r}")
    responses = value.get("responses") or []
    if not isinstance(responses, list) or not all(isinstance(r, str) for r in responses):
        raise _bad(".responses", f"must be a list of strings, got {responses!r}")
    scale = value.get("scale", list(DEFAULT_SCALE))
    if not (isinstance(scale, list) and len(scale) == 2 and all(_finite(v) for v in scale) and scale[0] < scale[1]):
        raise _bad(".scale", f"must be [low, high] with low < high, got {scale!r}")
    judgment = Judgment(kind, candidates, value.get("question"), list(responses), value.get("reference"),
                        value.get("preferred"), value.get("score"), (float(scale[0]), float(scale[1])),
                        value.get("template"))  # fmt: skip
    wanted = 2 if kind == "pairwise" else 1
    if candidates == "answers" and judgment.question is not None and len(responses) != wanted:
        raise _bad(".responses", f"must hold {wanted} answer(s) for a {kind} judgment, got {len(responses)}")
    if candidates == "images" and n_images != wanted:
        raise _bad(".candidates", f"is images: the row needs exactly {wanted} image(s) in 'images', got {n_images}")
    if kind == "pairwise":
        if judgment.preferred not in (1, 2) or isinstance(judgment.preferred, bool):
            raise _bad(".preferred", f"must be 1 or 2, got {judgment.preferred!r}")
        if answer_type != "exact" or answer != verdict_text(judgment):
            raise _bad("", f"needs the row's answer to be its verdict {verdict_text(judgment)!r} (answer_type "
                           f"'exact'), got {answer!r} ({answer_type!r})")  # fmt: skip
    else:
        low, high = judgment.scale
        if not _finite(judgment.score) or not low <= judgment.score <= high:
            raise _bad(".score", f"must be a number in [{low:g}, {high:g}], got {judgment.score!r}")
        if answer_type != "number" or answer != judgment.score:
            raise _bad("", f"needs the row's answer to be its score {judgment.score!r} (answer_type 'number'), "
                           f"got {answer!r} ({answer_type!r})")  # fmt: skip
    if judgment.question is not None and question != render(judgment):
        raise _bad(
            "",
            "does not match the row's question: the question must be the judgment rendered by its template "
            "(vagent.data.judgment.render)",
        )
    return judgment


def _bad(sub: str, message: str) -> ValueError:
    return ValueError(f"field 'judgment{sub}' {message}")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _number_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
