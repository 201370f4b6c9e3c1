"""Metrics to JSONL (always), TensorBoard (default) and Weights & Biases (optional), from rank 0 only.

On resume the JSONL keeps only the records up to the resumed step, and TensorBoard purges the events
after it, so a killed-and-resumed run leaves one clean curve instead of two overlapping ones.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger", "read_metrics"]


class MetricsLogger:
    """Append ``{"step": s, ...}`` records. Non-main ranks get a logger that drops everything."""

    def __init__(self, out_dir: Path, *, enabled: bool, resume_step: int = 0, tensorboard: bool = True,
                 wandb_project: str | None = None, config: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step] if resume_step else []
        with open(self.path, "w") as f:  # rewritten: records past the resumed step belong to the lost attempt
            f.writelines(json.dumps(r) + "\n" for r in kept)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ImportError(f"train.wandb_project={wandb_project} needs wandb: pip install wandb") from None
            self.wandb = wandb.init(project=wandb_project, config=config, dir=str(out_dir), resume="allow")

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self.tb is not None:
            for key, value in numbers.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a torn last line from a kill is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
