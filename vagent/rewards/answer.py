"""Answer scoring: exact match, multiple choice, numbers with tolerance, token F1 / EM over several golds.

Pure string functions (no model, no I/O). ``answer_score`` dispatches on the canonical row's
``answer_type``; ``f1`` answers use the MAT-Search/MAT-Coding metric of Visual-ARFT: token F1 and EM,
each the max over the gold answers, with F1 counted as 1 when EM hits. Chinese (CJK) text is compared
character by character, as that metric does.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any

from vagent.geometry import iou, span_iou

__all__ = [
    "answer_score",
    "choice_match",
    "exact_match",
    "f1_em",
    "gold_answers",
    "normalize_answer",
    "number_match",
    "parse_box",
    "parse_span",
    "token_f1",
    "tokens",
]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation) | set("，。！？；：、“”‘’（）《》【】")
_CJK = re.compile(r"([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff])")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and English articles, collapse whitespace (SQuAD style).

    >>> normalize_answer("The  Eiffel Tower!")
    'eiffel tower'
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def tokens(text: str) -> list[str]:
    """Normalized tokens; every CJK character is a token of its own.

    >>> tokens("北京 is the capital")
    ['北', '京', 'is', 'capital']
    """
    return _CJK.sub(r" \1 ", normalize_answer(text)).split()


def token_f1(prediction: str, gold: str) -> float:
    """Token-overlap F1 of two strings.

    >>> round(token_f1("the red car", "a red sports car"), 4)  # 2 common of 2 predicted, 3 gold
    0.8
    """
    pred, ref = tokens(prediction), tokens(gold)
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or not common:
        return float(pred == ref)
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 when the normalized prediction equals any normalized gold."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def f1_em(prediction: str, golds: Sequence[str]) -> tuple[float, float]:
    """(F1, EM), each the max over ``golds``; F1 is 1 when EM is.

    >>> f1_em("Paris", ["paris, france", "Paris"])
    (1.0, 1.0)
    """
    em = exact_match(prediction, golds)
    f1 = max((token_f1(prediction, g) for g in golds), default=0.0)
    return (1.0 if em else f1), em


def choice_match(prediction: str, gold: str, choices: Sequence[str]) -> float:
    """1.0 when the prediction picks the gold option. Both may be a letter ("B", "(b)", "B. blue") or the
    option's text; a prediction naming several letters picks none.

    >>> choice_match("(B) blue", "B", ["red", "blue"]), choice_match("blue", "B", ["red", "blue"])
    (1.0, 1.0)
    """

    def letter(text: str) -> str | None:
        text = text.strip()
        match = re.fullmatch(r"\(?([A-Za-z])\)?(?:[.:)]\s*.*)?", text, flags=re.S)
        if match and ord(match.group(1).upper()) - ord("A") < len(choices):
            return match.group(1).upper()
        for i, choice in enumerate(choices):
            if normalize_answer(text) == normalize_answer(choice):
                return chr(ord("A") + i)
        return None

    picked, wanted = letter(prediction), letter(gold)
    return float(picked is not None and picked == wanted)


def number_match(prediction: str, gold: float, rel_tol: float = 0.01, abs_tol: float = 1e-6) -> float:
    """1.0 when the first number in the prediction is within tolerance of ``gold``.

    >>> number_match("about 1,204 people", 1200), number_match("12", 1200)
    (1.0, 0.0)
    """
    match = _NUMBER.search(prediction)
    if not match:
        return 0.0
    value = float(match.group().replace(",", ""))
    return float(abs(value - gold) <= max(abs_tol, rel_tol * abs(gold)))


def parse_box(text: str) -> list[float] | None:
    """The first ``[x1, y1, x2, y2]`` (four numbers) in ``text``, or None.

    >>> parse_box("the box is [10, 20.5, 30, 40].")
    [10.0, 20.5, 30.0, 40.0]
    """
    numbers = [float(n.replace(",", "")) for n in _NUMBER.findall(text)]
    return numbers[:4] if len(numbers) >= 4 else None


def parse_span(text: str) -> list[float] | None:
    """The first two numbers of ``text`` as a ``[t0, t1]`` span in seconds, or None."""
    numbers = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", text)]
    return numbers[:2] if len(numbers) >= 2 else None


def gold_answers(answer: Any, answer_type: str) -> list[Any]:
    """The accepted answers of a row: an ``exact``/``f1`` answer may list several; any other answer is one
    (a box or a span is a list of numbers, not a list of answers).

    >>> gold_answers(["Paris", "paris, France"], "f1"), gold_answers([1.0, 2.5], "span")
    (['Paris', 'paris, France'], [[1.0, 2.5]])
    """
    return list(answer) if isinstance(answer, list) and answer_type in ("exact", "f1") else [answer]


def answer_score(prediction: str | None, answer: Any, answer_type: str, choices: Sequence[str] | None = None,
                 box_in_original: list[float] | None = None, rel_tol: float = 0.01) -> float:  # fmt: skip
    """Score one prediction against a canonical row's answer, in [0, 1].

    ``exact``: EM over the gold strings; ``choice``: the option picked; ``number``: within ``rel_tol``;
    ``f1``: token F1 (max over golds, 1 on EM); ``box``: IoU of ``box_in_original`` (the predicted box
    already mapped to original pixels by the caller) with the gold box; ``span``: temporal IoU.
    """
    if prediction is None:
        return 0.0
    golds = gold_answers(answer, answer_type)
    if answer_type == "exact":
        return exact_match(prediction, [str(g) for g in golds])
    if answer_type == "f1":
        return f1_em(prediction, [str(g) for g in golds])[0]
    if answer_type == "choice":
        return choice_match(prediction, str(answer), choices or [])
    if answer_type == "number":
        return number_match(prediction, float(answer), rel_tol=rel_tol)
    if answer_type == "box":
        return iou(box_in_original, answer) if box_in_original is not None else 0.0
    if answer_type == "span":
        span = parse_span(prediction)
        return span_iou(span, answer) if span is not None and span[1] > span[0] else 0.0
    raise ValueError(f"unknown answer_type {answer_type!r}")
