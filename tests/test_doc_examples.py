"""The examples of README.md and docs/guide/*.md that are marked runnable run as the page shows them, so a page that
drifts from the code fails here.

A fenced block runs only when the line right before its opening fence is one of these markers (an HTML comment,
invisible on GitHub):

* ``<!-- runnable -->``: a bash block, in the default tests. Keep it to a few tens of seconds once made tiny: the
  non-slow part of this file stays under about a minute on 2 cores.
* ``<!-- runnable: slow -->``: a bash block that takes longer (marked slow, out of the default run).
* ``<!-- runnable: server -->``: a Python block that talks to ``vagent serve`` at ``http://127.0.0.1:8000/v1``.

A bash block runs under ``bash -euo pipefail`` in a scratch directory that links the checkout's ``configs/``,
``tools/`` and ``benchmarks/``, with ``vagent`` and ``python`` meaning this interpreter and this checkout, after
``shrink`` has made its sizes tiny (rows, samples, tokens, steps; the commands are otherwise the page's). Then every
``runs/...`` path the block names, in its commands or its comments, must exist: what a comment says a command
writes, it writes. A server block runs unchanged but for the port (a free one instead of 8000) against a live
``vagent serve`` on the tiny checkpoint, with a ``photo.png`` beside it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*runnable(?::\s*(?P<kind>[\w-]+))?\s*-->\s*$")
KINDS = {"shell": "bash", "slow": "bash", "server": "python"}  # marker kind -> the fence's language
SERVER_URL = "http://127.0.0.1:8000/v1"
# Pages whose examples must stay marked (a marker deleted by accident would otherwise pass silently).
MUST_RUN = {"README.md": "shell", "docs/guide/training.md": "slow", "docs/guide/serving.md": "server"}
LINKED = ("configs", "tools", "benchmarks")  # what a block's commands read from the checkout
# Appended to a stage's command line: one optimizer step, short GRPO turns, nothing refilled.
STAGE_OVERRIDES = {
    "sft": "train.max_steps=1",
    "grpo": "train.max_steps=1 grpo.dynamic_sampling=false rollout.max_new_tokens=16",
    "dpo": "train.max_steps=1",
}


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    kind: str  # shell | slow | server
    language: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def find_blocks(path: Path) -> list[Block]:
    """The marked blocks of one page; a marker not followed by a fence, of an unknown kind, or a fence never closed
    is a ValueError (at collection: a mistyped marker fails rather than leaving its block unrun)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    blocks = []
    for i, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if not match:
            continue
        kind = match.group("kind") or "shell"
        fence = re.match(r"^```(\w*)\s*$", lines[i + 1]) if i + 1 < len(lines) else None
        if kind not in KINDS or fence is None:
            raise ValueError(f"{page}:{i + 1}: a runnable marker must be one of {sorted(KINDS)} right before a fence")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{page}:{i + 2}: a runnable block's fence is never closed")
        blocks.append(Block(page, i + 2, kind, fence.group(1), "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


def shrink(script: str) -> str:
    """The block with tiny sizes: at most 8 generated rows (the README's rows), one sample, a rollout of one row
    at 8 tokens a turn, a generation of 8 tokens, one optimizer step per training stage."""
    script = re.sub(r"--rows (\d+)", lambda m: f"--rows {min(int(m.group(1)), 8)}", script)
    script = re.sub(r"--samples \d+", "--samples 1", script)
    script = script.replace("vagent rollout ", "vagent rollout --limit 1 --max-turns 2 --max-new-tokens 8 ")
    script = script.replace("vagent generate ", "vagent generate --max-new-tokens 8 ")

    def stage(match: re.Match) -> str:  # the overrides go before the line's comment
        return f"{match.group(1)} {STAGE_OVERRIDES[match.group(2)]}{match.group(3) or ''}"

    return re.sub(r"(?m)^(vagent (sft|grpo|dpo) [^#\n]*?)(\s+#.*)?$", stage, script)


BLOCKS = [block for page in PAGES for block in find_blocks(page)]


def _param(block: Block):
    return pytest.param(block, id=block.name, marks=[pytest.mark.slow] if block.kind == "slow" else [])


def test_the_markers_are_where_they_should_be(tmp_path):
    kinds = {(b.page, b.kind) for b in BLOCKS}
    assert set(MUST_RUN.items()) <= kinds, f"runnable markers missing: {set(MUST_RUN.items()) - kinds}"
    assert all(b.language == KINDS[b.kind] for b in BLOCKS), [b.name for b in BLOCKS if b.language != KINDS[b.kind]]
    page = tmp_path / "page.md"
    page.write_text("<!-- runnable -->\n```bash\nvagent tools list\n```\n\n<!-- runnable: fast -->\n```bash\n```\n")
    with pytest.raises(ValueError, match="page.md:6"):
        find_blocks(page)
    page.write_text("<!-- runnable -->\n```bash\nvagent tools list\n")
    with pytest.raises(ValueError, match="never closed"):
        find_blocks(page)
    page.write_text("<!-- runnable: slow -->\n```bash\nvagent sft --config c.yaml  # -> runs/x\n```\n")
    assert find_blocks(page) == [Block("page.md", 2, "slow", "bash", "vagent sft --config c.yaml  # -> runs/x\n")]
    assert shrink(find_blocks(page)[0].text) == "vagent sft --config c.yaml train.max_steps=1  # -> runs/x\n"
    assert shrink("x --rows 64 --samples 4\n") == "x --rows 8 --samples 1\n"


def _environment(directory: Path) -> dict[str, str]:
    """PATH with ``python`` and ``vagent`` of this interpreter and checkout first; the checkout on PYTHONPATH."""
    bin_dir = directory / ".bin"
    bin_dir.mkdir()
    for name, command in (("python", ""), ("vagent", " -m vagent.cli")):  # scripts: a venv's python is not a link
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{command} "$@"\n')
        (bin_dir / name).chmod(0o755)
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": python_path,
            "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if b.kind in ("shell", "slow")])
def test_a_shell_block_runs_as_the_page_shows_it(block: Block, tmp_path):
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    script = shrink(block.text)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=_environment(tmp_path),
                          capture_output=True, text=True, timeout=1800 if block.kind == "slow" else 300)  # fmt: skip
    assert done.returncode == 0, f"{block.name} failed:\n{script}\n{(done.stdout + done.stderr)[-4000:]}"
    named = {path.rstrip(".,;:)") for path in re.findall(r"\bruns/[\w./-]+", block.text)}
    missing = sorted(path for path in named if not (tmp_path / path).exists())
    assert not missing, f"{block.name} names {missing}, which it did not write"


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if b.kind == "server"])
def test_a_client_example_runs_against_a_live_server(block: Block, tiny_qwen25, tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from tests.serve_helpers import start_server, stop_server

    assert SERVER_URL in block.text, f"{block.name} does not talk to {SERVER_URL}"
    Image.new("RGB", (160, 120), (200, 40, 40)).save(tmp_path / "photo.png")
    process, url = start_server(tiny_qwen25, log=tmp_path / "serve.log")
    try:
        done = subprocess.run([sys.executable, "-c", block.text.replace(SERVER_URL, url)], cwd=tmp_path,
                              env=_environment(tmp_path), capture_output=True, text=True, timeout=300)  # fmt: skip
    finally:
        stop_server(process)
    assert done.returncode == 0, f"{block.name} failed:\n{done.stdout}{done.stderr[-4000:]}"
    assert done.stdout.strip(), f"{block.name} printed nothing"
