"""Train a judge, serve it, train a policy against it: UnifiedReward-Think's three stages and the closed loop on a
CPU, at toy scale, with no downloads.

    python -m quickstart.judge [--config YAML] [key=value ...]

Stages, each the documented command's own code (docs/guide/judges.md):

1. a tiny random Qwen2.5-VL checkpoint and synthetic judgments (``data_pipelines.synthetic.judgments``: which of
   two answers names the digit on the tile; the judge sees the true digit as the reference answer);
2. cold start: a teacher's CoT judgments of ``cold_rows`` rows, kept where they match the label
   (``data_pipelines.judgments``), then SFT. The teacher is ``teacher_url`` (any OpenAI-compatible model) or,
   without one, a rule that reads the reference and the two answers from the prompt (a stand-in for a strong
   model, served on a local port so the real client is used);
3. rejection sampling: the cold-start judge judges ``train_rows`` rows ``rs_samples`` times; its well-formed
   judgments that match the label (``judgment`` reward 1, ``data_pipelines.distill``) are the SFT data of the
   next model, trained from the cold start;
4. GRPO on the rows that model still gets wrong (``data_pipelines.hard_rows``: the share of ``hard_samples``
   samples whose verdict matches the label below ``hard_below``), rewarded by ``judgment``;
5. ``vagent eval --benchmark judge-pairs`` of every stage's judge on ``test_rows`` held-out pairs, both orders;
6. the closed loop: the final judge behind ``vagent serve``, and one GRPO step of a policy (the tiny model after
   ``policy_sft_steps`` SFT steps answering the tile questions) whose ``judge`` reward asks it with the prompt it
   was trained on (``judge.prompt: judgment``);
7. ``report.md`` and ``report.json``: agreement, unparseable verdicts and position bias per stage, and the loop's
   judge rewards and failures.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from vagent.config import (
    GRPOAlgoConfig,
    GRPOConfig,
    GRPODataConfig,
    JudgeConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    SFTConfig,
    SFTDataConfig,
    TinyModelConfig,
    TrainConfig,
    check_config,
    load_config,
    option,
)
from vagent.serve.launch import start_server, stop_server

__all__ = ["TOY_TEMPLATE", "JudgeQuickstartConfig", "main", "toy_teacher_reply"]

# A short judge prompt: the toy judge learns its task from the rows, not from instructions.
TOY_TEMPLATE = (
    "Which answer is better?\nQuestion: {question}\n{reference_line}Answer 1: {response1}\nAnswer 2: {response2}"
)


@dataclass
class JudgeQuickstartConfig:
    out_dir: str = option("runs/judge-quickstart", "Everything it writes: data, checkpoints, evals, report.md.")
    seed: int = option(0, "Seed of the data, the training order and sampling.")
    model: ModelConfig = option(ModelConfig(), "Judge to start from: path null builds the random tiny one (`tiny`).")
    tiny: TinyModelConfig = option(
        TinyModelConfig(size="small", rope_theta=10.0),
        "The random checkpoint built when model.path is null (RoPE base 10: sharp relative positions, for copying the "
        "digits into the reasoning).",
    )
    cold_rows: int = option(1200, "Rows the teacher judges for the cold start.")
    train_rows: int = option(1536, "Rows of rejection sampling (the accuracy filter samples the first hard_rows).")
    test_rows: int = option(48, "Held-out pairs every stage's judge is evaluated on (each judged both ways).")
    questions: int = option(16, "Tile questions the policy of the closed loop answers.")
    digits: list[int] = option(
        [3, 4, 5, 6, 7, 8, 9],
        "The digits the tiles show: never 1 or 2, the answers' numbers, which share their tokens.",
    )
    phrases: list[str] = option(
        ["The tile shows {digit}."], "How the judged answers (and the loop's policy) name a digit ({digit})."
    )
    template: str | None = option(
        TOY_TEMPLATE,
        "The judge prompt's template, for the rows and for the loop's judge reward alike (null: vagent's default, "
        "142 tokens of this tiny tokenizer where this one takes 52, so every step is slower).",
    )
    teacher_url: str | None = option(None, "OpenAI-compatible teacher; null = the rule-based toy teacher.")
    teacher_model: str | None = option(None, "Model id at teacher_url (null: the first it lists).")
    lr: float = option(1e-3, "Peak learning rate of the SFT runs (10 warm-up steps, cosine down to a tenth).")
    cold_steps: int = option(
        150,
        "SFT steps of the cold start (micro-batches of 8): the format and copying the digits, not yet comparing them.",
    )
    rs_samples: int = option(2, "Judgments sampled per row in rejection sampling.")
    rs_steps: int = option(600, "SFT steps on the kept judgments, from the cold start.")
    hard_rows: int = option(256, "Rows (the first of train_rows) the accuracy filter samples.")
    hard_samples: int = option(4, "Samples per row of the accuracy filter.")
    hard_below: float = option(1.0, "GRPO trains on rows whose accuracy over hard_samples is below this.")
    grpo_steps: int = option(12, "GRPO steps of the judge on the rows it still gets wrong.")
    grpo_lr: float = option(1e-4, "GRPO's learning rate.")
    temperature: float = option(1.0, "Sampling temperature of rejection sampling, the filter and GRPO.")
    max_new_tokens: int = option(96, "Tokens a judgment may take.")
    policy_sft_steps: int = option(30, "SFT steps teaching the loop's policy the answer format before its GRPO step.")
    policy_grpo_steps: int = option(1, "GRPO steps of the policy against the served judge.")
    threads: int | None = option(
        None, "torch CPU threads (null: torch's default). On a busy CPU, 1 can be many times faster."
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m quickstart.judge [--config YAML] [key=value ...]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path = None
    if argv[:1] == ["--config"] and len(argv) > 1:
        config_path, argv = argv[1], argv[2:]
    report = run(load_config(JudgeQuickstartConfig, config_path, argv))
    print(report)
    return 0


def run(cfg: JudgeQuickstartConfig) -> str:
    """All stages (see the module docstring); returns the report's markdown (also in ``out_dir/report.md``)."""
    from data_pipelines import distill, hard_rows
    from data_pipelines.synthetic.judgments import judgment_rows, question_rows
    from vagent.data import write_rows
    from vagent.recipes import grpo, sft
    from vagent.training.metrics import read_metrics

    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    clock = time.perf_counter()

    def stage(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        times[name] = now - clock
        clock = now
        print(f"[judge quickstart] {name}: {times[name]:.0f}s", flush=True)

    base = _checkpoint(cfg, out)
    data = out / "data"
    paths = {name: data / f"{name}.jsonl" for name in ("cold", "train", "filtered", "test", "questions")}
    task = {"phrases": tuple(cfg.phrases), "template": cfg.template, "digits": tuple(cfg.digits)}
    write_rows(judgment_rows(data, cfg.cold_rows, seed=cfg.seed, **task), paths["cold"])
    train = judgment_rows(data, cfg.train_rows, seed=cfg.seed + 1, **task)
    write_rows(train, paths["train"])
    write_rows(train[: cfg.hard_rows], paths["filtered"])
    write_rows(judgment_rows(data, cfg.test_rows, seed=cfg.seed + 2, **task), paths["test"])
    write_rows(question_rows(data, cfg.questions, seed=cfg.seed + 3, digits=tuple(cfg.digits)), paths["questions"])
    stage("checkpoint and data")

    teacher_rows = _teach(cfg, paths["cold"], out / "teacher")
    cold = sft.train(_sft_config(cfg, out / "cold-start", base, teacher_rows, cfg.cold_steps))
    stage("cold start (teacher + SFT)")

    sampling = ["--samples", str(cfg.rs_samples), "--tools", "none", "--max-turns", "1",
                "--max-new-tokens", str(cfg.max_new_tokens), "--temperature", str(cfg.temperature),
                "--seed", str(cfg.seed), "--batch-size", "32", "--rewards", "judgment=1.0"]  # fmt: skip
    distill.main(["--model", str(cold), "--data", str(paths["train"]), "--out", str(out / "rejection-sampling"),
                  "--min-reward", "1.0", "--per-row", str(cfg.rs_samples), *sampling])  # fmt: skip
    rs = sft.train(_sft_config(cfg, out / "rs-sft", cold, out / "rejection-sampling" / "rows.jsonl", cfg.rs_steps))
    stage("rejection sampling (distill + SFT)")

    hard = out / "hard.jsonl"
    sampling[1] = str(cfg.hard_samples)
    hard_rows.main(["--model", str(rs), "--data", str(paths["filtered"]), "--out", str(hard), "--correct-at", "1.0",
                    "--below", str(cfg.hard_below), "--reward-options", "judgment.format_weight=0", *sampling])  # fmt: skip
    final = grpo.train(_judge_grpo_config(cfg, out / "grpo", rs, hard))
    stage("GRPO on the rows it still gets wrong")

    evals = {name: _evaluate(model, paths["test"], out / "eval" / name)
             for name, model in (("cold start", cold), ("rejection sampling", rs), ("grpo", final))}  # fmt: skip
    stage("judge-pairs evaluations")

    loop = _closed_loop(cfg, out, base, final, paths["questions"])
    stage("closed loop (serve + policy GRPO)")
    grpo_steps = read_metrics(out / "grpo" / "metrics.jsonl")
    stages = {
        "teacher judgments kept": _count(teacher_rows),
        "own judgments kept": _count(out / "rejection-sampling" / "rows.jsonl"),
        "rows still wrong": _count(hard),
        "grpo reward, first and last step": [grpo_steps[0]["reward/judgment"], grpo_steps[-1]["reward/judgment"]],
    }
    return _report(cfg, out, evals, stages, loop, times)


def _count(rows: Path) -> int:
    return sum(1 for line in rows.read_text().splitlines() if line.strip())


def _checkpoint(cfg: JudgeQuickstartConfig, out: Path) -> Path:
    if cfg.model.path:
        return Path(cfg.model.path)
    from vagent.tiny_model import build_tiny_checkpoint

    target = out / f"tiny-{cfg.tiny.family}-{cfg.tiny.size}"
    if not (target / "config.json").is_file():
        build_tiny_checkpoint(target, family=cfg.tiny.family, size=cfg.tiny.size, vocab=cfg.tiny.vocab,
                              vocab_size=cfg.tiny.vocab_size, seed=cfg.tiny.seed, rope_theta=cfg.tiny.rope_theta)  # fmt: skip
    return target


def _teach(cfg: JudgeQuickstartConfig, rows_path: Path, out: Path) -> Path:
    """The cold-start rows: the teacher's judgments that match the labels (``data_pipelines.judgments``)."""
    from data_pipelines import judgments

    if cfg.teacher_url:
        url = cfg.teacher_url
        model = ["--teacher-model", cfg.teacher_model] if cfg.teacher_model else []
        judgments.main(["--data", str(rows_path), "--teacher", url, "--out", str(out), *model])
        return out / "rows.jsonl"
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ToyTeacher)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        judgments.main(["--data", str(rows_path), "--teacher", url, "--out", str(out)])
    finally:
        server.shutdown()
        server.server_close()
    return out / "rows.jsonl"


def toy_teacher_reply(prompt: str) -> str:
    """The toy teacher: reads the reference and the two answers from a judgment prompt (vagent's templates) and
    checks each answer's digit against the reference, one answer at a time, then names the one that matches. A
    stand-in for a strong model; it only knows this task."""
    reference = re.search(r"^Reference answer: (.*)$", prompt, re.M)
    answers = [re.search(rf"^Answer {k}: (.*)$", prompt, re.M) for k in (1, 2)]
    if reference is None or None in answers:
        return "<think>I cannot read the task.</think>\n<answer>Answer 1 is better</answer>"
    ref = reference.group(1).strip()
    said = [d.group() if (d := re.search(r"\d", m.group(1))) else "nothing" for m in answers]
    checks = " ".join(f"Answer {k} says {s} and the reference is {ref}: {'yes' if s == ref else 'no'}."
                      for k, s in enumerate(said, 1))  # fmt: skip
    better = 1 if said[0] == ref else 2
    return f"<think>{checks}</think>\n<answer>Answer {better} is better</answer>"


class _ToyTeacher(BaseHTTPRequestHandler):
    """``/v1/models`` and ``/v1/chat/completions`` answered by ``toy_teacher_reply``."""

    def do_GET(self) -> None:
        self._send({"data": [{"id": "toy-teacher", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        content = body["messages"][-1]["content"]
        prompt = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
        self._send({"choices": [{"index": 0, "message": {"role": "assistant", "content": toy_teacher_reply(prompt)},
                                 "finish_reason": "stop"}]})  # fmt: skip

    def _send(self, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def _sft_config(cfg: JudgeQuickstartConfig, out: Path, model: Path, train: Path, steps: int) -> SFTConfig:
    return check_config(SFTConfig(
        out_dir=str(out), seed=cfg.seed, model=ModelConfig(path=str(model), device=cfg.model.device or "cpu"),
        data=SFTDataConfig(train=str(train), tools=[], micro_batch_size=8),
        optim=OptimConfig(lr=cfg.lr, warmup_steps=10, min_lr_ratio=0.1),
        train=TrainConfig(max_steps=steps, precision="fp32", save_every=0, resume="auto", tensorboard=False),
    ))  # fmt: skip


def _judge_grpo_config(cfg: JudgeQuickstartConfig, out: Path, model: Path, rows: Path) -> GRPOConfig:
    return check_config(GRPOConfig(
        out_dir=str(out), seed=cfg.seed, model=ModelConfig(path=str(model), device=cfg.model.device or "cpu"),
        data=GRPODataConfig(train=str(rows), tools=[]),
        rollout=RolloutConfig(max_turns=1, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature),
        grpo=GRPOAlgoConfig(group_size=4, prompts_per_step=8, rollout_batch_size=32, micro_batch_size=8),
        rewards=RewardConfig(weights={"judgment": 1.0}, options={}), optim=OptimConfig(lr=cfg.grpo_lr),
        train=TrainConfig(max_steps=cfg.grpo_steps, precision="fp32", save_every=0, resume="auto", tensorboard=False),
    ))  # fmt: skip


def _evaluate(model: Path, rows: Path, out: Path) -> dict[str, Any]:
    """``vagent eval --benchmark judge-pairs`` of one judge, greedy."""
    from vagent.cli import main as vagent

    vagent(["eval", "--model", str(model), "--benchmark", "judge-pairs", "--data", str(rows), "--out", str(out),
            "--max-turns", "1", "--max-new-tokens", "96", "--batch-size", "32"])  # fmt: skip
    return json.loads((out / "metrics.json").read_text())


def _closed_loop(cfg: JudgeQuickstartConfig, out: Path, base: Path, judge: Path, questions: Path) -> dict[str, Any]:
    """The final judge behind ``vagent serve``; ``policy_grpo_steps`` GRPO steps of the policy against it."""
    from vagent.data import load_rows, write_rows
    from vagent.recipes import grpo, sft
    from vagent.training.metrics import read_metrics

    rows = load_rows(questions)
    said = [cfg.phrases[0].format(digit=r.answer) for r in rows]  # answers as the judge's rows phrase them
    gold = [dataclasses.replace(r, messages=[{"role": "assistant", "content": f"<answer>{s}</answer>"}])
            for r, s in zip(rows, said, strict=True)]  # fmt: skip
    write_rows(gold, out / "data" / "questions-sft.jsonl")
    policy = sft.train(_sft_config(cfg, out / "policy-sft", base, out / "data" / "questions-sft.jsonl",
                                   cfg.policy_sft_steps))  # fmt: skip
    process, url = start_server(
        judge,
        "--served-model-name",
        "judge",
        "--threads",
        str(cfg.threads or 1),
        log=out / "serve.log",
        timeout_s=300.0,
    )
    try:
        run_dir = out / "policy-grpo"
        policy_cfg = check_config(GRPOConfig(
            out_dir=str(run_dir), seed=cfg.seed, model=ModelConfig(path=str(policy), device=cfg.model.device or "cpu"),
            data=GRPODataConfig(train=str(questions), tools=[]),
            rollout=RolloutConfig(max_turns=1, max_new_tokens=16, temperature=1.0),
            grpo=GRPOAlgoConfig(group_size=4, prompts_per_step=4, rollout_batch_size=16, micro_batch_size=8,
                                dynamic_sampling=False),
            rewards=RewardConfig(weights={"judge": 1.0}, options={}),
            judge=JudgeConfig(url=url, prompt="judgment", mode="pairwise", template=cfg.template,
                              max_tokens=cfg.max_new_tokens + 32, timeout_s=300.0),
            optim=OptimConfig(lr=1e-4),
            train=TrainConfig(max_steps=cfg.policy_grpo_steps, precision="fp32", save_every=0, resume="auto",
                              tensorboard=False),
        ))  # fmt: skip
        grpo.train(policy_cfg)
    finally:
        stop_server(process)
    records = read_metrics(run_dir / "metrics.jsonl")
    return {"steps": [{"step": r["step"], "reward/judge": r["reward/judge"],
                       "reward/judge_failures": r["reward/judge_failures"]} for r in records]}  # fmt: skip


def _report(cfg: JudgeQuickstartConfig, out: Path, evals: dict[str, dict[str, Any]], stages: dict[str, Any],
            loop: dict[str, Any], times: dict[str, float]) -> str:  # fmt: skip
    keys = ("agreement", "unparseable", "well_formed", "consistency", "first_preference", "agreement_both_orders")
    lines = [f"# Judge quickstart ({cfg.test_rows} held-out pairs, each judged both ways, greedy)", "",
             "| judge | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]  # fmt: skip
    lines += [f"| {name} | " + " | ".join(f"{m[k]:.3f}" for k in keys) + " |" for name, m in evals.items()]
    shown = {k: " -> ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else v for k, v in stages.items()}
    lines += ["", "Stages: " + ", ".join(f"{k} {v}" for k, v in shown.items())]
    lines += ["", "Closed loop (the final judge behind `vagent serve`, the policy's `judge` reward):", ""]
    lines += [f"- step {s['step']}: reward/judge {s['reward/judge']:.3f}, reward/judge_failures "
              f"{s['reward/judge_failures']:.3f}" for s in loop["steps"]]  # fmt: skip
    lines += ["", "Times: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items())]
    report = "\n".join(lines) + "\n"
    (out / "report.md").write_text(report)
    (out / "report.json").write_text(json.dumps({"evals": evals, "stages": stages, "loop": loop, "times": times},
                                                indent=1))  # fmt: skip
    return report


if __name__ == "__main__":
    raise SystemExit(main())
