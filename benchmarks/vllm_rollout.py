"""vLLM against vagent's HF engine, side by side in one run (in the vLLM environment: ``make vllm-venv``).

    .venv-vllm/bin/python benchmarks/vllm_rollout.py [--rows 64] [--new-tokens 32] [--vocab trained,qwen] [--doc]

Three ways to generate the same work, on the ``small`` tiny checkpoint (head_dim 32, fp32) with its own BPE vocabulary
and with Qwen's 151,936-token one:

* **single turn**: ``--rows`` prompts with one image each, one sampled turn of ``--new-tokens`` tokens at T = 1 with
  EOS off, no tools. ``bare vLLM`` is ``LLM.generate`` on the same collapsed prompts and images with the same
  sampling (the agent's stop strings, which end a turn that writes one, included: the engine alone doing the same
  work); ``vagent + vLLM`` is ``vagent.rollout.run`` over ``VLLMBackend`` (prompt building, the turn protocol, the id
  checks); ``vagent + HF`` the same over ``HFBackend``. Target: vagent + vLLM at least 0.9 of bare vLLM's sampled
  tokens/s.
* **GRPO step**: two steps of the tiny CPU config (4 prompts x 4 samples of zoom rows, turns of 32 tokens) on each
  backend; the second step's wall time, with its ``gen`` and ``sync`` stages (the vLLM engine is given the weights
  after every update).
* **multi-turn crop**: the checkpoint first memorizes a crop episode (two crop calls, then an answer: the test suite's
  ``taught`` policy), then ``--rows`` rows roll out greedily on each backend: three sampled turns and two tool images
  per row, rows rejoining the batch as their tools return.

Each measurement runs once untimed first (the engine's warm-up, the HF backend's first allocations), then timed;
bare vLLM and vagent + vLLM on the single turn alternate ``--repeats`` times (each row: its median run; the ratio: the
median of the pairs' ratios).
``--doc`` writes the table into docs/benchmarks.md (section ``vllm-rollout-cpu``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from PIL import Image

from vagent.model import load_policy
from vagent.rollout import HFBackend, RolloutLimits, Task, run
from vagent.rollout.vllm_backend import VLLMBackend, collapse_image_pads
from vagent.tiny_model import build_tiny_checkpoint
from vagent.training.weight_sync import generation_weights


def _image(i: int) -> Image.Image:
    return Image.new("RGB", (112, 112), ((37 * i) % 256, (91 * i) % 256, 160))


def _tasks(n: int) -> list[Task]:
    return [Task(id=f"r{i}", images=[_image(i)], question=f"What color is picture {i}?", tools=["crop"])
            for i in range(n)]  # fmt: skip


def _timed(fn, repeat: int = 1) -> tuple[float, object]:
    out = fn()  # untimed: warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return (time.perf_counter() - start) / repeat, out


def single_turn(policy, engine: VLLMBackend, rows: int, new_tokens: int,
                repeats: int = 5) -> list[tuple[str, float, int, float | None]]:  # fmt: skip
    """(name, seconds, sampled tokens, tokens/s over bare vLLM's) for bare vLLM, vagent + vLLM (each its median of
    ``repeats`` alternated runs; the ratio the median of the pairs') and vagent + HF on one sampled turn per row."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tasks = _tasks(rows)
    limits = RolloutLimits(max_turns=1, max_new_tokens=new_tokens, temperature=1.0)
    # the first turn's requests as the engine builds them: capture them once from a vagent run
    captured = []
    submit = engine.submit

    def capture(request):
        captured.append(request)
        submit(request)

    engine.submit = capture
    run(policy, tasks, limits=limits, batch_size=rows, backend=engine)
    engine.submit = submit
    pad = policy.model.config.image_token_id
    prompts = [TokensPrompt(prompt_token_ids=collapse_image_pads(r.ids, pad), multi_modal_data={"image": r.images})
               for r in captured]  # fmt: skip
    # the same work as vagent's turns: EOS off, and the agent's stop strings, which end a turn that writes one
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0, skip_special_tokens=False,
                            stop=list(captured[0].sampling.stop_strings) or None, include_stop_str_in_output=True)  # fmt: skip

    def bare():
        outs = engine.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    # EOS off for the vagent runs too (the backend's stop ids and vLLM's own EOS): the stop strings alone end a turn
    eos, add = engine._eos, engine._add
    engine._eos = []
    engine._add = lambda request_id, prompt, sampling: add(request_id, prompt, {**sampling, "ignore_eos": True})
    sampled = lambda out: sum(sum(t.loss_mask) for t in out)  # noqa: E731
    ours = lambda: sampled(run(policy, tasks, limits=limits, batch_size=rows, backend=engine))  # noqa: E731
    bare(), ours()  # warm-up
    # alternated, `repeats` times each: on a shared machine one timing of each is noisier than their difference
    timed = {"bare": [], "ours": []}
    for _ in range(repeats):
        for name, fn in (("bare", bare), ("ours", ours)):
            start = time.perf_counter()
            tokens = fn()
            timed[name].append((time.perf_counter() - start, tokens))
    engine._eos, engine._add = eos, add
    hf = HFBackend(policy)
    hf._eos = set()
    t_hf, out_hf = _timed(lambda: run(policy, tasks, limits=limits, batch_size=rows, backend=hf))
    # each generator's median run (by tokens/s), and the median over the pairs of vagent's rate over bare vLLM's
    rate = lambda run: run[1] / run[0]  # noqa: E731
    median = {name: sorted(runs, key=rate)[len(runs) // 2] for name, runs in timed.items()}
    ratio = statistics.median(rate(o) / rate(b) for b, o in zip(timed["bare"], timed["ours"], strict=True))
    return [("bare vLLM (LLM.generate)", *median["bare"], 1.0), ("vagent + vLLM", *median["ours"], ratio),
            ("vagent + HF", t_hf, sampled(out_hf), None)]  # fmt: skip


def multi_turn(policy, engine: VLLMBackend, rows: int) -> list[tuple[str, float, int, float]]:
    """(name, seconds, sampled tokens, tool calls per row) of greedy crop episodes on both backends."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_vllm_backend import _task, teach_crop_episode

    teach_crop_episode(policy)
    engine.load_weights(generation_weights(policy.model))
    tasks = [_task(i=i) for i in range(rows)]
    limits = RolloutLimits(max_turns=4, max_new_tokens=64, temperature=0.0)
    out = []
    for name, backend in (("vagent + vLLM", engine), ("vagent + HF", HFBackend(policy))):
        seconds, trajectories = _timed(lambda b=backend: run(policy, tasks, limits=limits, batch_size=rows, backend=b))
        calls = sum(len(t.tool_results) for t in trajectories) / rows
        out.append((name, seconds, sum(sum(t.loss_mask) for t in trajectories), calls))
    return out


def grpo_steps(path: Path, out: Path) -> list[tuple[str, float, float, float]]:
    """(backend, gen s, sync s, step s) of the second of two GRPO steps on each backend: the tiny CPU config, 4 prompts
    x 4 samples of zoom rows, turns of 32 tokens, fp32; the toy reward spreads within every group, so both steps
    update (and the vLLM engine is given the weights at each)."""
    from data_pipelines.synthetic.zoom import zoom_rows
    from vagent.config import GRPOConfig, load_config
    from vagent.data import write_rows
    from vagent.recipes import grpo
    from vagent.training.metrics import read_metrics

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_vllm_grpo import even_tokens

    grpo.REWARDS["even_tokens"] = even_tokens
    frame = load_policy(path, device="cpu").frame
    rows = write_rows(zoom_rows(out / "rows", 16, seed=0, size=(224, 168), clutter=10, **frame), out / "rows.jsonl")
    config = Path(__file__).resolve().parent.parent / "configs" / "grpo" / "qwen2_5_vl_tiny_cpu.yaml"
    timings = []
    for backend in ("hf", "vllm"):
        run_dir = out / f"grpo-{backend}"
        overrides = [f"out_dir={run_dir}", f"model.path={path}", f"data.train={rows}", f"rollout.backend={backend}",
                     "train.max_steps=2", "train.save_every=0", "train.save_final=false", "train.tensorboard=false",
                     "train.precision=fp32", "grpo.prompts_per_step=4", "grpo.group_size=4",
                     "grpo.rollout_batch_size=16", "rollout.max_new_tokens=32", "rewards.weights={even_tokens: 1.0}",
                     "rewards.options={}"]  # fmt: skip
        grpo.train(load_config(GRPOConfig, config, overrides))
        last = read_metrics(run_dir / "metrics.jsonl")[-1]
        timings.append((backend, last["time/gen"], last["time/sync"], last["time/step"]))
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--vocab", default="trained,qwen", help="Checkpoint vocabularies, comma-separated.")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="Alternated timings of bare vLLM and vagent + vLLM on the single turn (medians reported).",
    )
    parser.add_argument("--doc", action="store_true", help="Also write the table into docs/benchmarks.md.")
    args = parser.parse_args(argv)
    lines = ["| checkpoint | workload | generator | wall s | sampled tokens | tokens/s | vs bare vLLM | tool calls/row |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in args.vocab.split(","):
            path = build_tiny_checkpoint(Path(tmp) / vocab, size="small", vocab=vocab)
            policy = load_policy(path, device="cpu", dtype="float32")
            engine = VLLMBackend.for_policy(policy, max_model_len=4096, max_num_seqs=args.rows, max_images=4)
            name = f"small, {'Qwen vocabulary' if vocab == 'qwen' else 'trained BPE'}"
            single = single_turn(policy, engine, args.rows, args.new_tokens, args.repeats)
            bare_rate = single[0][2] / single[0][1]
            for gen, seconds, tokens, ratio in single:
                rate = tokens / seconds
                ratio = rate / bare_rate if ratio is None else ratio
                lines.append(f"| {name} | single turn, {args.rows} rows x {args.new_tokens} tokens | {gen} | "
                             f"{seconds:.2f} | {tokens} | {rate:.0f} | {ratio:.2f} | |")  # fmt: skip
            if vocab == "trained":  # the memorized crop episode: once, on the faster checkpoint
                for gen, seconds, tokens, calls in multi_turn(policy, engine, args.rows):
                    lines.append(f"| {name} | multi-turn crop, {args.rows} rows, greedy | {gen} | {seconds:.2f} | "
                                 f"{tokens} | {tokens / seconds:.0f} | | {calls:.1f} |")  # fmt: skip
            engine.close()
            if vocab == "trained":  # one GRPO step's stages on each backend (its second step: engines warm)
                for backend, gen, sync, step in grpo_steps(path, Path(tmp) / "grpo"):
                    lines.append(f"| {name} | GRPO step 2: gen {gen:.2f} s, sync {sync:.2f} s | vagent + {backend} | "
                                 f"{step:.2f} | | | | |")  # fmt: skip
            print("\n".join(lines), flush=True)
    table = "\n".join(lines)
    if args.doc:
        from doc_table import write_section

        write_section("vllm-rollout-cpu", table)  # the command as run, in .venv-vllm (the section says so)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
