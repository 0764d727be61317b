"""The shape of the repository (issues 35, 43 and 66): no import circle among the top-level modules,
the core modules that stand alone import nothing of ours beyond the Rollout record (and the loss
module's dropout guard), minimal.py nothing at all, no top-level module imports the comparison
harness, the loop plain and running the update a reader studies, and every script of the harness
starts from its documented path. Issue 66 removed the caps on lines per file and per function and
on the README's bytes: they split the textbook into helpers."""
import ast
import dataclasses
import functools
import glob
import os
import runpy
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports, at the top or inside a function: the top-level
    ones by their names (train), the machinery's as infra.NAME (from infra import cli: infra.cli)."""
    paths = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "infra", "*.py"))
    modules = {os.path.relpath(p, ROOT)[:-3].replace(os.sep, "."): p for p in paths
               if not p.endswith("__init__.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (a list that starts and ends with the same module), or None."""
    done, path = set(), []

    def visit(name):
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        path.append(name)
        for other in sorted(graph[name]):
            if found := visit(other):
                return found
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if found := visit(name):
            return found
    return None


def test_circle_finds_a_circle_and_only_one():
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_and_the_core_stands_alone():
    graph = import_graph()
    assert {"train", "infra.cli", "infra.loading", "infra.demo_model", "infra.engineered_update",
            "replay_rl", "buffer", "rollout"} <= set(graph)
    assert circle(graph) is None, f"import circle: {' -> '.join(circle(graph))}"
    # copy one file into another project and it works: the buffer needs nothing of ours, the
    # loss the Rollout record, the rollouts that and the loss module's dropout guard; the textbook
    # nothing at all
    assert graph["buffer"] == set() and graph["minimal"] == set()
    assert graph["replay_rl"] <= {"buffer"} and graph["rollout"] <= {"buffer", "replay_rl"}
    assert not any("train" in deps for name, deps in graph.items() if name not in ("evaluate",))
    # the machinery serves the loops: no module of infra/ imports a file a user runs
    entry = {"train", "async_rl", "evaluate", "minimal"}
    assert not [name for name, deps in graph.items() if name.startswith("infra.") and deps & entry]


def test_the_top_level_shows_the_method():
    """Issue 61: at most 8 .py files at the top level (the method's four and the few a user runs or
    reads first); the machinery in one folder, infra/."""
    top = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")))
    assert {"replay_rl.py", "buffer.py", "rollout.py", "train.py"} <= set(top) and len(top) <= 8, top
    assert os.path.isfile(os.path.join(ROOT, "infra", "__init__.py"))


def test_no_top_level_module_imports_the_harness():
    """The arrows run one way: the harness (comparison/) uses train.py and its infrastructure, never
    the reverse; what a run draws of itself (curves.py) lives beside it."""
    harness = {"comparison"} | {os.path.basename(p)[:-3]
                                for p in glob.glob(os.path.join(ROOT, "comparison", "*.py"))}
    wrong = []
    for path in sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "infra", "*.py"))):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            wrong += [f"{os.path.basename(path)}:{node.lineno} imports {name}"
                      for name in names if name.split(".")[0] in harness]
    assert wrong == [], "a module below the harness imports from comparison/"


# the harness's commands (its other files are modules of theirs: records.py, stats.py, ...)
SCRIPTS = sorted(p for p in glob.glob(os.path.join(ROOT, "comparison", "*.py"))
                 if 'if __name__ == "__main__":' in open(p).read())


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_each_harness_script_starts_from_its_path(script, monkeypatch, capsys, tmp_path):
    """python comparison/X.py --help, as the docs run it, from another folder: its imports resolve."""
    monkeypatch.chdir(tmp_path)
    # as a fresh process sees it: the script's folder, none of the project's (the script adds them),
    # nor the project's modules that other tests imported (a venv inside the clone, as CI's, stays)
    ours = {os.path.realpath(os.path.join(ROOT, d)) for d in ("", "comparison", "benchmarks", "infra")}
    monkeypatch.setattr(sys, "path", [os.path.dirname(script)] + [p for p in sys.path
                                                                  if p and os.path.realpath(p) not in ours])
    for name, module in list(sys.modules.items()):
        if os.path.dirname(os.path.realpath(getattr(module, "__file__", None) or "/")) in ours:
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(script, run_name="__main__")
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def test_the_loop_is_plain_and_runs_the_update_the_reader_studies():
    """Issue 66: train.py's loop is plain for and if in train() itself (no generator yields loop
    tokens: no yield in train.py, async_rl.py); its default step is replay_rl.update_step itself
    (the engineered one only where a flag asks for it); and the loop's steps come in the README's
    order."""
    import replay_rl
    import train
    from infra import engineered_update
    for path in ("train.py", "async_rl.py"):
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Yield, ast.YieldFrom))], path
    cfg = train.Config()
    plain = train.the_update(cfg, 1)                            # (a module reloaded by another
    assert (plain.__module__, plain.__name__) == ("replay_rl", "update_step")   # test: by name)
    assert isinstance(train.the_update(cfg, 2), functools.partial)              # torchrun
    assert not engineered_update.needed(cfg, 1) and engineered_update.needed(
        dataclasses.replace(cfg, micro_batch_size=4), 1)
    source = open(os.path.join(ROOT, "train.py")).read()
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "train")
    body = ast.get_source_segment(source, fn)
    loop = body[body.index("while not budget_spent(run)"):]
    assert "update = the_update(cfg" in body and "generators" not in body
    order = ["state.round += 1", "draw_prompts(", "generate_round(", "add_to_buffer(", "holds(run)",
             "for k in range(K)", "sample_batch(run)", "update(run.model", "record_step(",
             "held_out_eval(run)", "end_of_round(run)", "finish(run)"]
    at = [loop.index(name) for name in order]
    assert at == sorted(at), "train(): the loop's steps out of the README's order"


def readme_section(title: str) -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_has_a_reading_order_that_names_what_exists():
    """Each step of the reading order names a file and functions or classes that are defined there
    (a rename that leaves it stale fails)."""
    import re
    order = " ".join(next(p for p in readme_section("Reading order").split("\n\n")
                          if p.startswith("1. ")).split())                          # the numbered list
    steps = re.findall(r"\d\. \*\*`(\w+\.py)`\*\*(.*?)(?= \d\. \*\*|$)", order)
    assert [file for file, _ in steps] == ["buffer.py", "replay_rl.py", "rollout.py", "train.py"]
    def defined_in(file):
        return {n.name for n in ast.walk(ast.parse(open(os.path.join(ROOT, file)).read()))
                if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    checked = 0
    for file, text in steps:
        for prefix, name in re.findall(r"`(?:(\w+)\.)?(\w+)(?:\(\))?`", text):
            if name != "generate":              # Hugging Face's method, which the recorder hooks into
                where = "infra/stopping.py" if prefix == "stop" else file   # train()'s StopRequest
                assert name in defined_in(where), f"README reading order: {name} not in {where}"
                checked += 1
    assert checked >= 10


CORE = ["minimal.py", "replay_rl.py", "rollout.py", "buffer.py", "train.py"]


@pytest.mark.parametrize("path", CORE)
def test_core_lines_fit_100_characters(path):
    """Issue 43: the five files of the reading order read without sideways scrolling."""
    long = [i for i, line in enumerate(open(os.path.join(ROOT, path)).read().splitlines(), 1)
            if len(line) > 100]
    assert not long, f"{path}: lines over 100 characters: {long}"


def test_the_readme_s_section_of_the_loss_copies_and_runs():
    """The README's section of replay_rl.py to copy for the loss (named by its two marker lines, no
    longer by line numbers: a fourth reader found those stale, beginning inside completion_logp):
    the section, with LOSS_TYPES and NORMALIZATIONS, runs with torch alone, holds policy_loss's
    def, and gives replay_rl's loss on the same inputs."""
    import re
    import torch
    import replay_rl
    start, end = re.search(r"the section `(# ---- [^`]+)` of `replay_rl.py`, up to\s+`(# ---- [^`]+)`",
                           open(os.path.join(ROOT, "README.md")).read()).groups()
    lines = open(os.path.join(ROOT, "replay_rl.py")).read().splitlines()
    a = next(i for i, line in enumerate(lines) if line.startswith(start))
    b = next(i for i, line in enumerate(lines) if line.startswith(end))
    assert a < b and any(line.startswith("def policy_loss(") for line in lines[a:b])
    copied = "\n".join(["import torch", *[line for line in lines if line.startswith(
        ("LOSS_TYPES", "NORMALIZATIONS"))], *lines[a:b]])
    space = {}
    exec(compile(copied, "copied", "exec"), space)      # the repository's own code, not output
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    args = (logp, torch.tensor([[-0.7, -0.9]]), torch.tensor([1.5]), torch.ones(1, 2))
    assert space["policy_loss"](*args)[0].item() == replay_rl.policy_loss(*args)[0].item()
