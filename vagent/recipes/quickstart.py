"""The built-in default job: prove, on a laptop-class CPU with no downloads, that an agent learns to look closer.

    vagent quickstart [--config configs/quickstart/tiny_cpu.yaml] [key=value ...]      (`make run`)

Stages (each with its own progress bar; times are reported):

1. a tiny random Qwen2.5-VL checkpoint, built locally;
2. synthetic zoom tasks: a cluttered image with one colored tile whose 1-px stripes (in one of four
   directions) blur at the model's global resolution but are readable after a crop (some tiles are drawn
   large: no tool needed), split into train, a val set GRPO checks itself on and a held-out test set, with
   gold crop-then-answer trajectories (the crop is the real tool's output);
3. SFT: a warm-up on other images, first perception rows (read the stripes from a gold crop), then
   grounding rows (give the tile's box), each phase checked on the val images; from it the cold start on
   the gold trajectories plus reading rows (the same trajectories with the crop call shown but not
   trained), and a no-tool baseline on the same rows answered directly, for the same number of steps;
4. GRPO from the SFT policy, rewarding accuracy, format, crop IoU with the tile, and tool use only
   when the answer is right; every few steps it answers the val rows greedily, and its best step there,
   the SFT start included, is the GRPO policy;
5. evaluation on the test split: the SFT and GRPO policies with the crop tool, the no-tool baseline,
   and the SFT policy with its tool taken away (on CPU the baseline is trained and evaluated beside the
   crop-tool SFT, and the SFT policy evaluated beside GRPO, each in a second process: ``_Beside``);
6. ``report.md``: the results table, the targets (``TARGETS``) each with what this run measured,
   tool-use statistics (also split into rows that need the tool and rows that do not), loss and reward
   curves (PNG), and links to the HTML viewers of the trajectories with their crops.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image

from vagent.config import QuickstartConfig, config_to_dict, load_config
from vagent.data import load_rows, write_rows
from vagent.eval import BENCHMARKS
from vagent.eval.runner import evaluate, read_samples, write_table
from vagent.model import load_policy
from vagent.recipes import grpo, sft
from vagent.recipes.common import tiny_checkpoint, tool_services
from vagent.recipes.evaluate import bar_chart
from vagent.rollout import RolloutLimits
from vagent.training.metrics import read_metrics

# Warm-up phases (cfg.warmup_phases), each a plain SFT run on other images' rows. Mixed in one run, grounding and
# perception were not learned within the budget; alone, each is (docs/PERFORMANCE.md).
WARMUP = ("grounding", "perception", "reading")
# The warm-up phases whose checkpoints the report checks on the val images' rows of the phase (``_warmup_check``).
CHECKED = ("grounding", "perception")
# The fraction of the crop-tool SFT's steps after which it takes the baseline's thread back. The baseline side
# (its SFT and its evaluation) ends at 0.56-0.62 of the crop-tool SFT on the 2-core machines measured. Where it
# ends later, the crop-tool SFT waits for it there; where it ends sooner, one core idles until that step.
HANDOVER = 0.6
# The fraction of GRPO's steps after which it takes back the thread of the SFT policy's evaluations beside it. At
# seed 0 on the slower 2-core machine the evaluations (192 test rows with the crop tool, 192 without) ended 58 s
# into GRPO, between the starts of its steps 3 (50 s) and 4 (65 s), counting from 1.
GRPO_HANDOVER = 0.25
REWARDS = "{accuracy: 1.0, format: 0.2, crop_iou: 0.5, tool_bonus: 0.2, invalid_calls: 0.2}"
# What the quickstart sets out to show (the report's "Targets" table checks each): the best policy with the crop
# tool answers at least 60% of the test rows and 3x the no-tool baseline; its median crop IoU with the tile, over
# the rows with a small tile (0 where it did not crop), is at least 0.3; GRPO gains 5 points over its SFT start
# with a rising rollout reward; all within 20 minutes and 8 GB.
TARGETS = {"accuracy": 0.60, "ratio": 3.0, "median_iou": 0.3, "grpo_gain": 0.05, "minutes": 20.0, "memory_gb": 8.0}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path = None
    if argv[:1] == ["--config"] and len(argv) > 1:
        config_path, argv = argv[1], argv[2:]
    cfg = load_config(QuickstartConfig, config_path, argv)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t_start = time.perf_counter()

    def stage(n: int, name: str) -> float:
        print(f"\n[{n}/6] {name}  ({time.perf_counter() - t_start:.0f}s so far)", flush=True)
        return time.perf_counter()

    t = stage(1, "tiny checkpoint")
    base = tiny_checkpoint(cfg.model, out)
    policy = load_policy(base, device=cfg.model.device or "cpu")  # its pixel budget and coordinate convention
    times["checkpoint"] = time.perf_counter() - t

    t = stage(2, "synthetic zoom tasks")
    data = _data(cfg, out / "data", policy)
    times["data"] = time.perf_counter() - t
    del policy

    t = stage(3, f"SFT: warm-up ({', '.join(cfg.warmup_phases)}); from it the crop-tool cold start and the no-tool "
                 "baseline")  # fmt: skip
    device = cfg.model.device or "cpu"
    common = [f"model.device={device}", f"seed={cfg.seed}", "data.micro_batch_size=8",
              f"optim.lr={cfg.sft_lr}", "optim.warmup_steps=10", "optim.min_lr_ratio=0.05", "train.precision=fp32",
              "train.save_every=0", "train.resume=auto"]  # fmt: skip
    from data_pipelines.synthetic.zoom import GLYPHS

    start, checks = base, {}
    what = GLYPHS[cfg.glyph][0]  # "stripes", "digit": what the perception check reads
    for run, phase, epochs in _warmup_runs(cfg):  # shared: the baseline gets the same budget
        start = sft.train(load_config(sft.SFTConfig, None, [
            f"out_dir={out / run}", f"model.path={start}", f"data.train={data[f'warmup_{phase}']}",
            f"train.epochs={epochs}", *common]))  # fmt: skip
        if f"check_{phase}" in data:  # right after its phase: a later phase wears its skill down
            check = _warmup_check(run, phase, what, start, data[f"check_{phase}"], out, device)
            if check:
                checks[run] = check
    common += [f"model.path={start}", f"train.epochs={cfg.sft_epochs}"]
    rollout = config_to_dict(cfg.rollout)
    test_rows = load_rows(data["test"])
    evaluation = dict(test_rows=test_rows, out=str(out), rollout=rollout, toolbox=cfg.toolbox, device=device)
    notool_args = [f"out_dir={out / 'sft-notool'}", "data.tools=[]", f"data.train={data['sft_mix_notool']}", *common]
    baseline = _Beside.start(cfg.parallel_baseline, device, out / "sft-notool" / "log.txt",
                             "the no-tool baseline's SFT and evaluation", _baseline, notool_args,
                             evaluation)  # fmt: skip
    try:
        sft_model = sft.train(load_config(sft.SFTConfig, None, [f"out_dir={out / 'sft'}", f"data.train={data['sft_mix']}",
                                                                *common]),
                              before_step=baseline.hand_over(HANDOVER) if baseline else None)  # fmt: skip
        notool_model, notool_eval = baseline.result() if baseline else _baseline(notool_args, None)
    finally:
        if baseline:
            baseline.stop()
    times["sft"] = time.perf_counter() - t

    t = stage(4, "GRPO from the SFT policy")
    # The SFT policy's evaluations run beside GRPO (on CPU, with parallel_eval), the rest after it.
    sft_runs = {"sft + crop": (sft_model, ["crop"]), "sft, tool taken away": (sft_model, [])}
    beside = _Beside.start(cfg.parallel_eval and cfg.grpo_steps > 0, device, out / "eval" / "log-sft.txt",
                           "the SFT policy's evaluations, with its tool and without", _evaluate_runs, sft_runs,
                           evaluation)  # fmt: skip
    try:
        grpo_model = None
        if cfg.grpo_steps:
            grpo_model = grpo.train(load_config(grpo.GRPOConfig, None, [
                f"out_dir={out / 'grpo'}", f"model.path={sft_model}", f"model.device={device}",
                f"seed={cfg.seed}", f"data.train={data['train']}", f"train.max_steps={cfg.grpo_steps}",
                f"grpo.group_size={cfg.group_size}", f"grpo.prompts_per_step={cfg.prompts_per_step}",
                "grpo.micro_batch_size=8", f"grpo.rollout_batch_size={cfg.group_size * cfg.prompts_per_step}",
                f"grpo.negative_scale={cfg.grpo_negative_scale}", f"optim.lr={cfg.grpo_lr}", "train.precision=fp32",
                "train.save_every=0", "train.resume=auto", f"rewards.weights={REWARDS}",
                *(f"rollout.{k}={json.dumps(v)}" for k, v in rollout.items()),
                *([f"val.rows={data['val']}", f"val.every={cfg.grpo_val_every}", "val.keep_best=true"]
                  if cfg.val_rows else []),
            ]), before_step=beside.hand_over(GRPO_HANDOVER) if beside else None)  # fmt: skip
        times["grpo (SFT evaluated beside it)" if beside else "grpo"] = time.perf_counter() - t

        t = stage(5, "evaluation on the held-out test split")
        sft_evals = beside.result() if beside else _evaluate_runs(sft_runs, evaluation)
    finally:
        if beside:
            beside.stop()
    results = {"sft + crop": sft_evals["sft + crop"],
               "no-tool baseline": notool_eval or _evaluate("no-tool baseline", notool_model, [], **evaluation),
               "sft, tool taken away": sft_evals["sft, tool taken away"]}  # fmt: skip
    if grpo_model is not None:  # last: when it kept its SFT start, that policy's evaluation is already there
        if _same_weights(grpo_model, sft_model):
            print("GRPO kept its SFT start (no step beat it on the val rows): its evaluation is SFT + crop's")
            grpo_eval = results["sft + crop"]
        else:
            grpo_eval = _evaluate("grpo + crop", grpo_model, ["crop"], **evaluation)
        results = {"grpo + crop": grpo_eval, **results}
    times["eval"] = time.perf_counter() - t

    t = stage(6, "report")
    times["report"] = 0.0
    report = _report(cfg, out, results, test_rows, checks, times, time.perf_counter() - t_start)
    times["report"] = time.perf_counter() - t
    print(report)
    print(f"\nwrote {out / 'report.md'}; open the trajectories.html files it links to see the crops.")
    return 0


def _same_weights(a: Path, b: Path) -> bool:
    """Whether two HF model dirs hold the same weight files, byte for byte."""
    from vagent.training.checkpoint import file_digest

    files = sorted(p.name for p in Path(a).glob("*.safetensors"))
    return (
        bool(files)
        and files == sorted(p.name for p in Path(b).glob("*.safetensors"))
        and all(file_digest(Path(a) / f) == file_digest(Path(b) / f) for f in files)
    )


def _evaluate(name: str, model_dir: Path, tools: list[str], *, test_rows: list, out: str, rollout: dict[str, Any],
              toolbox: Any, device: str) -> tuple[Path, dict[str, Any]]:  # fmt: skip
    """One policy on the test split, greedy: (its eval dir, its metrics)."""
    limits = RolloutLimits(**{k: v for k, v in rollout.items() if k not in ("tools", "agent")} | {"temperature": 0.0})
    run_dir = Path(out) / "eval" / name.replace(" ", "-").replace(",", "").replace("+", "with")
    policy = load_policy(model_dir, device=device)
    return run_dir, evaluate(policy, BENCHMARKS["synthetic"], test_rows, run_dir, tools=tools, limits=limits,
                             batch_size=16, services=tool_services(toolbox), label=name,
                             agent=rollout.get("agent", "vagent"))  # fmt: skip


def _warmup_check(run: str, phase: str, what: str, model_dir: Path, rows_path: Path, out: Path,
                  device: str) -> dict | None:  # fmt: skip
    """A warm-up phase's checkpoint on the val images' rows of that phase (the grounding phase: the tile's box;
    perception: the glyph, ``what``, read from the gold crop), greedy. Each phase's loss sits on a plateau (the format
    learned, the skill not) for a few hundred steps before it drops, after a number of steps that varies with the
    draw; a phase that stops on it leaves its skill to the crop-tool SFT (docs/PERFORMANCE.md). Returns the
    scores (IoU or accuracy) per gold answer and the distinct answers; None when no val image has a small tile."""
    if not rows_path.stat().st_size:
        return None
    rows = load_rows(rows_path)
    run_dir = out / "eval" / run
    limits = RolloutLimits(max_turns=1, max_new_tokens=32, temperature=0.0)
    evaluate(load_policy(model_dir, device=device), BENCHMARKS["synthetic"], rows, run_dir, tools=[], limits=limits,
             batch_size=16, label=f"{run}: {len(rows)} val rows")  # fmt: skip
    samples = read_samples(run_dir / "samples.jsonl")
    scores: dict[str, list[float]] = {}
    for s in samples:
        scores.setdefault(str(s["gold"][0]) if phase == "perception" else "box", []).append(s["accuracy"])
    check = {"phase": phase, "what": what, "scores": scores,
             "answers": len({str(s["prediction"]) for s in samples if s["prediction"] is not None})}  # fmt: skip
    print(f"{run}: {_check_line(check)}", flush=True)
    return check


def _check_line(check: dict[str, Any]) -> str:
    """One line saying what a warm-up phase learned, and what it did not (``_warmup_check``)."""
    scores = check["scores"]
    if check["phase"] == "grounding":
        ious = scores["box"]
        hit = sum(i >= 0.5 for i in ious) / len(ious)
        line = (f"the tile's box on {len(ious)} val images (greedy): mean IoU {sum(ious) / len(ious):.2f}, IoU >= 0.5 "
                f"for {hit:.0%}, {check['answers']} distinct box{'' if check['answers'] == 1 else 'es'}")  # fmt: skip
        if hit < 0.5:
            line += (" - it has not learned where the tile is (its loss is still on the plateau), so the crop-tool "
                     "SFT has to; a longer grounding phase (its number in warmup_epochs) usually gets past it")  # fmt: skip
        return line
    n = sum(len(v) for v in scores.values())
    right = sum(sum(v) for v in scores.values())
    line = (f"the {check['what']} read from the gold crop on {n} val images (greedy): accuracy {right / n:.2f} ("
            + ", ".join(f"{gold} {sum(v):.0f}/{len(v)}" for gold, v in sorted(scores.items())) + ")")  # fmt: skip
    missed = [gold for gold, v in sorted(scores.items()) if sum(v) < 0.5 * len(v)]
    if missed:
        line += (f" - it does not read {' or '.join(missed)} (its loss is still on the plateau), so the crop-tool SFT "
                 "has to; a longer perception phase (its number in warmup_epochs) may get past it (after a grounding "
                 "phase it stays on the plateau longer: docs/PERFORMANCE.md)")  # fmt: skip
    return line


def _evaluate_runs(runs: dict[str, tuple[Path, list[str]]], evaluation: dict[str, Any]) -> dict[str, tuple[Path, dict]]:
    """``_evaluate`` each of ``runs`` (name: (model dir, tools)), one after the other."""
    return {name: _evaluate(name, model_dir, tools, **evaluation) for name, (model_dir, tools) in runs.items()}


def _baseline(sft_args: list[str], evaluation: dict[str, Any] | None) -> tuple[Path, tuple[Path, dict] | None]:
    """Train the no-tool baseline and, given ``evaluation``, evaluate it: (its model dir, its evaluation)."""
    model_dir = sft.train(load_config(sft.SFTConfig, None, sft_args))
    return model_dir, _evaluate("no-tool baseline", model_dir, [], **evaluation) if evaluation else None


class _Beside:
    """A job in a second process on half the CPU threads, beside the main process on the other half.

    On 2 cores the tiny model's steps use two threads poorly, so two trainings side by side, one thread each,
    finish 1.3-1.5x sooner than one after the other on both (``benchmarks/cpu_step.py``). The job is the shorter
    side; ``hand_over`` lets the main side's training take the job's threads back at a fixed step, after waiting
    for the job if it is not done. A fixed step, not whenever the job happens to end: the thread count changes
    the floating-point sums, so a seed gives the same numbers however the two sides' timing falls. The job's
    output goes to ``log``; its result (or its traceback) comes back through a pipe, and ``stop`` ends it if the
    main process gives up first.
    """

    def __init__(self, process, conn, log: Path, threads: int, what: str) -> None:
        self.process, self.conn, self.log, self.threads, self.what = process, conn, log, threads, what
        self.done, self.value = False, None

    @classmethod
    def start(cls, on: bool, device: str, log: Path, what: str, fn, *args) -> _Beside | None:
        """Start ``fn(*args)`` beside this process; ``what`` names it in messages. None (run it in this process)
        unless ``on``, on CPU, with two threads or more."""
        import multiprocessing

        import torch

        total = torch.get_num_threads()
        if not on or device != "cpu" or total < 2:
            return None
        log.parent.mkdir(parents=True, exist_ok=True)
        context = multiprocessing.get_context("spawn")  # a clean interpreter: no forked torch thread pools
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_beside_main, args=(send, total // 2, str(log), fn, args), daemon=True)
        process.start()
        send.close()  # the child holds the only write end: its death reads as EOF
        torch.set_num_threads(total - total // 2)
        print(f"beside it, in process {process.pid} on {total // 2} of {total} CPU threads: {what} (log: {log})",
              flush=True)  # fmt: skip
        return cls(process, receive, log, total, what)

    def result(self) -> Any:
        """The job's return value, once it ends (then this process has all the threads again)."""
        import torch

        if self.done:
            return self.value
        print(f"waiting for {self.what} (log: {self.log})", flush=True)
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.process.join()
            status, value = "error", f"the process ended without a result (exit code {self.process.exitcode})"
        torch.set_num_threads(self.threads)
        if status != "ok":
            raise RuntimeError(f"{self.what} failed; its log is {self.log}:\n{value}")
        self.done, self.value = True, value
        return value

    def hand_over(self, at: float):
        """A ``before_step`` hook for the main side's training (SFT or GRPO): from the fraction ``at`` of its steps
        on, it runs on all the threads (waiting for the job first if the job is still running)."""

        def before_step(step: int, total_steps: int) -> None:
            if not self.done and step >= at * total_steps:
                self.result()

        return before_step

    def stop(self) -> None:
        import torch

        torch.set_num_threads(self.threads)
        if self.process.is_alive():
            self.process.terminate()
        self.process.join()


def _beside_main(conn, threads: int, log: str, fn, args) -> None:
    import traceback

    import torch

    with open(log, "a", buffering=1) as f:  # the job's prints, progress bars and warnings, fd-level included
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        sys.stdout = sys.stderr = f
        torch.set_num_threads(threads)
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        finally:
            conn.close()


def _warmup_runs(cfg: QuickstartConfig) -> list[tuple[str, str, float]]:
    """(run directory name, phase, epochs) of each warm-up SFT run, in order; a phase named twice gets a numbered
    run; a phase given 0 epochs is skipped."""
    if not cfg.warmup_rows:
        return []
    phases = cfg.warmup_phases
    return [(f"sft-warmup-{phase}" + (f"-{i + 1}" if phases.count(phase) > 1 else ""), phase, n)
            for i, (phase, n) in enumerate(zip(phases, cfg.phase_epochs(), strict=True)) if n > 0]  # fmt: skip


def _data(cfg: QuickstartConfig, out: Path, policy) -> dict[str, Path]:
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
    if all(p.is_file() for p in paths.values()):
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
    warmup = _support_rows(pool, policy)
    notool = []
    for row in train:  # the same images and answers, answered without looking closer
        answer = f"<think>The {row.extra['color']} tile shows {row.answer}.</think>\n"
        notool.append(row.__class__(**{**row.__dict__, "tools": [],
                                       "messages": [{"role": "assistant", "content": f"{answer}<answer>{row.answer}</answer>"}]}))  # fmt: skip
    support = _support_rows(train, policy)
    reading = [r for r in support if r.source.endswith("reading")]
    shared = [r for r in support if not r.source.endswith("reading")]  # perception and grounding: both mixes
    # The crop-tool mix reads each crop once more in the trajectory's context (without it the policy found the tile
    # but mostly did not read its own crop: docs/PERFORMANCE.md); for the same number of rows and steps, the
    # baseline answers those images directly once more.
    again = [
        r.__class__(**{**r.__dict__, "id": f"{r.id}-again"}) for r in notool if not r.extra["difficulty"]["direct"]
    ]
    write_rows(test, paths["test"])
    if cfg.val_rows:
        write_rows(val, paths["val"])
        checked = _support_rows(val, policy)
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
    return paths


def _support_rows(train, policy) -> list:
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
        crop = next(p["path"] for p in row.messages[1]["content"] if p["type"] == "image")
        rows.append(row.__class__(id=f"{row.id}-read", question=row.question, answer=row.answer, answer_type="exact",
                                  images=[crop], tools=[], source="synthetic/zoom-perception",
                                  messages=[{"role": "assistant", "content": f"<answer>{row.answer}</answer>"}]))  # fmt: skip
        rows.append(row.__class__(**{**row.__dict__, "id": f"{row.id}-look", "source": "synthetic/zoom-reading",
                                     "messages": [{**row.messages[0], "train": False}, *row.messages[1:]]}))  # fmt: skip
        tile = row.evidence.boxes[0]
        with Image.open(row.images[0]) as image:
            size = image.size
        box = model_box(tile, size, **policy.frame)
        rows.append(row.__class__(id=f"{row.id}-ground", question=f"Where is the small {row.extra['color']} tile? Give its box.",
                                  answer=tile, answer_type="box", images=list(row.images), tools=[],
                                  source="synthetic/zoom-grounding",
                                  messages=[{"role": "assistant", "content": f"<answer>{box}</answer>"}]))  # fmt: skip
    return rows


def _report(cfg: QuickstartConfig, out: Path, results: dict[str, tuple[Path, dict[str, Any]]], test_rows,
            checks: dict[str, dict[str, Any]], times: dict[str, float], total: float) -> str:  # fmt: skip
    names = list(results)
    metrics = [m for _, m in results.values()]
    bar_chart(metrics, names, out / "results.png", title="held-out test split")
    _curves(cfg, out)
    direct = {r.id for r in test_rows if r.extra.get("difficulty", {}).get("direct")}
    split_lines = []
    samples = {name: read_samples(run_dir / "samples.jsonl") for name, (run_dir, _) in results.items()}
    for name, rows in samples.items():
        small = [s for s in rows if s["id"] not in direct]
        large = [s for s in rows if s["id"] in direct]

        def rate(group):
            return f"{sum(1 for s in group if s['tool_calls']) / len(group):.2f}" if group else "-"

        def acc(group):
            return f"{sum(s['accuracy'] for s in group) / len(group):.2f}" if group else "-"

        split_lines.append(f"| {name} | {acc(small)} | {rate(small)} | {acc(large)} | {rate(large)} |")
    baseline = results["no-tool baseline"][1]["accuracy"]
    best = max((n for n in names if n.endswith("+ crop")), key=lambda n: results[n][1]["accuracy"])
    low, high = wilson_interval(sum(s["accuracy"] for s in samples[best]), len(samples[best]))
    learned = [f"- {run}: {_check_line(check)}." for run, check in checks.items()]
    if learned:
        learned = ["## What the warm-up learned", "", *learned, ""]
    lines = [
        "# vagent quickstart report",
        "",
        f"Total time **{total / 60:.1f} min** on this machine ({', '.join(f'{k} {v:.0f}s' for k, v in times.items())}).",
        f"Policy: a random tiny Qwen2.5-VL ({cfg.model.tiny.size} preset) trained from scratch on "
        f"{cfg.train_rows} synthetic zoom rows; {len(test_rows)} held-out test rows ({len(direct)} with a large, "
        "readable tile). Greedy decoding.",
        "",
        "## Results on the held-out test split",
        "",
        write_table(metrics, None, names),
        "![results](results.png)",
        "",
        f"Best policy with a tool: **{best}** (accuracy {results[best][1]['accuracy']:.2f}, 95% interval "
        f"{low:.2f}-{high:.2f} over {len(samples[best])} rows) vs the no-tool baseline {baseline:.2f} (chance is "
        f"{'0.25 for stripes' if cfg.glyph == 'stripes' else '0.10 for a digit'}).",
        "",
        *_grpo_vs_sft(samples),
        *_grpo_kept(out, cfg.val_rows),
        "## Targets",
        "",
        *_targets(cfg, results, samples, best, direct, out, total),
        "",
        "## Which answers does each policy get right?",
        "",
        *_per_answer(samples),
        "",
        "## Does the agent look closer when it needs to?",
        "",
        "| policy | accuracy, small tile | tool use, small tile | accuracy, large tile | tool use, large tile |",
        "|---|---:|---:|---:|---:|",
        *split_lines,
        "",
        *learned,
        "## Training curves",
        "",
        "![SFT loss](sft_loss.png)",
        "",
        "![GRPO](grpo.png)" if (out / "grpo.png").is_file() else "(GRPO was skipped.)",
        "",
        "## Trajectories",
        "",
        *[
            f"- {name}: [{run_dir.relative_to(out)}/trajectories.html]({run_dir.relative_to(out)}/trajectories.html)"
            for name, (run_dir, _) in results.items()
        ],
        "",
        "Metrics: `accuracy` = exact answer; `crop_iou` = best IoU of a crop with the tile (0 without a crop); "
        "`tool_calls` = calls per sample. Per-sample records are in each run's `samples.jsonl`.",
        "",
    ]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a success rate: unlike p +- z*se it stays inside [0, 1] and is honest at
    the few dozen rows a quick evaluation has."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _grpo_vs_sft(samples: dict[str, list[dict[str, Any]]]) -> list[str]:
    """GRPO against its own SFT start on the same rows: which rows it fixed and which it broke."""
    if "grpo + crop" not in samples:
        return []
    sft_right = {s["id"]: s["accuracy"] for s in samples["sft + crop"]}
    fixed = sum(1 for s in samples["grpo + crop"] if s["accuracy"] > sft_right.get(s["id"], 1.0))
    broke = sum(1 for s in samples["grpo + crop"] if s["accuracy"] < sft_right.get(s["id"], 0.0))
    return [f"GRPO against its SFT start on the same rows: {fixed} answered right that SFT got wrong, {broke} "
            "the other way round.", ""]  # fmt: skip


def _targets(cfg: QuickstartConfig, results: dict[str, tuple[Path, dict[str, Any]]],
             samples: dict[str, list[dict[str, Any]]], best: str, direct: set[str], out: Path,
             total: float) -> list[str]:  # fmt: skip
    """The table of ``TARGETS`` for ``best``, the best policy with the crop tool: each target, what this run
    measured, and whether it is met."""
    import resource
    import statistics

    accuracy, baseline = results[best][1]["accuracy"], results["no-tool baseline"][1]["accuracy"]
    ious = [s["crop_iou"] or 0.0 for s in samples[best] if s["id"] not in direct]
    median_iou = statistics.median(ious) if ious else 0.0
    rows = [
        (f"with-tools accuracy >= {TARGETS['accuracy']:.2f}", f"{accuracy:.3f} ({best})",
         accuracy >= TARGETS["accuracy"]),
        (f"at least {TARGETS['ratio']:g}x the no-tool baseline",
         f"{accuracy / baseline:.1f}x ({accuracy:.3f} / {baseline:.3f})" if baseline else f"{accuracy:.3f} / 0",
         accuracy >= TARGETS["ratio"] * baseline),
        (f"median crop IoU with the tile >= {TARGETS['median_iou']:g} (small-tile rows, 0 without a crop)",
         f"{median_iou:.2f} ({best}, {len(ious)} rows)", median_iou >= TARGETS["median_iou"]),
    ]  # fmt: skip
    if "grpo + crop" in results:
        gain = results["grpo + crop"][1]["accuracy"] - results["sft + crop"][1]["accuracy"]
        rows.append((f"GRPO at least {TARGETS['grpo_gain'] * 100:g} points above its SFT start",
                     f"{gain * 100:+.1f} points", gain >= TARGETS["grpo_gain"] - 1e-9))  # fmt: skip
        rewards = [r["reward"] for r in read_metrics(out / "grpo" / "metrics.jsonl") if "reward" in r]
        third = max(1, len(rewards) // 3)
        first, last = sum(rewards[:third]) / third, sum(rewards[-third:]) / third
        rows.append(("GRPO's rollout reward rises (mean of its last third of steps over its first third)",
                     f"{first:.2f} -> {last:.2f} over {len(rewards)} steps", len(rewards) > 1 and last > first))  # fmt: skip
    # ru_maxrss is in KiB on Linux; the children are the processes run beside the main one
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 2**20
    rows += [(f"within {TARGETS['minutes']:g} minutes", f"{total / 60:.1f} min", total / 60 <= TARGETS["minutes"]),
             (f"within {TARGETS['memory_gb']:g} GB of RAM", f"{peak:.1f} GB (the largest process's peak RSS)",
              peak <= TARGETS["memory_gb"])]  # fmt: skip
    met = sum(ok for _, _, ok in rows)
    return ["| target | measured | met |", "|---|---|---|",
            *[f"| {target} | {measured} | {'yes' if ok else '**no**'} |" for target, measured, ok in rows],
            "", f"{met} of {len(rows)} targets met at seed {cfg.seed} (another seed, or another CPU's float sums, is "
            "another draw: docs/PERFORMANCE.md gives several)."]  # fmt: skip


def _grpo_kept(out: Path, val_rows: int) -> list[str]:
    """Which GRPO step the report's GRPO policy is, and the validation accuracy of each step checked."""
    records = [r for r in read_metrics(out / "grpo" / "metrics.jsonl") if "val/accuracy" in r]
    if not records:
        return []
    best = records[-1].get("val/best_step", records[-1]["step"])
    checks = ", ".join(f"step {r['step']} {r['val/accuracy']:.2f}" for r in records)
    kept = "its SFT start: no GRPO step beat it" if best == 0 else f"step {best}"
    return [f"GRPO policy = {kept} (greedy accuracy on the {val_rows} val rows: {checks}).", ""]


def _per_answer(samples: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Accuracy per gold answer (rows: policies): a policy that guesses one answer shows it here, not in the mean."""
    golds = sorted({str(s["gold"][0]) for rows in samples.values() for s in rows if s["gold"]})
    if not golds or len(golds) > 8:
        return [f"({'no gold answers' if not golds else 'too many distinct answers'} to tabulate)"]
    lines = [f"| policy | {' | '.join(golds)} | most given answer |", f"|---|{'---:|' * len(golds)}---|"]
    for name, rows in samples.items():
        cells = []
        for gold in golds:
            group = [s["accuracy"] for s in rows if s["gold"] and str(s["gold"][0]) == gold]
            cells.append(f"{sum(group) / len(group):.2f} ({len(group)})" if group else "-")
        given = Counter(str(s["prediction"]) for s in rows if s["prediction"])
        top = given.most_common(1)
        text = " ".join(top[0][0].split())[:24].replace("|", "\\|") if top else ""
        share = f"`{text}` ({top[0][1] / len(rows):.0%})" if top else "-"
        lines.append(f"| {name} | {' | '.join(cells)} | {share} |")
    return lines


def _running_mean(values: list[float], n: int) -> list[float]:
    """Mean of each value and the ``n - 1`` before it (fewer at the start)."""
    means = []
    for i in range(len(values)):
        window = values[max(0, i - n + 1) : i + 1]
        means.append(sum(window) / len(window))
    return means


def _curves(cfg: QuickstartConfig, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    offset = 0  # each warm-up phase continues from the last; both SFT runs from the end of the warm-up
    for name in (*(run for run, _, _ in _warmup_runs(cfg)), "sft", "sft-notool"):
        records = [r for r in read_metrics(out / name / "metrics.jsonl") if "loss" in r]
        steps, losses = [offset + r["step"] for r in records], [r["loss"] for r in records]
        # one micro-batch's loss swings by two orders of magnitude (its rows' kinds differ): faint per-step
        # points, and their running mean of 25 steps as the line to read (both SFT runs overlap in steps)
        (line,) = ax.plot(steps, losses, alpha=0.2, linewidth=0.6)
        ax.plot(steps, _running_mean(losses, 25), color=line.get_color(), label=name)
        if records and name.startswith("sft-warmup"):
            offset += records[-1]["step"]
    ax.set_xlabel("step")
    ax.set_ylabel("loss (trained tokens)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("SFT: loss per step (faint), its running mean of 25 (lines)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "sft_loss.png", dpi=110)
    plt.close(fig)
    records = read_metrics(out / "grpo" / "metrics.jsonl")
    if records:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        val = [r for r in records if "val/accuracy" in r]
        records = [r for r in records if "reward" in r]
        steps = [r["step"] for r in records]
        for key in ("reward", "accuracy", "reward/crop_iou", "tool_calls_per_traj"):
            values = [r.get(key, float("nan")) for r in records]
            (line,) = ax.plot(steps, values, label=key, marker=".", alpha=0.35)
            # each point is one step's few rollouts; the trend is their running mean (as TensorBoard smooths)
            ax.plot(steps, _running_mean(values, 4), color=line.get_color())
        if val:
            ax.plot([r["step"] for r in val], [r["val/accuracy"] for r in val], "k--s", label="val accuracy (greedy)")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.set_title("GRPO: rollout mean per step (dots), its running mean of 4 (lines)"
                     + ("\nand greedy accuracy on held-out val rows (squares)" if val else ""), fontsize=9)  # fmt: skip
        fig.tight_layout()
        fig.savefig(out / "grpo.png", dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
