"""The quickstart's synthetic zoom data: train, test and val splits, the warm-up phases' rows, the two SFT mixes."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from PIL import Image

from quickstart.config import QuickstartConfig
from vagent.data import write_rows

# Warm-up phases (cfg.warmup_phases), each a plain SFT run on other images' rows: mixed in one run, grounding and
# perception were not learned within the budget; alone, each is (docs/decisions/).
WARMUP = ("grounding", "perception", "reading")
# The warm-up phases whose checkpoints the report checks on the val images' rows of the phase.
CHECKED = ("grounding", "perception")


def warmup_runs(cfg: QuickstartConfig) -> list[tuple[str, str, float]]:
    """(run directory name, phase, epochs) of each warm-up SFT run, in order; a phase named twice gets a numbered
    run; a phase given 0 epochs is skipped."""
    if not cfg.warmup_rows:
        return []
    phases = cfg.warmup_phases
    return [(f"sft-warmup-{phase}" + (f"-{i + 1}" if phases.count(phase) > 1 else ""), phase, n)
            for i, (phase, n) in enumerate(zip(phases, cfg.phase_epochs(), strict=True)) if n > 0]  # fmt: skip


def built(out: Path, paths: dict[str, Path], recipe: dict) -> bool:
    """Whether ``paths`` all exist and were built from ``recipe`` (the task's knobs, ``out/recipe.json``, written by
    ``mark_built``): a rerun in the same out_dir with another seed, row count or task knob rebuilds its data instead of
    training on the old."""
    marker = out / "recipe.json"
    return (all(p.is_file() for p in paths.values()) and marker.is_file()
            and json.loads(marker.read_text()) == json.loads(json.dumps(recipe)))  # fmt: skip


def mark_built(out: Path, recipe: dict) -> None:
    """Record that ``out``'s data was built from ``recipe`` (``built``), once every file is written."""
    (out / "recipe.json").write_text(json.dumps(recipe))


def build_data(cfg: QuickstartConfig, out: Path, policy) -> dict[str, Path]:
    """train (gold crop-then-answer / direct rows, GRPO's prompts), each warm-up phase's rows (of other images),
    the grounding and perception rows of the val images (the warm-up's checks), the two SFT mixes (train + the
    reading, perception and grounding rows of its images; and the same rows answered directly without tools,
    twice for the small tiles, + the perception and grounding rows), test, and val (the held-out rows GRPO picks
    its best step on; other images than test)."""
    from data_pipelines.synthetic.zoom import spawn_pool, zoom_rows

    names = (
        "train",
        *(f"warmup_{phase}" for phase in WARMUP),
        *([f"check_{phase}" for phase in CHECKED] if cfg.val_rows else []),
        "sft_mix",
        "sft_mix_notool",
        "test",
        *(["val"] if cfg.val_rows else []),
    )
    paths = {name: out / f"{name}.jsonl" for name in names}
    recipe = {"seed": cfg.seed, "rows": [cfg.train_rows, cfg.test_rows, cfg.val_rows, cfg.warmup_rows],
              "image": [cfg.image_size, cfg.grid, cfg.tile, cfg.glyph, cfg.direct_share], "frame": policy.frame}  # fmt: skip
    if built(out, paths, recipe):
        return paths
    # margin 0: the gold crop is the tile's box, the box the grounding rows answer
    knobs = dict(size=tuple(cfg.image_size), tile=cfg.tile, clutter=30, distractors=0, direct_share=cfg.direct_share,
                 grid=cfg.grid or None, margin=0, glyph=cfg.glyph, workers=min(os.cpu_count() or 1, 8),
                 **policy.frame)  # fmt: skip
    with spawn_pool(knobs["workers"]) as drawing:  # one pool for the four splits: each process imports once
        train = zoom_rows(out, cfg.train_rows, seed=cfg.seed, pool=drawing, **knobs)
        test = zoom_rows(out, cfg.test_rows, seed=cfg.seed + 10_000, pool=drawing, **knobs)
        val = zoom_rows(out, cfg.val_rows, seed=cfg.seed + 30_000, pool=drawing, **knobs) if cfg.val_rows else []
        pool = zoom_rows(out, cfg.warmup_rows, seed=cfg.seed + 20_000, pool=drawing, **knobs) if cfg.warmup_rows else []
    warmup = support_rows(pool, policy)
    notool = []
    for row in train:  # the same images and answers, answered without looking closer
        answer = f"<think>The {row.extra['color']} tile shows {row.answer}.</think>\n"
        notool.append(row.__class__(**{**row.__dict__, "tools": [],
                                       "messages": [{"role": "assistant", "content": f"{answer}<answer>{row.answer}</answer>"}]}))  # fmt: skip
    support = support_rows(train, policy)
    reading = [r for r in support if r.source.endswith("reading")]
    shared = [r for r in support if not r.source.endswith("reading")]  # perception and grounding: both mixes
    # The crop-tool mix reads each crop once more in the trajectory's context (without it the policy found the tile
    # but mostly did not read its own crop: docs/decisions/reading-rows.md); for the same number of rows and steps, the
    # baseline answers those images directly once more.
    again = [
        r.__class__(**{**r.__dict__, "id": f"{r.id}-again"}) for r in notool if not r.extra["difficulty"]["direct"]
    ]
    write_rows(test, paths["test"])
    if cfg.val_rows:
        write_rows(val, paths["val"])
        checked = support_rows(val, policy)
        for phase in CHECKED:
            write_rows([r for r in checked if r.source.endswith(phase)], paths[f"check_{phase}"])
    for phase in WARMUP:
        write_rows([r for r in warmup if r.source.endswith(phase)], paths[f"warmup_{phase}"])
    write_rows(notool + again + shared, paths["sft_mix_notool"])
    write_rows(train + shared + reading, paths["sft_mix"])
    write_rows(train, paths["train"])
    print(f"{len(train)} train rows ({sum(r.extra['difficulty']['direct'] for r in train)} readable without a tool) "
          f"+ {len(shared)} perception and grounding rows for both SFT mixes and {len(reading)} reading rows for the "
          f"crop-tool one, {len(warmup)} warm-up rows of other images, {len(test)} test rows, "
          f"{len(val)} val rows for GRPO, images {cfg.image_size[0]}x{cfg.image_size[1]} in {out}")  # fmt: skip
    mark_built(out, recipe)
    return paths


def support_rows(train, policy) -> list:
    """Rows that train one skill each, the way VLM SFT mixes carry perception and grounding data next to agent
    trajectories: read the glyph from a gold crop shown alone (perception: the skill a crop is for), give the
    tile's box on the global view (grounding: the skill of choosing where to crop), and read it from the crop in
    the trajectory's context (reading: the gold trajectory with its crop call shown but not trained). A model
    trained from scratch learns to use its image tokens from these far sooner than from the one answer token of
    a long trajectory."""
    from data_pipelines.gold import model_box

    rows = []
    for row in train:
        if row.extra["difficulty"]["direct"]:
            continue
        crop = next(p.path for p in row.messages[1].content if p.type == "image")
        rows.append(row.__class__(id=f"{row.id}-read", question=row.question, answer=row.answer, answer_type="exact",
                                  images=[crop], tools=[], source="synthetic/zoom-perception",
                                  messages=[{"role": "assistant", "content": f"<answer>{row.answer}</answer>"}]))  # fmt: skip
        rows.append(row.__class__(**{**row.__dict__, "id": f"{row.id}-look", "source": "synthetic/zoom-reading",
                                     "messages": [dataclasses.replace(row.messages[0], trained=False), *row.messages[1:]]}))  # fmt: skip
        tile = row.evidence.boxes[0]
        with Image.open(row.images[0]) as image:
            size = image.size
        box = model_box(tile, size, **policy.frame)
        rows.append(row.__class__(id=f"{row.id}-ground", question=f"Where is the small {row.extra['color']} tile? Give its box.",
                                  answer=tile, answer_type="box", images=list(row.images), tools=[],
                                  source="synthetic/zoom-grounding",
                                  messages=[{"role": "assistant", "content": f"<answer>{box}</answer>"}]))  # fmt: skip
    return rows
