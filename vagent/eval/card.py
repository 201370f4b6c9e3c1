"""The protocol card of an eval run: everything that decides its score, written beside it as ``protocol.json``.

Scores of the same model on the same benchmark differ across papers mostly by protocol: k samples or one,
temperature, turn and pixel budgets, how the option letter is read, which judge. A card names all of it, so two runs
can be compared field by field (``vagent eval-report``) and one can be repeated exactly (``vagent eval --rerun``):

* what was scored: the benchmark, the data file's SHA-256 (a folder's: over its files' names and bytes), the loader's
  version (the SHA-256 of its module's source), the records (``--limit``, ``--skip-bad``);
* who answered: the model path and the SHA-256 of its ``config.json`` (or the endpoint and its model id);
* how: the agent profile, tools, every budget, the pixel budget, sampling (k, temperature, top_p, seed), the
  extraction rule and its fallback, the judge (model, mode, prompt's SHA-256), the preset and the flags that
  overrode it;
* with what: vagent's version and git commit, the command line.

``args`` holds the parsed command line (paths made absolute), which ``--rerun`` replays.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["CARD_NAME", "card_differences", "file_sha256", "protocol_card", "read_card", "write_card"]

CARD_NAME = "protocol.json"
# what names the run rather than decides its score (where the files are: their hashes are compared), or repeats a
# field above (the command line as parsed): left out of the differences eval-report lists
_BOOKKEEPING = ("command", "args", "data", "model")


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, or of a folder's files (their relative paths and bytes, in sorted order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def weights_fingerprint(model_dir: Path) -> str | None:
    """SHA-256 over a checkpoint's weight files' names and sizes and its safetensors index (hashing the bytes of
    tens of GB would take minutes): new weights written into the same dir change it."""
    files = sorted(p for p in model_dir.glob("*") if p.suffix in (".safetensors", ".bin") or p.name.endswith(".json"))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        if path.name.endswith(".index.json"):
            digest.update(path.read_bytes())
    return digest.hexdigest()


def listing_fingerprint(folder: Path) -> str | None:
    """SHA-256 over the relative paths and sizes of a media folder's files (``--image-root``: videos, subtitles)."""
    if not folder.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(folder)}\0{path.stat().st_size}\0".encode())
    return digest.hexdigest()


def _source_sha256(*modules: Any) -> str:
    """SHA-256 of the code that reads and scores answers: the loader, the agent profile, the rules, the metrics."""
    from vagent.eval import extract, metrics

    digest = hashlib.sha256()
    for module in (*modules, extract, metrics):
        if module is not None:
            digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()


def _commit() -> str | None:
    """vagent's git commit (with ``+dirty`` when the tree has changes), or None outside a checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def protocol_card(args: dict[str, Any], *, benchmark: str, loader: Any, limits: dict[str, Any],
                  pixels: Sequence[int] | None, overrides: dict[str, Any], protocol: str | None,
                  judge_prompt: str | None = None, agent_module: Any = None) -> dict[str, Any]:  # fmt: skip
    """The card of a run about to start.

    Args:
        args: The parsed command line (``vars(namespace)``): flags as resolved, paths absolute.
        benchmark: The benchmark's name.
        loader: The benchmark's module (its source is hashed as the loader's version).
        limits: The episode limits and sampling (``RolloutLimits`` as a dict).
        pixels: ``(min_pixels, max_pixels)`` of the images the model is shown, or None (an endpoint).
        overrides: The preset's fields a flag changed: ``{field: {"preset": value, "used": value}}``.
        protocol: The preset's name (``vagent.eval.protocols``), or None; its values are the fields above.
        judge_prompt: The judge's prompt template, when a judge grades the run.
        agent_module: The agent profile's module (hashed with the scoring code: prompt and answer reading).
    """
    from vagent import __version__

    data = Path(args["data"])
    model = args.get("model")
    config = Path(model) / "config.json" if model else None
    return {
        "benchmark": benchmark,
        "data": str(data),
        "data_sha256": file_sha256(data),
        "loader": loader.__name__,
        "loader_sha256": hashlib.sha256(inspect.getsource(loader).encode()).hexdigest(),
        "records": {"limit": args.get("limit"), "skip_bad": bool(args.get("skip_bad"))},
        "model": model or args.get("endpoint"),
        "model_config_sha256": file_sha256(config) if config is not None and config.is_file() else None,
        "model_weights": weights_fingerprint(Path(model)) if model else None,
        "dtype": args.get("dtype"),
        "attn": args.get("attn"),
        "media": listing_fingerprint(Path(args["image_root"])) if args.get("image_root") else None,
        "scoring_sha256": _source_sha256(loader, agent_module),
        "endpoint_model": args.get("endpoint_model"),
        "backend": "endpoint" if args.get("endpoint") else args.get("backend", "hf"),
        "agent": args.get("agent"),
        "tools": args.get("tools"),
        "limits": limits,
        "pixels": list(pixels) if pixels is not None else None,
        "samples": args.get("samples"),
        "seed": args.get("seed"),
        "extract": args.get("extract"),
        "parse_fallback": args.get("parse_fallback"),
        "option_order": args.get("option_order"),
        "judge": (
            {
                "url": args.get("judge"),
                "model": args.get("judge_model"),
                "mode": args.get("judge_mode"),
                "prompt_sha256": hashlib.sha256(judge_prompt.encode()).hexdigest() if judge_prompt else None,
            }
            if args.get("judge")
            else None
        ),
        "protocol": protocol,
        "overrides": overrides,
        "vagent": {"version": __version__, "commit": _commit()},
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "args": {k: v for k, v in args.items() if not callable(v)},
    }


def write_card(out_dir: Path, card: dict[str, Any]) -> None:
    """Write ``protocol.json`` whole or not at all."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (CARD_NAME + ".tmp")
    tmp.write_text(json.dumps(card, indent=1, ensure_ascii=False, default=str))
    os.replace(tmp, out_dir / CARD_NAME)


def read_card(run_dir: Path) -> dict[str, Any] | None:
    """A run's card, or None for a run made before cards."""
    path = run_dir / CARD_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def _flat(card: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in card.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def card_differences(cards: Sequence[dict[str, Any] | None]) -> dict[str, list[Any]]:
    """Every card field (dotted, e.g. ``limits.temperature``) whose value is not the same in all ``cards``, with
    each card's value (None where a card lacks it); fields that only name the run (its out dir, the command) are
    left out (``command``, ``args``). A missing card (a run made before cards) counts as holding no field.

    >>> card_differences([{"samples": 1, "limits": {"max_turns": 4}}, {"samples": 4, "limits": {"max_turns": 4}}])
    {'samples': [1, 4]}
    """
    flats = [_flat(c) if c else {} for c in cards]
    fields = sorted(k for k in {k for f in flats for k in f} if k.split(".")[0] not in _BOOKKEEPING)
    return {k: [f.get(k) for f in flats] for k in fields if len({json.dumps(f.get(k), default=str) for f in flats}) > 1}
