"""The rows a checkpoint still gets wrong: its accuracy over k samples per row, and the rows below a threshold.

    python -m data_pipelines.hard_rows --model CKPT --data rows.jsonl --out hard.jsonl --samples 4 \
        --rewards judgment=1.0 --reward-options judgment.format_weight=0 --correct-at 1.0 --below 1.0 [--tools none]

Each row is rolled out ``--samples`` times; a sample is right when its reward (``--rewards``, weighted as in
``data_pipelines.distill``, with ``--reward-options``) reaches ``--correct-at``; the row's accuracy is the share of
right samples. Rows whose accuracy is below ``--below`` are written as they were read, with ``accuracy_at_k``
added: UnifiedReward-Think's GRPO stage trains on the judgments its judge still gets wrong after rejection
sampling. For a judge, ``judgment.format_weight=0`` makes the reward the verdict's agreement with the label alone;
with the reward's default format weight of 0.5 a reward of 0.5 is either a right verdict badly formed or a wrong
one well formed, and ``--correct-at 1.0`` counts both as wrong. With ``--below 1`` every row the model does not
always get right is kept; rows it never gets right give GRPO a group without a winner, so a ``--min-accuracy``
above 0 leaves them out.
"""

from __future__ import annotations

import argparse
from collections import Counter

from data_pipelines.distill import add_rollout_arguments, roll_out
from vagent.data import Row, write_rows

__all__ = ["hard_rows"]


def hard_rows(rows: list[Row], rewards: list[float], n_samples: int, *, correct_at: float, below: float,
              min_accuracy: float = 0.0) -> tuple[list[Row], list[float]]:  # fmt: skip
    """(the rows whose accuracy over their ``n_samples`` rewards (row by row) lies in ``[min_accuracy, below)``, with
    ``accuracy_at_k`` in ``extra``; every row's accuracy)."""
    accuracies = [sum(r >= correct_at for r in rewards[i * n_samples : (i + 1) * n_samples]) / n_samples
                  for i in range(len(rows))]  # fmt: skip
    kept = [Row(**{**row.__dict__, "extra": {**row.extra, "accuracy_at_k": accuracy}})
            for row, accuracy in zip(rows, accuracies, strict=True) if min_accuracy <= accuracy < below]  # fmt: skip
    return kept, accuracies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rollout_arguments(parser)
    parser.add_argument("--out", required=True, help="Rows JSONL to write.")
    parser.add_argument("--correct-at", type=float, default=1.0, help="A sample is right at this reward or above.")
    parser.add_argument("--below", type=float, default=1.0, help="Keep rows whose accuracy is below this.")
    parser.add_argument("--min-accuracy", type=float, default=0.0, help="... and at least this.")
    args = parser.parse_args(argv)

    rows, _, totals = roll_out(args)
    kept, accuracies = hard_rows(rows, totals, args.samples, correct_at=args.correct_at, below=args.below,
                                 min_accuracy=args.min_accuracy)  # fmt: skip
    spread = ", ".join(f"{a:.2f}: {n}" for a, n in sorted(Counter(accuracies).items()))
    print(f"accuracy over {args.samples} samples, rows per value: {spread}")
    if not kept:
        raise SystemExit(f"no row has accuracy in [{args.min_accuracy}, {args.below}): nothing to write")
    print(f"kept {len(kept)} of {len(rows)} rows -> {write_rows(kept, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
