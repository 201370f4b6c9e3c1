"""The built-in default job: prove, on a laptop-class CPU with no downloads, that an agent learns to look closer.

    python -m quickstart [--config configs/quickstart/tiny_cpu.yaml] [key=value ...]      (`make run`; `vagent quickstart` too)

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
   when the answer is right; every few steps it samples an answer to each val row at its temperature,
   and its best step there, the SFT start included, is the GRPO policy;
5. evaluation on the test split, greedy: the SFT and GRPO policies with the crop tool, the no-tool
   baseline, and the SFT policy with blind crops (every crop shows the whole image: ``run.blind_crop``);
   sampled at GRPO's temperature: the SFT and GRPO policies (what the GRPO target compares); on CPU the
   baseline is trained and evaluated beside the crop-tool SFT, and the SFT policy evaluated beside GRPO,
   each in a second process (``quickstart.parallel.Beside``);
6. ``report.md``: the results table, the targets (``TARGETS``) each with what this run measured,
   tool-use statistics (also split into rows that need the tool and rows that do not), loss and reward
   curves (PNG), and links to the HTML viewers of the trajectories with their crops.
"""

from quickstart.run import main

__all__ = ["main"]
