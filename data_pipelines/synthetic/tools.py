"""Tool-choice tasks in the format of MAT (Visual-ARFT's Multimodal Agentic Tool bench): every row offers ``search``,
``code`` and ``crop``, and which one helps, if any, depends on the question. Made to be learnable by the quickstart's
tiny random-weight Qwen2.5-VL trained from scratch: small closed sets, no text to read in images, and every answer
read from an observation (or the image) rather than computed in the model's head.

    python -m data_pipelines.synthetic.tools --out data/tools --rows 400 --test-rows 100 --seed 0

Four kinds of rows (``shares`` sets the mix; ``extra["kind"]`` says which):

* **search**: the image shows one entity of a closed set, a large shape of one of ``COLORS`` x ``SHAPES`` (16),
  and the question asks one of its ``PROPERTIES`` ("What is the home city of the object in the image?"). Only the
  corpus states it. Gold: name the entity, ``search`` for "<entity> <property>" (the real BM25 hits over
  ``write_corpus``'s corpus, one hit), then the value that ends it. Values are one of ``VALUES``' 8 made-up words:
  the model reads which one the hit states, as it reads a color off an image; it does not learn to copy an arbitrary
  string at this scale (``docs/decisions/tool-choice-task.md``).
* **code**: exact arithmetic on two-digit numbers, asked as an expression ("What is 47*38?", or a sum of three).
  Gold: a ``code`` call whose program copies the question's expression (``print(47*38)``), the real sandboxed output,
  then the printed number copied into the answer. The row shows an entity picture all the same, as every non-crop row
  does: whether there is an image never tells which tool to use; the question does.
* **crop**: ``zoom.zoom_rows``' stripes tile (the quickstart's crop proof; its defaults in ``CROP``): the gold crop,
  then the direction read off the crop.
* **direct**: the search rows' entity images asked what is visible (color, shape or both). Gold: the answer, no tool.

Why the no-tool baseline cannot answer search and code rows: a code row's numbers are drawn per row, and an exact
product of two two-digit numbers or a sum of three is beyond a tiny model's head. Search values are drawn per
``corpus_seed`` (the world: the corpus and every value in it), spread evenly over ``VALUES`` within each split's
pairs, so no fact can be known in advance: one word guessed scores 1/8 of F1, and the best blind answer, all 8
words listed, 2/9 (F1's precision is 1/8, its recall 1). But one corpus serves every split, and a model could
memorize from training answers which value goes with which entity and property. So each entity keeps two properties
out of training (``split_of``): one that only ``split="test"`` rows ask, one that only ``split="val"`` rows ask
(a run's model selection then never sees a test fact), and ``split="train"`` rows ask the other two. No training
answer tells a test row's value, as each pair's value is drawn independently; what a tool policy needs there was all
trained: it has named that entity (direct rows, other properties), searched that property (other entities), and read
the value off the hit. ``query_rows`` add each pair's search call alone (no hit, no value), held-out pairs included.

Answers are lists of strings with ``answer_type="f1"``: MAT's token F1 / EM, max over the golds, as Visual-ARFT's
evaluation code scores them (``vagent.eval.benchmarks.mat_search``, ``mat_coding``). Every tool turn is the real
tool's output (``gold.tool_turn``), as the rollout engine would show it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from pathlib import Path

from PIL import Image, ImageDraw

from data_pipelines.gold import call_text, tool_turn
from data_pipelines.synthetic.zoom import zoom_rows
from vagent.data import Row, write_rows
from vagent.geometry import Convention
from vagent.toolbox import ToolContext
from vagent.toolbox.search import BM25Backend

__all__ = [
    "CODE_THINK",
    "COLORS",
    "CROP",
    "ENTITIES",
    "KINDS",
    "PROPERTIES",
    "SHAPES",
    "SPLITS",
    "TOOLS",
    "VALUES",
    "arithmetic",
    "code_turns",
    "draw_entity",
    "output_think",
    "query_rows",
    "search_think",
    "split_of",
    "tool_rows",
    "value_think",
    "world",
    "write_corpus",
]

TOOLS = ["search", "code", "crop"]  # offered on every row: the policy chooses
KINDS = ("search", "code", "crop", "direct")  # the order of ``shares``
COLORS = {"red": (210, 40, 40), "green": (30, 150, 50), "blue": (40, 70, 210), "yellow": (225, 185, 20)}
# Outlines that differ at the tiny model's coarse view (16x16 patches of a 224-px image), all filled but the ring. No
# square or diamond: trained from scratch, the model kept taking both for a circle (docs/decisions/tool-choice-task.md).
SHAPES = ("circle", "triangle", "cross", "ring")
ENTITIES = [f"{color} {shape}" for color in COLORS for shape in SHAPES]
# What the corpus states about each entity; the question names one, and the gold query copies it.
PROPERTIES = ("code name", "home city", "keeper", "motto")
# Corpus entities never drawn: their entries share words with the real ones, so BM25 has near misses to rank below.
DECOY_COLORS = ("orange", "purple")
# What a fact's value may be: made-up words (2-3 of the tiny tokenizer's pieces each), none a color, shape or
# property word; a closed set, so that answering a search row is reading which one the hit states.
VALUES = ("talmo", "zorvik", "bepun", "kinod", "rasel", "fumiga", "dovet", "lupra")
SPLITS = ("train", "val", "test")  # each asks its own facts (split_of)
CODE_THINK = "This needs exact arithmetic, so I will run code."  # the gold code call's think
# The crop kind: the quickstart's learnable zoom task (docs/decisions/quickstart-task.md); ``crop=`` overrides.
CROP = dict(size=(672, 504), tile=126, grid=2, glyph="stripes", margin=0, clutter=30, distractors=0, direct_share=0.0)
_DIRECT = {  # question, what the answer is read off
    "color": "What color is the object in the image?",
    "shape": "What shape is the object in the image?",
    "name": "What is the object in the image? Answer with its color and shape.",
}


def world(seed: int = 0) -> dict[tuple[str, str], str]:
    """The facts of corpus ``seed``: ``(entity, property) -> value``, decoy entities included. Within each split's
    pairs (``split_of``) the values are ``VALUES`` repeated evenly and shuffled, so that no value is likelier than
    another for a held-out pair; the decoys' are drawn at random."""
    rng = random.Random(f"tools-world/{seed}")
    facts = {}
    for split in SPLITS:
        pairs = [(e, p) for e in ENTITIES for p in PROPERTIES if split_of(e, p) == split]
        values = [VALUES[i % len(VALUES)] for i in range(len(pairs))]
        rng.shuffle(values)
        facts.update(zip(pairs, values, strict=True))
    for entity in (f"{color} {shape}" for color in DECOY_COLORS for shape in SHAPES):
        facts.update({(entity, prop): rng.choice(VALUES) for prop in PROPERTIES})
    return facts


def split_of(entity: str, prop: str) -> str:
    """The split whose search rows ask this pair: entity ``j`` keeps ``PROPERTIES[j % 4]`` for test and
    ``PROPERTIES[(j + 1) % 4]`` for val, and trains on the other two; so every property is held out of training for
    half the entities and searched in training for the other half."""
    j = ENTITIES.index(entity) - PROPERTIES.index(prop)
    return {0: "test", len(PROPERTIES) - 1: "val"}.get(j % len(PROPERTIES), "train")


def write_corpus(out_dir: str | Path, seed: int = 0) -> Path:
    """Write corpus ``seed`` as ``out_dir/corpus-<seed>.jsonl`` in the format ``BM25Backend`` reads (``title``,
    ``text``, ``id``; no ``url``, which would only lengthen the hits) and return its path. One entry per fact: the
    other properties of the same entity, the same property of other entities and the decoys are its distractors.
    The same seed writes the same file, so train and test builds may both call it."""
    path = Path(out_dir) / f"corpus-{seed}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"id": f"{entity}/{prop}".replace(" ", "-"), "title": f"{entity.capitalize()}: {prop}",
                    "text": f"The {prop} of the {entity} is {value}."})
        for (entity, prop), value in world(seed).items()
    ]  # fmt: skip
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def draw_entity(entity: str, rng: random.Random, size: tuple[int, int] = (224, 224)) -> Image.Image:
    """A large ``entity`` ("blue triangle") on a plain background, its size and place jittered so that no single
    picture stands for it."""
    color, shape = entity.split()
    width, height = size
    image = Image.new("RGB", size, (235, 235, 228))
    draw = ImageDraw.Draw(image)
    side = int(min(size) * rng.uniform(0.55, 0.8))
    x0, y0 = rng.randint(0, width - side), rng.randint(0, height - side)
    x1, y1, mx, my, fill = x0 + side, y0 + side, x0 + side // 2, y0 + side // 2, COLORS[color]
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape == "triangle":
        draw.polygon([(mx, y0), (x1, y1), (x0, y1)], fill=fill)
    elif shape == "cross":
        arm = side // 6
        draw.rectangle((mx - arm, y0, mx + arm, y1), fill=fill)
        draw.rectangle((x0, my - arm, x1, my + arm), fill=fill)
    else:  # ring: as wide as the circle, hollow
        draw.ellipse((x0, y0, x1, y1), outline=fill, width=max(4, side // 7))
    return image


def tool_rows(out_dir: str | Path, n: int, *, seed: int = 0, corpus_seed: int = 0, split: str = "train",
              shares: tuple[float, float, float, float] = (0.4, 0.2, 0.2, 0.2), size: tuple[int, int] = (224, 224),
              search_k: int = 1, crop: dict | None = None, min_pixels: int = 3136, max_pixels: int = 200704,
              factor: int = 28, convention: Convention = "absolute") -> list[Row]:  # fmt: skip
    """Build ``n`` tool-choice rows with gold trajectories under ``out_dir`` (images in ``out_dir/images``) and
    write the corpus their search calls read (``write_corpus(out_dir, corpus_seed)``; serve it with
    ``toolbox.search_corpus``).

    Args:
        seed: Draws the rows (kinds, entities, numbers, pictures); train and test take different seeds.
        corpus_seed: Draws the world (``world``); train and test take the same one.
        split: ``"train"``, ``"val"`` or ``"test"``: the search rows ask only the pairs of that split (``split_of``).
        shares: Fractions of search, code, crop and direct rows (``KINDS``), normalized; counts round to ``n``.
        size: (width, height) of the entity images (search, code and direct rows).
        search_k: The gold search's ``k``: one hit, whose value the answer is (BM25 ranks the asked fact first).
        crop: Overrides of the crop rows' ``zoom_rows`` knobs (``CROP``).
        min_pixels, max_pixels, factor, convention: The policy's frame (``Policy.frame``), for the gold crop.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(out, corpus_seed)
    facts = world(corpus_seed)
    asked = [pair for pair in facts if pair[0] in ENTITIES and split_of(*pair) == split]
    kinds = _kinds(n, shares, random.Random(f"tools/{seed}/kinds"))
    frame = dict(min_pixels=min_pixels, max_pixels=max_pixels, image_factor=factor, convention=convention)
    crops = iter(zoom_rows(out, kinds.count("crop"), seed=seed, **{**CROP, **(crop or {})}, min_pixels=min_pixels,
                           max_pixels=max_pixels, factor=factor, convention=convention))  # fmt: skip
    search, common = BM25Backend(corpus), {"split": split, "corpus": corpus.name}
    rows = []
    for i, kind in enumerate(kinds):
        row_id = f"tools-{seed}-{i}"
        if kind == "crop":
            zoom = next(crops)
            rows.append(dataclasses.replace(zoom, id=row_id, source="synthetic/tools-crop", answer=[zoom.answer],
                                            answer_type="f1", tools=list(TOOLS),
                                            extra={**zoom.extra, "kind": "crop", **common}))  # fmt: skip
            continue
        rng = random.Random(f"tools/{seed}/{i}")
        entity, prop = rng.choice(asked) if kind == "search" else (rng.choice(ENTITIES), None)
        image, image_path = draw_entity(entity, rng, size), out / "images" / f"{row_id}.png"
        image.save(image_path)
        context = ToolContext(images=[image], search=search, **frame)  # as the engine's: the row's image, the corpus
        if kind == "search":
            question, answer, messages, extra = _search(entity, prop, facts[entity, prop], context, search_k,
                                                        out / "images" / f"{row_id}-search")  # fmt: skip
        elif kind == "code":
            question, answer, messages, extra = _code(rng, context, out / "images" / f"{row_id}-code")
        else:
            question, answer, messages, extra = _direct(entity, rng)
        rows.append(Row(id=row_id, source=f"synthetic/tools-{kind}", images=[str(image_path)], question=question,
                        answer=[answer], answer_type="f1", tools=list(TOOLS), messages=messages,
                        extra={"kind": kind, **common, **extra}))  # fmt: skip
    return rows


def query_rows(out_dir: str | Path, *, seed: int = 0, search_k: int = 1,
               size: tuple[int, int] = (224, 224)) -> list[Row]:  # fmt: skip
    """One row per (entity, property) pair, held-out pairs included: a search row's first turn alone, the think
    naming the pictured object and the call (``search_k`` hits asked), built without the corpus, so no hit and no
    value is in it (the answer field holds the query). Train search rows ask each object only its training
    properties; a policy trained on them alone learns which properties each object is asked about and writes those
    into a held-out pair's query. These rows train the query as the question's property, for every object; a
    held-out row's question and first turn are then trained too (on another picture), never its value
    (``docs/decisions/tool-choice-task.md``)."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (entity, prop) in enumerate((e, p) for e in ENTITIES for p in PROPERTIES):
        row_id, rng = f"tools-query-{seed}-{i}", random.Random(f"tools-query/{seed}/{i}")
        image_path = out / "images" / f"{row_id}.png"
        draw_entity(entity, rng, size).save(image_path)
        turn = {"role": "assistant", "content": _search_call(entity, prop, search_k)}
        extra = {"kind": "query", "entity": entity, "property": prop, "query": f"{entity} {prop}"}
        rows.append(Row(id=row_id, source="synthetic/tools-query", images=[str(image_path)],
                        question=_search_question(prop), answer=extra["query"], answer_type="exact",
                        tools=list(TOOLS), messages=[turn], extra=extra))  # fmt: skip
    return rows


def _kinds(n: int, shares: tuple[float, ...], rng: random.Random) -> list[str]:
    """``n`` kinds in ``shares``' proportions (largest remainders), shuffled."""
    if len(shares) != len(KINDS) or min(shares) < 0 or sum(shares) <= 0:
        raise ValueError(f"shares must be {len(KINDS)} non-negative fractions ({', '.join(KINDS)}), got {shares}")
    exact = [n * s / sum(shares) for s in shares]
    counts = [int(x) for x in exact]
    for k in sorted(range(len(KINDS)), key=lambda k: counts[k] - exact[k])[: n - sum(counts)]:
        counts[k] += 1
    kinds = [kind for kind, count in zip(KINDS, counts, strict=True) for _ in range(count)]
    rng.shuffle(kinds)
    return kinds


def _search_question(prop: str) -> str:
    return f"What is the {prop} of the object in the image?"


def search_think(entity: str, prop: str) -> str:
    """A search row's first think: it names the pictured object and the asked property."""
    return f"The image shows a {entity}. Its {prop} is not in the image, so I will search for it."


def value_think(entity: str, prop: str, value: str) -> str:
    """A search row's last think: the hit's sentence repeated, so the value follows the same words as in the hit."""
    return f"The first result says the {prop} of the {entity} is {value}."


def _search_call(entity: str, prop: str, k: int) -> str:
    """A search row's first turn: the think naming the pictured object, then the call."""
    return f"<think>{search_think(entity, prop)}</think>\n{call_text('search', {'query': f'{entity} {prop}', 'k': k})}"


def _search(entity: str, prop: str, value: str, context: ToolContext, k: int, stem: Path):
    """Name the entity, search "<entity> <property>", answer with the value that ends the first hit."""
    _, hits = tool_turn("search", {"query": f"{entity} {prop}", "k": k}, context, stem)
    messages = [
        {"role": "assistant", "content": _search_call(entity, prop, k)},
        hits,
        {"role": "assistant",
         "content": f"<think>{value_think(entity, prop, value)}</think>\n<answer>{value}</answer>"},
    ]  # fmt: skip
    question = _search_question(prop)
    return question, value, messages, {"entity": entity, "property": prop, "query": f"{entity} {prop}"}


def output_think(output: str) -> str:
    """The gold think after a code call: it quotes the tool's turn (``stdout:`` and the number), so that the number
    follows the same tokens as in the tool's turn and is copied from there, as a hit's value is copied after "is"
    (``docs/decisions/tool-choice-task.md``)."""
    return f"The program printed:\nstdout:\n{output}"


def arithmetic(rng: random.Random) -> tuple[str, str, int]:
    """A code row's computation: (question, program, result). A product of two two-digit numbers or a sum of three,
    asked as the expression the program prints (``What is 47*38?`` -> ``print(47*38)``): the program copies a stretch
    of the question token for token, and without spaces each digit follows a digit or an operator that tells where
    the copy is (``docs/decisions/tool-choice-task.md``)."""
    if rng.random() < 0.5:
        terms, op = [rng.randint(12, 99), rng.randint(12, 99)], "*"
    else:
        terms, op = [rng.randint(12, 99) for _ in range(3)], "+"
    expression = op.join(map(str, terms))
    return f"What is {expression}?", f"print({expression})", math.prod(terms) if op == "*" else sum(terms)


def _code(rng: random.Random, context: ToolContext, stem: Path):
    """Exact arithmetic (``arithmetic``): a code call that prints it, then the printed number."""
    question, program, result = arithmetic(rng)
    call, output = tool_turn("code", {"code": program}, context, stem)
    answer = str(result)  # what the sandbox prints (the tests check they agree)
    return question, answer, code_turns(call, output, answer), {"program": program}


def code_turns(call: str, output: dict, answer: str) -> list[dict]:
    """A code row's gold turns after its question: the ``call`` after ``CODE_THINK``, the tool's turn ``output``,
    then the answer after a think that quotes the output (``output_think``)."""
    return [
        {"role": "assistant", "content": f"<think>{CODE_THINK}</think>\n{call}"},
        output,
        {"role": "assistant", "content": f"<think>{output_think(answer)}</think>\n<answer>{answer}</answer>"},
    ]


def _direct(entity: str, rng: random.Random):
    """Ask what the picture shows: its color, its shape, or both; answer without a tool."""
    asked = rng.choice(list(_DIRECT))
    color, shape = entity.split()
    answer = {"color": color, "shape": shape, "name": entity}[asked]
    reply = f"<think>The image shows a {entity}.</think>\n<answer>{answer}</answer>"
    messages = [{"role": "assistant", "content": reply}]
    return _DIRECT[asked], answer, messages, {"entity": entity, "asked": asked}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    parser.add_argument("--out", required=True, help="output dir (rows.jsonl, test.jsonl, corpus-<seed>.jsonl, images)")
    parser.add_argument("--rows", type=int, default=400, help="train rows (rows.jsonl)")
    parser.add_argument("--test-rows", type=int, default=0, help="also write test.jsonl: held-out pairs, other images")
    parser.add_argument("--seed", type=int, default=0, help="the train rows' seed; test rows take seed + 10000")
    parser.add_argument("--corpus-seed", type=int, default=0, help="the world: corpus and values, shared by both")
    parser.add_argument("--shares", type=float, nargs=4, default=[0.4, 0.2, 0.2, 0.2], metavar=KINDS)
    parser.add_argument("--model", help="checkpoint dir whose pixel budget and coordinate convention the gold crops "
                                        "use (default: Qwen2.5-VL's pixels, 3136-200704)")  # fmt: skip
    args = parser.parse_args(argv)
    frame = {}
    if args.model:
        from vagent.model import load_policy

        frame = load_policy(args.model, device="cpu").frame
    knobs = dict(corpus_seed=args.corpus_seed, shares=tuple(args.shares), **frame)
    rows = tool_rows(args.out, args.rows, seed=args.seed, split="train", **knobs)
    print(f"wrote {len(rows)} rows to {write_rows(rows, Path(args.out) / 'rows.jsonl')}")
    if args.test_rows:
        test = tool_rows(args.out, args.test_rows, seed=args.seed + 10_000, split="test", **knobs)
        print(f"wrote {len(test)} rows to {write_rows(test, Path(args.out) / 'test.jsonl')}")
    print(f"search corpus: {write_corpus(args.out, args.corpus_seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
