"""The house rules of docs/architecture.md, checked on the code's own imports (AST, function bodies
included, so an import moved into a function to dodge a cycle still counts):

* no import cycle among the project's modules;
* packages import downwards only: common/ <- preprocessing/ <- pretrain/ <- evals/, launch/;
* pretrain/config/ (the ground floor) imports no runtime module except the registries' faces;
* a function-level import of a project module is only for one that brings a heavy third-party
  library (megatron-core, DeepSpeed, transformers, ...) with it;
* every package face (`__init__.py`) is a docstring and imports nothing.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "pretrain", "preprocessing", "evals", "launch", "hydra_plugins")
# package -> the project packages it may import (besides itself)
BELOW = {"common": set(), "hydra_plugins": set(), "preprocessing": {"common"}, "pretrain": {"common", "preprocessing"},
         "evals": {"common", "preprocessing", "pretrain"}, "launch": {"common", "preprocessing", "pretrain"}}
HEAVY = {"torch", "megatron", "deepspeed", "transformers", "lm_eval", "matplotlib", "datasets", "tensorboard",
         "wandb", "mlflow", "submitit", "numpy", "datasketch", "tokenizers", "sentencepiece", "pyarrow"}
# What the ground floor may import besides itself, common/ and preprocessing's config: the registries
# (names checked at compose time), the schedules' registry and batch ramp, DeepSpeed's template checks, and
# the fusions' kernel probes, read by the precision rules (the GPU table, config/hardware.py, is the floor's own).
CONFIG_MAY_IMPORT = {"pretrain.engines.registry", "pretrain.optim.registry", "pretrain.observability.trackers.registry",
                     "pretrain.schedules", "pretrain.engines.deepspeed.ds_config", "preprocessing.config",
                     "pretrain.model.fusions", "pretrain.peft.registry"}


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(root: Path) -> dict[str, list[tuple[str, bool, str]]]:
    """module -> [(imported project module or third-party top name, inside a function, 'file:line')]."""
    mods = modules(root)
    found: dict[str, list[tuple[str, bool, str]]] = {m: [] for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        in_function = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function.update(id(n) for n in ast.walk(fn))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix for a in node.names]
            else:
                continue
            for target in targets:
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]
                if target != name and not name.startswith(target + "."):
                    found[name].append((target, id(node) in in_function, f"{path.relative_to(root)}:{node.lineno}"))
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in edges:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def project_edges(found) -> dict[str, set[str]]:
    return {m: {t for t, _, _ in targets if t in found} for m, targets in found.items()}


def heavy_at_import(found) -> dict[str, bool]:
    """Whether importing a module (its top-level imports, followed through the project) loads a HEAVY library."""
    memo: dict[str, bool] = {}

    def visit(m: str, seen: frozenset) -> bool:
        if m in memo:
            return memo[m]
        result = False
        for target, lazy, _ in found[m]:
            if lazy:
                continue
            if target not in found:
                result = result or target.split(".")[0] in HEAVY
            elif target not in seen:
                result = result or visit(target, seen | {target})
        memo[m] = result
        return result

    return {m: visit(m, frozenset({m})) for m in found}


def violations(root: Path) -> list[str]:
    found = imports(root)
    out = [f"import cycle of {len(c)} modules: {', '.join(c)}" for c in cycles(project_edges(found))]
    heavy = heavy_at_import(found)
    for m, targets in found.items():
        for target, lazy, where in targets:
            internal = target in found
            package, target_package = m.split(".")[0], target.split(".")[0]
            if internal and target_package != package and target_package not in BELOW[package]:
                out.append(f"{where}: {package}/ imports {target}; it may import {sorted(BELOW[package])} only")
            if (m.startswith("pretrain.config") and internal and not target.startswith(("pretrain.config", "common"))
                    and target not in CONFIG_MAY_IMPORT):
                out.append(f"{where}: the ground floor pretrain/config/ imports the runtime module {target}")
            if lazy and internal and not heavy[target]:
                out.append(f"{where}: function-level import of {target}, which loads no heavy library: import it at "
                           "the top (a lazy import is for heavy third-party modules, never to dodge a cycle)")
        path = modules(root)[m]
        if path.name == "__init__.py":
            body = ast.parse(path.read_text()).body
            if not body or not isinstance(getattr(body[0], "value", None), ast.Constant) or len(body) > 1:
                out.append(f"{path.relative_to(root)}: a package face is a docstring naming its files, nothing else")
    return out


def test_the_tree_keeps_the_house_rules():
    assert violations(REPO) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_a_cycle_closed_inside_a_function(tmp_path):
    """The shape of the circle this rule replaced: the ground floor reaches a runtime module whose
    function-level import leads back up to it (pretrain/config -> evals/inloop -> ... -> config)."""
    _write(tmp_path, {
        "pretrain/__init__.py": '"""face"""\n',
        "pretrain/config/__init__.py": '"""face"""\n',
        "pretrain/config/validate.py": "from evals.inloop import rules\n",
        "evals/__init__.py": '"""face"""\n',
        "evals/inloop.py": "def rules():\n    from pretrain.hf.convert import tokenizer_of\n",
        "pretrain/hf/__init__.py": '"""face"""\n',
        "pretrain/hf/convert.py": "from ..config.validate import x\n",
    })
    found = violations(tmp_path)
    assert "import cycle of 3 modules: evals.inloop, pretrain.config.validate, pretrain.hf.convert" in found
    assert any("pretrain/ imports evals.inloop" in v for v in found)          # evals/ sits above pretrain/
    assert any("function-level import of pretrain.hf.convert" in v for v in found)


def test_the_checker_refuses_faces_that_import_and_the_floor_reaching_up(tmp_path):
    _write(tmp_path, {
        "pretrain/__init__.py": '"""face"""\nfrom .loop import Trainer\n',
        "pretrain/loop.py": "import torch\n",
        "pretrain/config/__init__.py": '"""face"""\n',
        "pretrain/config/schema.py": "from ..loop import Trainer\n",
        "common/__init__.py": '"""face"""\n',
        "common/cli.py": "def f():\n    import pretrain.loop\n",
    })
    found = violations(tmp_path)
    assert any(v.startswith("pretrain/__init__.py: a package face") for v in found)
    assert any("pretrain/config/ imports the runtime module pretrain.loop" in v for v in found)
    assert any("common/ imports pretrain.loop" in v for v in found)
    assert not any("function-level import of pretrain.loop" in v for v in found)      # torch: heavy, allowed


def documented_tree(text: str) -> dict[str, set[str]]:
    """docs/architecture.md's tree of pretrain/: folder ('pretrain', 'pretrain/engines/megatron', ...) -> the
    module files its lines name (a folder's line and the deeper-indented lines after it)."""
    block = text.split("## The tree", 1)[1].split("```")[1]
    lines = block[block.index("\npretrain/\n") + 1:].splitlines()[1:]
    out: dict[str, set[str]] = {"pretrain": set()}
    stack = [(0, "pretrain")]           # (indent, folder)
    current = "pretrain"
    for line in lines:
        indent = len(line) - len(line.lstrip())
        first = line.split()[0] if line.strip() else ""
        if first.endswith("/") and indent < 20:
            while stack and stack[-1][0] >= indent:
                stack.pop()
            current = f"{stack[-1][1]}/{first.rstrip('/')}"
            stack.append((indent, current))
            out.setdefault(current, set())
            text_of_line = line.split(first, 1)[1]
        elif indent < 20:
            current, text_of_line = "pretrain", line
        else:
            text_of_line = line
        out[current].update(re.findall(r"\b([a-z_0-9]+\.py)\b", text_of_line))
    return out


def tree_problems(root: Path) -> list[str]:
    tree = documented_tree((root / "docs/architecture.md").read_text())
    folders = {str(p.parent.relative_to(root)) for p in (root / "pretrain").rglob("*.py")}
    out = [f"docs/architecture.md's tree lacks the folder {f}/" for f in sorted(folders - set(tree))]
    out += [f"docs/architecture.md's tree names {f}/, which does not exist" for f in sorted(set(tree) - folders)]
    for folder in sorted(folders & set(tree)):
        files = {p.name for p in (root / folder).glob("*.py") if p.name != "__init__.py"}
        out += [f"docs/architecture.md's tree lacks {folder}/{name}" for name in sorted(files - tree[folder])]
        out += [f"docs/architecture.md's tree names {folder}/{name}, which does not exist"
                for name in sorted(tree[folder] - files)]
    return out


def test_architecture_md_names_every_folder_and_module_of_pretrain():
    assert tree_problems(REPO) == []


def test_the_tree_check_finds_a_missing_and_a_stale_module(tmp_path):
    _write(tmp_path, {"pretrain/loop.py": "", "pretrain/engines/base.py": "", "pretrain/engines/new.py": "",
                      "docs/architecture.md": "## The tree\n\n```\npretrain/\n  loop.py   the loop\n"
                                              "  engines/           base.py, old.py\n```\n"})
    assert tree_problems(tmp_path) == [
        "docs/architecture.md's tree lacks pretrain/engines/new.py",
        "docs/architecture.md's tree names pretrain/engines/old.py, which does not exist"]


def test_no_engine_imports_what_it_trains():
    """An engine runs the Objective it is handed: no module of pretrain/engines/ imports the objectives, the PEFT
    methods or the distillation teacher (they reach the engine only through engines/base.py's contract)."""
    found = imports(REPO)
    bad = [f"{where}: {m} imports {t}" for m, targets in found.items() if m.startswith("pretrain.engines")
           for t, _, where in targets if t.startswith(("pretrain.objectives", "pretrain.peft", "pretrain.distill"))]
    assert bad == []


def test_validating_recipes_and_the_launchers_import_no_torch():
    """`make config`, `make plan`, `make preprocess` and `make pretrain`'s launcher on a login node compose and
    validate recipes, which imports every optimizer's registration (pretrain/optim/): none of that loads torch or
    megatron-core (~2 s of CPU a command; docs/architecture.md)."""
    code = ("import sys, launch.__main__, launch.preprocess, pretrain.plan.__main__\n"
            "from pretrain.config.compose import load_recipe\n"
            "from pretrain.plan.estimate import make_plan\n"
            "for recipe in ('gpt-7b', 'deepseek-v3', 'gpt-tiny-distill', 'llama-8b-fp8'):\n"
            "    make_plan(load_recipe(recipe))\n"
            "for name in ('muon', 'lion', 'adafactor'):\n"
            "    make_plan(load_recipe('gpt-tiny', [f'optim={name}']))\n"
            "print(sorted(m for m in ('torch', 'megatron', 'deepspeed', 'transformers') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr[-3000:]
