"""Holds the import rules of ARCHITECTURE.md: imports point downward only."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vagent"

LEVELS = {
    "types": 0, "geometry": 0, "media": 0, "config": 0, "vllm_logits": 0,
    "chat": 1, "toolbox": 1, "rewards": 1, "algorithms": 1, "data": 1, "judge": 1,
    "model": 2, "tiny_model": 2, "rollout": 2, "training": 2, "agents": 2,
    "eval": 3,
    "recipes": 9, "cli": 9, "serve": 9,
}  # fmt: skip
# Same-level imports that the architecture allows (everything else at one level is a sibling import).
# training -> rollout: SFT builds its prompts with the engine's prompt_messages (one prompt for SFT and RL).
# rollout/training -> agents: the engine and SFT prompts speak the chosen agent profile's protocol.
ALLOWED_SAME_LEVEL = {("rollout", "model"), ("training", "model"), ("training", "rollout"), ("rollout", "agents"),
                      ("training", "agents")}  # fmt: skip
NO_TRANSFORMERS = {"rewards", "algorithms", "types", "geometry", "config", "chat", "judge"}


def _top(module_path: Path) -> str:
    rel = module_path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _violations():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue
        src = _top(path)
        assert src in LEVELS, f"{path} belongs to no layer; add '{src}' to LEVELS (and ARCHITECTURE.md)"
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "transformers" and src in NO_TRANSFORMERS:
                found.append(f"{path.relative_to(PACKAGE)} imports transformers")
            if parts[0] != "vagent" or len(parts) < 2 or parts[1] == src:
                continue
            dst = parts[1]
            if dst in ("recipes", "cli") and src != "cli":
                found.append(f"{path.relative_to(PACKAGE)} imports the leaf {dst}")
            elif LEVELS[dst] > LEVELS[src] or (LEVELS[dst] == LEVELS[src] and (src, dst) not in ALLOWED_SAME_LEVEL):
                if LEVELS[src] != 9:
                    found.append(
                        f"{path.relative_to(PACKAGE)} (level {LEVELS[src]}) imports {name} (level {LEVELS[dst]})"
                    )
    return found


def test_imports_point_downward():
    assert _violations() == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    bad = PACKAGE / "geometry_layering_probe.py"
    LEVELS["geometry_layering_probe"] = 0
    try:
        bad.write_text("from vagent.model import load_policy\nimport transformers\n")
        found = _violations()
    finally:
        bad.unlink()
        del LEVELS["geometry_layering_probe"]
    assert any("imports vagent.model" in v for v in found)


def test_the_demo_imports_no_training_code():
    """demo/ (a leaf) may use model, rollout, toolbox, geometry and below, never training code."""
    forbidden = {"training", "recipes", "algorithms", "rewards", "eval"}
    found = []
    for path in sorted((PACKAGE.parent / "demo").rglob("*.py")):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "vagent" and len(parts) > 1 and parts[1] in forbidden:
                found.append(f"{path.name} imports {name}")
    assert found == []


def _leaf_violations(root: Path) -> list[str]:
    """The library imports no leaf that lives outside it (``data_pipelines``, ``quickstart``, ``demo``,
    ``benchmarks``), except the CLI's lazy dispatch to ``quickstart`` and ``demo`` (entry points, like the CLI);
    a recipe imports no other recipe's private (``_``) names."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in names:
                top = module.split(".")[0]
                if top == "data_pipelines" or (
                    top in ("quickstart", "demo", "benchmarks") and rel.parts != ("cli.py",)
                ):
                    found.append(f"{rel} imports the leaf {module}")
                recipe = module.startswith("vagent.recipes.") and module != f"vagent.recipes.{path.stem}"
                if rel.parts[0] == "recipes" and recipe and name and name.startswith("_"):
                    found.append(f"{rel} imports the private {module}.{name}")
    return found


def test_the_library_imports_no_leaf_and_recipes_no_private_helpers():
    assert _leaf_violations(PACKAGE) == []


def test_the_leaf_check_catches_data_pipelines_and_private_recipe_helpers(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "media.py").write_text("from data_pipelines.synthetic.zoom import zoom_rows\n")
    (tmp_path / "recipes" / "sft.py").write_text("from vagent.recipes.grpo import _collect, train\n")
    (tmp_path / "recipes" / "grpo.py").write_text("import quickstart.run\nfrom vagent.recipes.grpo import _own\n")
    assert sorted(_leaf_violations(tmp_path)) == [
        "media.py imports the leaf data_pipelines.synthetic.zoom",
        "recipes/grpo.py imports the leaf quickstart.run",
        "recipes/sft.py imports the private vagent.recipes.grpo._collect",
    ]


# A function longer than this is split into named steps (torchtune's recipes, verl's timed stages): the library,
# its recipes and the quickstart read top to bottom in pieces that fit on a screen.
MAX_FUNCTION_LINES = 80


def _long_functions(roots: list[Path]) -> list[str]:
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_the_library_or_the_quickstart_is_longer_than_a_screen():
    assert _long_functions([PACKAGE, PACKAGE.parent / "quickstart"]) == []


def test_the_length_check_catches_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}")
    assert _long_functions([tmp_path]) == [f"{tmp_path.name}/long.py:1 long ({MAX_FUNCTION_LINES + 1} lines)"]
