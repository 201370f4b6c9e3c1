"""How much of a zoom tile's answer the model's global view gives away, measured by a linear probe.

    python benchmarks/view_leak.py [--size 672 504] [--tile 126] [--n 800] [--doc]

Draws ``n`` striped tiles (``data_pipelines.synthetic.zoom.draw_task``, no clutter, answers cycling over
the four directions), resizes each image exactly as the policy's processor would (the quickstart's pixel
budget), cuts the tile's 36x36-px patch out of that view, and fits a logistic regression on the 2-D FFT
magnitude of the patch (mean removed) on 3/4 of them. Prints the accuracy on the held-out quarter next to
chance. A probe on the exact tile region is an upper bound on what the view reveals, not what a policy
learns; the quickstart's no-tool baseline measures the latter. ``--doc`` writes the result into
docs/benchmarks.md (section ``view-leak``).
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch

from data_pipelines.synthetic.zoom import STRIPES, draw_task
from vagent.media import resize_to_budget


def probe_accuracy(size: tuple[int, int], tile: int, n: int, seed: int = 0) -> float:
    rng = random.Random(seed)
    features, labels = [], []
    for i in range(n):
        while True:  # draw_task picks the direction at random; keep the classes balanced
            image, answer, box = draw_task(
                *size, rng, tile=tile, clutter=0, distractors=0, color="red", glyph="stripes"
            )
            if answer == STRIPES[i % len(STRIPES)]:
                break
        view = resize_to_budget(image, min_pixels=3136, max_pixels=50176)
        sx, sy = view.width / image.width, view.height / image.height
        left, top = int(box[0] * sx) + 4, int(box[1] * sy) + 4
        patch = np.asarray(view.crop((left, top, left + 36, top + 36)).convert("L"), np.float32)
        features.append(np.abs(np.fft.fft2(patch - patch.mean())).ravel())
        labels.append(i % len(STRIPES))
    x = torch.tensor(np.array(features))
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(labels)
    split = n * 3 // 4
    torch.manual_seed(seed)
    weights = torch.zeros(x.shape[1], len(STRIPES), requires_grad=True)
    optimizer = torch.optim.Adam([weights], lr=1e-2)
    for _ in range(300):
        loss = torch.nn.functional.cross_entropy(x[:split] @ weights, y[:split]) + 1e-3 * weights.square().sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return ((x[split:] @ weights).argmax(1) == y[split:]).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, nargs=2, default=[672, 504], help="image width and height")
    parser.add_argument("--tile", type=int, default=126)
    parser.add_argument("--n", type=int, default=800, help="tiles (3/4 fit the probe, 1/4 score it)")
    parser.add_argument("--doc", action="store_true", help="Also write the table into docs/benchmarks.md.")
    args = parser.parse_args()
    accuracy = probe_accuracy(tuple(args.size), args.tile, args.n)
    table = ["| image | tile | probes fit / scored | probe accuracy on held-out views | chance |", "|---|---:|---:|---:|---:|",
             f"| {args.size[0]}x{args.size[1]} | {args.tile} px | {args.n * 3 // 4} / {args.n - args.n * 3 // 4} | "
             f"{accuracy:.2f} | {1 / len(STRIPES):.2f} |"]  # fmt: skip
    print("\n".join(table))
    if args.doc:
        from doc_table import write_section

        write_section("view-leak", "\n".join(table))


if __name__ == "__main__":
    main()
