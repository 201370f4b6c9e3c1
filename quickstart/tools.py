"""The search-and-code proof (``python -m quickstart --config configs/quickstart/tools_cpu.yaml``): choosing a tool.

MAT-style rows (``data_pipelines.synthetic.tools``) offer ``search``, ``code`` and ``crop`` on every row, and the
question says which one helps: a made-up fact of the pictured object that only the offline corpus states (search), an
exact product or sum (code, run in the sandbox), the stripes of a small tile (crop), or what the picture shows (none).
Test search rows ask facts held out of training (val rows others), so only a search answers them. The stages are the
crop proof's (``quickstart.run.run``): a warm-up of four tool-free phases on other rows (the crop proof's perception
and grounding on 3,000 tiles, naming the pictured object, copying what a gold trajectory copies), SFT on the gold
trajectories (and every pair's search call, ``query_rows``) beside a no-tool baseline on the same rows answered
directly, GRPO, evaluation scored with MAT's F1 and EM (``vagent eval --benchmark synthetic-tools``), and
``report.md`` with the row kind x tool called table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

from data_pipelines.gold import call_json, call_text
from data_pipelines.synthetic.tools import (
    CROP,
    ENTITIES,
    KINDS,
    PROPERTIES,
    TOOLS,
    VALUES,
    arithmetic,
    code_turns,
    draw_entity,
    query_rows,
    search_think,
    tool_rows,
    value_think,
)
from quickstart.config import ToolsConfig
from quickstart.data import built, mark_built, support_rows
from quickstart.report import (
    SAMPLED,
    TARGETS,
    curves,
    greedy_kept,
    grpo_kept,
    grpo_vs_sft,
    peak_rss_gb,
    report_tail,
    reward_rises,
    sampling,
    targets_table,
)
from quickstart.run import Proof, greedy_limits, greedy_scores, warmup_phases
from quickstart.toolstar import toolstar_runs, toolstar_section
from vagent.data import Row, load_rows, write_rows
from vagent.eval.runner import read_samples, write_table
from vagent.model import load_policy
from vagent.recipes.evaluate import bar_chart
from vagent.training.data import gold_reproduced

# GRPO's rewards: the answer (F1, the row's answer type), the format, the crop's IoU with the tile (crop rows; 0
# elsewhere), a penalty for a failed call (the crop proof's). No tool_bonus: it would pay a call on a direct row that
# is answered right without one, and on a search or code row the F1 already takes the right call.
REWARDS = {"accuracy": 1.0, "format": 0.2, "crop_iou": 0.5, "invalid_calls": 0.2}
# What the proof sets out to show (the issue): with its tools, F1 at least 2x the no-tool baseline's on the search rows
# and on the code rows, and at least 0.5 (the baseline scores near 0 there, so the ratio alone asks almost nothing);
# the right tool called first on at least 70% of the rows that need one; and the crop proof's GRPO, greedy, time and
# memory targets (F1 standing for accuracy).
TOOLS_TARGETS = {**TARGETS, "ratio": 2.0, "f1_floor": 0.5, "right_tool": 0.7}
NAME_QUESTION = "What is the object in the image? Answer with its color and shape."
# What each warm-up phase's check reads (the report's lines).
WHAT = {"perception": "the stripes read from a gold crop", "grounding": "the tile's box (IoU >= 0.5)",
        "entity": "the pictured object's color and shape", "copy": "a query, a value, or a program and its printed number, copied as the gold copies them"}  # fmt: skip
LEGEND = (
    "Runs: `no-tool baseline` = trained from the same warm-up on the same rows answered directly without a tool, for "
    "as many steps (a test search row asks a fact held out of training, a code row numbers drawn for it: it can only "
    "guess); `..., sampled` = the policy sampled at GRPO's temperature instead of greedily; `grpo tool-star ...` = "
    "GRPO from the SFT policy with Tool-Star's reward alone, plain and with self-critic (their own section).\n\n"
    "Metrics: `f1`, `em` = MAT's token F1 and exact match (max over the gold answers, as `vagent eval --benchmark "
    "mat-search` scores); GRPO's val accuracy is the same F1. `crop_iou` = best IoU of a crop with the tile (0 "
    "without one). Each trajectory viewer shows every call as the policy wrote it (`search(query=..., k=...)`, "
    "`code(code=...)`, `crop(bbox=...)`) and the tool's turn under it: the numbered hits, the program's output, the "
    "crop."
)


def build_tools_data(cfg: ToolsConfig, out: Path, policy) -> dict[str, Path]:
    """The corpus, train (gold rows), test and val (each its own held-out facts), grpo (GRPO's prompts, drawn apart
    from train as train asks: new numbers and pictures, train's facts; ``cfg.grpo_rows``), each warm-up phase's
    rows and their checks, and the two SFT mixes: ``sft_mix`` (train, the crop rows' reading rows, the perception,
    grounding and naming rows of train's pictures, and ``query_rows``: every pair's search call, no value) and
    ``sft_mix_notool`` (the same rows, each tool trajectory answered directly and each query row's picture named: as
    many rows, so as many steps). Points ``cfg.toolbox.search_corpus`` at the corpus: the run's GRPO and evaluations
    search the world the rows were built in."""
    names = ("train", "test", "val", "sft_mix", "sft_mix_notool", *(f"warmup_{p}" for p in ToolsConfig.PHASES),
             *(f"check_{p}" for p in ToolsConfig.PHASES), *(["grpo"] if cfg.grpo_rows else []))  # fmt: skip
    paths = {name: out / f"{name}.jsonl" for name in names}
    corpus = out / f"corpus-{cfg.corpus_seed}.jsonl"  # tool_rows writes it
    cfg.toolbox.search_corpus = str(corpus.resolve())
    design = "val pairs, 8 values, one hit, 4 shapes, 2-digit expressions, query rows, quoted output, code trajectories"
    recipe = {"design": design, "seed": cfg.seed, "corpus_seed": cfg.corpus_seed, "shares": cfg.shares,
              "frame": policy.frame, "rows": [cfg.train_rows, cfg.test_rows, cfg.val_rows, cfg.warmup_rows, cfg.grpo_rows]}  # fmt: skip
    if corpus.is_file() and built(out, paths, recipe):
        return paths
    knobs = dict(corpus_seed=cfg.corpus_seed, shares=tuple(cfg.shares), **policy.frame)
    train = _grouped(tool_rows(out, cfg.train_rows, seed=cfg.seed, split="train", **knobs))
    test = _grouped(tool_rows(out, cfg.test_rows, seed=cfg.seed + 10_000, split="test", **knobs))
    val = _grouped(tool_rows(out, cfg.val_rows, seed=cfg.seed + 30_000, split="val", **knobs)) if cfg.val_rows else []
    if cfg.grpo_rows:
        write_rows(
            _grouped(tool_rows(out, cfg.grpo_rows, seed=cfg.seed + 60_000, split="train", **knobs)), paths["grpo"]
        )
    warmup = skill_rows(out, cfg.warmup_rows, cfg.seed + 20_000, policy)
    checks = skill_rows(out, cfg.val_rows, cfg.seed + 40_000, policy)
    crops = [dataclasses.replace(r, answer=r.answer[0]) for r in train if r.extra["kind"] == "crop"]
    support = support_rows(crops, policy)  # the crop proof's perception, grounding and reading rows of train's tiles
    reading = [r for r in support if r.source.endswith("reading")]
    shared = [r for r in support if not r.source.endswith("reading")]
    shared += [_named(f"{r.id}-name", r.images[0], r.extra["entity"]) for r in train if r.extra["kind"] == "search"]
    queries = query_rows(out, seed=cfg.seed + 50_000)  # every pair's call, no hit or value
    baseline_named = [_named(f"{r.id}-name", r.images[0], r.extra["entity"]) for r in queries]  # the baseline's
    write_rows(train, paths["train"])
    write_rows(test, paths["test"])
    write_rows(val, paths["val"])
    for phase in ToolsConfig.PHASES:
        write_rows(warmup[phase], paths[f"warmup_{phase}"])
        write_rows(checks[phase], paths[f"check_{phase}"])
    write_rows(train + reading + shared + queries, paths["sft_mix"])
    write_rows([answered_directly(r) for r in train + reading] + shared + baseline_named, paths["sft_mix_notool"])
    kinds = Counter(r.extra["kind"] for r in train)
    print(f"{len(train)} train rows ({', '.join(f'{kinds[k]} {k}' for k in KINDS)}) + {len(reading)} reading, "
          f"{len(shared)} perception, grounding and naming rows and {len(queries)} query rows (the baseline: their "
          f"pictures named) for the SFT mixes, {cfg.warmup_rows} rows of each "
          f"warm-up phase, {len(test)} test rows, {len(val)} val rows, corpus {cfg.toolbox.search_corpus}")  # fmt: skip
    mark_built(out, recipe)
    return paths


def _grouped(rows: list[Row]) -> list[Row]:
    """The rows with their kind as an eval group: ``metrics.json`` then holds F1 and EM ``by_kind``."""
    return [dataclasses.replace(r, extra={**r.extra, "groups": {"kind": r.extra["kind"]}}) for r in rows]


def answered_directly(row: Row) -> Row:
    """A tool row answered without a tool: the no-tool baseline's gold (a direct row keeps its own)."""
    if row.extra["kind"] == "direct":
        return dataclasses.replace(row, tools=[])
    answer = row.answer[0] if isinstance(row.answer, list) else row.answer
    think = {"search": f"The image shows a {row.extra.get('entity')}.", "code": "I will work it out.",
             "crop": f"The {row.extra.get('color')} tile shows {answer}."}[row.extra["kind"]]  # fmt: skip
    content = f"<think>{think}</think>\n<answer>{answer}</answer>"
    return dataclasses.replace(row, tools=[], messages=[{"role": "assistant", "content": content}])


def skill_rows(out: Path, n: int, seed: int, policy) -> dict[str, list[Row]]:
    """``n`` tool-free rows of each warm-up phase (other tiles, pictures and facts than the splits'): perception and
    grounding (the crop proof's rows of stripes tiles), entity (name a pictured object) and copy (``_copied``: a
    search call's query or a hit's value, or a whole code trajectory without its picture or the tools' schemas)."""
    from data_pipelines.synthetic.zoom import zoom_rows

    if not n:
        return {phase: [] for phase in ToolsConfig.PHASES}
    workers = min(os.cpu_count() or 1, 8) if n >= 100 else 1  # spawning the drawing processes costs seconds
    tiles = support_rows(zoom_rows(out, n, seed=seed, **CROP, **policy.frame, workers=workers), policy)
    entities = []
    for i in range(n):
        rng = random.Random(f"quickstart-tools-entity/{seed}/{i}")
        entity, path = rng.choice(ENTITIES), out / "images" / f"entity-{seed}-{i}.png"
        draw_entity(entity, rng).save(path)
        entities.append(_named(f"entity-{seed}-{i}", str(path), entity))
    rng = random.Random(f"quickstart-tools-copy/{seed}")
    return {"perception": [r for r in tiles if r.source.endswith("perception")],
            "grounding": [r for r in tiles if r.source.endswith("grounding")], "entity": entities,
            "copy": [_copied(f"copy-{seed}-{i}", rng) for i in range(n)]}  # fmt: skip


def _named(row_id: str, image: str, entity: str) -> Row:
    return Row(id=row_id, question=NAME_QUESTION, answer=entity, answer_type="exact", images=[image], tools=[],
               source="synthetic/tools-entity", messages=[{"role": "assistant", "content": f"<answer>{entity}</answer>"}])  # fmt: skip


def _copied(row_id: str, rng: random.Random) -> Row:
    """A tool-free row that trains the copies a gold trajectory makes, in the words and at the distance the gold makes
    them (a model this small copies at the offsets it was trained on): the search call's query from the question and
    the object's name (``query``), the value from the hit (``value``), or a whole code trajectory without its picture
    and the tools' schemas (``code``, half the rows): the program copied from the question's expression, the tool's
    turn as the sandbox prints it, and the printed number copied into the think and the answer. A search call is
    written inside ``<answer>`` as the JSON the gold call holds; values and numbers are drawn as the rows draw them."""
    skill = rng.choice(("query", "value", "code", "code"))
    entity, prop, value = rng.choice(ENTITIES), rng.choice(PROPERTIES), rng.choice(VALUES)
    asked, program, result = arithmetic(rng)
    if skill == "code":
        printed = {"role": "tool", "content": f"stdout:\n{result}"}  # the code tool's turn (a test runs the sandbox)
        turns = code_turns(call_text("code", {"code": program}), printed, str(result))
        return Row(id=row_id, question=asked, answer=str(result), answer_type="exact", tools=[], messages=turns,
                   source="synthetic/tools-copy", extra={"groups": {"skill": skill}})  # fmt: skip
    if skill == "query":
        question = f"The object in the image is a {entity}. What is the {prop} of the object in the image?"
        think, answer = search_think(entity, prop), call_json("search", {"query": f"{entity} {prop}", "k": 1})
    else:
        question = (f'Search results for "{entity} {prop}":\n1. {entity.capitalize()}: {prop}\n   The {prop} of the '
                    f"{entity} is {value}.\nWhat is the {prop} of the {entity}?")  # fmt: skip
        think, answer = value_think(entity, prop, value), value
    return Row(id=row_id, question=question, answer=answer, answer_type="exact", tools=[], source="synthetic/tools-copy",
               messages=[{"role": "assistant", "content": f"<think>{think}</think>\n<answer>{answer}</answer>"}],
               extra={"groups": {"skill": skill}})  # fmt: skip


def warmup(cfg: ToolsConfig, out: Path, base: Path, data: dict[str, Path]) -> tuple[Path, dict[str, Any]]:
    """The search-and-code proof's warm-up phases, each checked on its phase's val rows (where it has some)."""

    def checks(run: str, phase: str, start: Path) -> dict[str, Any]:
        rows = data[f"check_{phase}"]
        return {run: check(run, phase, start, rows, out, cfg)} if rows.stat().st_size else {}

    return warmup_phases(cfg, out, base, data, checks, tools=[])


def check(run: str, phase: str, model_dir: Path, rows_path: Path, out: Path, cfg: ToolsConfig) -> dict[str, Any]:
    """A warm-up phase's checkpoint on its val rows: accuracy by group (the stripes' direction; the box; the object's
    shape; a copy row's skill), and ``how`` it was measured: greedy episodes, or for a copy row its gold reproduced
    token by token (``gold_reproduced``, which needs no sandbox for a code row's tool turn)."""
    rows = load_rows(rows_path)
    scores: dict[str, list[float]] = {}
    if phase == "copy":
        how = "teacher-forced: the whole gold greedy"
        reproduced = gold_reproduced(load_policy(model_dir, device=cfg.model.device or "cpu"), rows)
        verdicts = [
            {"id": row.id, "skill": row.extra["groups"]["skill"], "reproduced": reproduced[row.id]} for row in rows
        ]
        (out / "eval" / run).mkdir(parents=True, exist_ok=True)
        (out / "eval" / run / "reproduced.jsonl").write_text("".join(json.dumps(v) + "\n" for v in verdicts))
        for v in verdicts:
            scores.setdefault(v["skill"], []).append(float(v["reproduced"]))
    else:
        how = "greedy"
        group = {"perception": lambda s: str(s["gold"][0]), "grounding": lambda s: "box",
                 "entity": lambda s: str(s["gold"][0]).split()[-1]}[phase]  # fmt: skip
        limits = dataclasses.replace(greedy_limits(cfg), max_turns=1)
        scores, _ = greedy_scores(model_dir, rows, out / "eval" / run, limits, cfg.model.device or "cpu",
                                  f"{run}: {len(rows)} val rows", group)  # fmt: skip
    result = {"phase": phase, "how": how, "scores": scores}
    print(f"{run}: {check_line(result)}", flush=True)
    return result


def check_line(check: dict[str, Any]) -> str:
    """One line saying what a warm-up phase learned."""
    scores = check["scores"]
    n, right = sum(len(v) for v in scores.values()), sum(sum(v) for v in scores.values())
    line = (f"{WHAT[check['phase']]} on {n} val rows ({check['how']}): accuracy {right / n:.2f} ("
            + ", ".join(f"{group} {sum(v):.0f}/{len(v)}" for group, v in sorted(scores.items())) + ")")  # fmt: skip
    if right < 0.5 * n:
        line += (" - not learned (its loss is still on the plateau), so the tool SFT has to; a longer phase (its "
                 "number in warmup_epochs) usually gets past it")  # fmt: skip
    return line


def write_report(cfg: ToolsConfig, out: Path, results: dict[str, tuple[Path, dict[str, Any]]], test_rows,
                 checks: dict[str, dict[str, Any]], times: dict[str, float], total: float) -> str:  # fmt: skip
    names = list(results)
    metrics = [m for _, m in results.values()]
    bar_chart(metrics, names, out / "results.png", title="held-out test rows")
    curves(cfg, out, ("reward", "accuracy", "reward/invalid_calls", "tool_calls_per_traj"))
    samples = {name: read_samples(run_dir / "samples.jsonl") for name, (run_dir, _) in results.items()}
    kinds = {r.id: r.extra["kind"] for r in test_rows}
    count = Counter(kinds.values())
    best = max((n for n in names if n.endswith("+ tools")), key=lambda n: results[n][1]["f1"])  # not Tool-Star's
    own = total - times.get("comparison", 0.0)  # the proof's time: the Tool-Star runs are reported apart
    # the crop proof's GRPO lines compare accuracies: here the F1, which is also GRPO's accuracy reward
    as_accuracy = {n: [{**s, "accuracy": s["f1"]} for s in rows] for n, rows in samples.items()}
    learned = [f"- {run}: {check_line(c)}." for run, c in checks.items()]
    lines = [
        "# vagent search-and-code proof report",
        "",
        f"Total time **{total / 60:.1f} min** on this machine ({', '.join(f'{k} {v:.0f}s' for k, v in times.items())}"
        f"; comparison = the Tool-Star runs).",
        f"Policy: a random tiny Qwen2.5-VL ({cfg.tiny.size} preset) trained from scratch on {cfg.train_rows} tool-choice "
        f"rows offering {', '.join(TOOLS)} on every row; {len(test_rows)} held-out test rows "
        f"({', '.join(f'{count[k]} {k}' for k in KINDS)}). Greedy decoding, except the runs named sampled "
        f"({sampling(cfg, cfg.sampled_test_samples)}, as GRPO samples).",
        "",
        "## Results on the held-out test rows",
        "",
        write_table(metrics, None, names),
        "![results](results.png)",
        "",
        f"Best policy with tools: **{best}** (F1 {results[best][1]['f1']:.3f}, EM {results[best][1]['em']:.3f}) vs the "
        f"no-tool baseline (F1 {results['no-tool baseline'][1]['f1']:.3f}).",
        "",
        *grpo_vs_sft(as_accuracy, {n: (d, _f1_as_accuracy(m)) for n, (d, m) in results.items()}, "tools"),
        *grpo_kept(cfg, out),
        "## Targets",
        "",
        *targets_table(cfg, _targets(cfg, results, samples, as_accuracy, kinds, best, out, own)),
        "",
        "## F1 and EM by row kind",
        "",
        *_by_kind(samples, kinds),
        "",
        "## Which tool does each policy call? (row kind x first tool called)",
        "",
        *_tool_choice({n: rows for n, rows in samples.items() if results[n][1]["tools"] != "none"}, kinds),
        "",
        *toolstar_section(out, results, "sft + tools", cfg),
        *(["## What the warm-up learned", "", *learned, ""] if learned else []),
        *report_tail(out, results, LEGEND),
    ]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


def _f1_as_accuracy(metrics: dict[str, Any]) -> dict[str, Any]:
    """A run's metrics with its F1 also named accuracy, at every k too, as the crop proof's report lines read them."""
    at_k = {k: {**m, **{name.replace("/f1", "/accuracy"): v for name, v in m.items() if name.endswith("/f1")}}
            for k, m in (metrics.get("at_k") or {}).items()}  # fmt: skip
    return {**metrics, "accuracy": metrics["f1"], "at_k": at_k}


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(s[key] for s in rows) / len(rows) if rows else 0.0


def _right_tool(rows: list[dict[str, Any]], kinds: dict[str, str]) -> list[bool]:
    """Per sample of a row that needs a tool (search, code, crop): whether its first call is that tool."""
    return [bool(s["tool_calls"]) and s["tool_calls"][0] == kinds[s["id"]] for s in rows if kinds[s["id"]] != "direct"]


def _targets(cfg: ToolsConfig, results: dict[str, tuple[Path, dict[str, Any]]], samples: dict[str, list[dict]],
             as_accuracy: dict[str, list[dict]], kinds: dict[str, str], best: str, out: Path,
             total: float) -> list[tuple[str, str, bool]]:  # fmt: skip
    """``TOOLS_TARGETS`` for ``best``, the best policy with tools: (target, measured, met)."""
    ratio, floor, rows = TOOLS_TARGETS["ratio"], TOOLS_TARGETS["f1_floor"], []
    for kind in ("search", "code"):
        f1, base = (_mean([s for s in samples[n] if kinds[s["id"]] == kind], "f1") for n in (best, "no-tool baseline"))
        rows.append((f"{kind} rows: F1 at least {ratio:g}x the no-tool baseline's and at least {floor:g}",
                     f"{f1:.3f} / {base:.3f} ({best})", f1 >= floor and f1 >= ratio * base))  # fmt: skip
    right = _right_tool(samples[best], kinds)
    share = sum(right) / len(right) if right else 0.0
    rows.append((f"the right tool called first on at least {TOOLS_TARGETS['right_tool']:.0%} of the rows that need one",
                 f"{share:.0%} of {len(right)} rows ({best})", share >= TOOLS_TARGETS["right_tool"]))  # fmt: skip
    if "grpo + tools" in results:
        key = SAMPLED if "grpo + tools" + SAMPLED in results else ""
        gain = results["grpo + tools" + key][1]["f1"] - results["sft + tools" + key][1]["f1"]
        rows.append((f"GRPO at least {TOOLS_TARGETS['grpo_gain'] * 100:g} points of F1 above its SFT start "
                     f"({'sampled' if key else 'greedy'}, test rows)", f"{gain * 100:+.1f} points",
                     gain >= TOOLS_TARGETS["grpo_gain"] - 1e-9))  # fmt: skip
        rows.append(reward_rises(out))
        rows += greedy_kept(as_accuracy["grpo + tools"], as_accuracy["sft + tools"])
    peak = peak_rss_gb()
    rows += [(f"within {TOOLS_TARGETS['minutes']:g} minutes (the Tool-Star runs apart)", f"{total / 60:.1f} min",
              total / 60 <= TOOLS_TARGETS["minutes"]),
             (f"within {TOOLS_TARGETS['memory_gb']:g} GB of RAM", f"{peak:.1f} GB (the largest process's peak RSS)",
              peak <= TOOLS_TARGETS["memory_gb"])]  # fmt: skip
    return rows


def _by_kind(samples: dict[str, list[dict[str, Any]]], kinds: dict[str, str]) -> list[str]:
    """F1 and EM of each policy on each kind of row."""
    lines = ["| policy | " + " | ".join(f"{k} F1 | {k} EM" for k in KINDS) + " |", "|---|" + "---:|" * 2 * len(KINDS)]
    for name, rows in samples.items():
        groups = [[s for s in rows if kinds[s["id"]] == kind] for kind in KINDS]
        cells = [f"{_mean(g, key):.3f}" if g else "-" for g in groups for key in ("f1", "em")]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines


def _tool_choice(samples: dict[str, list[dict[str, Any]]], kinds: dict[str, str]) -> list[str]:
    """Per policy (those with tools) and row kind: the share of episodes whose first call is each tool, none, or another name
    (a garbled one), and the share with the right choice (the row's tool; for direct rows, none)."""
    lines = ["| policy | row kind | episodes | no call | search | code | crop | other | right choice |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, rows in samples.items():
        for kind in KINDS:
            group = [s for s in rows if kinds[s["id"]] == kind]
            if not group:
                continue
            first = Counter(s["tool_calls"][0] if s["tool_calls"] else "none" for s in group)
            shares = [first[t] / len(group) for t in ("none", *TOOLS)]
            right = first["none" if kind == "direct" else kind] / len(group)
            lines.append(f"| {name} | {kind} | {len(group)} | {' | '.join(f'{x:.2f}' for x in shares)} | "
                         f"{1 - sum(shares):.2f} | **{right:.2f}** |")  # fmt: skip
    return lines


# The search-and-code proof.
# Where the second process's jobs end at the defaults (docs/decisions/fixed-step-handovers.md): the baseline's SFT and
# evaluation at 0.49-0.50 of the tool SFT's steps (its rows carry no tool schemas); the SFT policy's evaluations (192
# rows greedy and 4 times sampled) about 95 s into GRPO, where its 8 steps on one thread reach step 6.
SEARCH_CODE = Proof("tool-choice rows (search, code, crop, direct)", tuple(TOOLS), "tools", "synthetic-tools", REWARDS,
                    build_tools_data, warmup, write_report, comparison=toolstar_runs, handovers=(0.5, 0.75))  # fmt: skip
