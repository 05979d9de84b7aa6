"""The README's walkthrough, run as written: the demo trained into runs/demo, evaluated,
exported to models/demo and the export evaluated, each command copied from the README.
Also: the README stays short, every relative link of the README and docs/*.md resolves, and
every `python -m owt_tf.<module>` command they show names a module and flags that exist."""
from __future__ import annotations

import functools
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WALKTHROUGH_PATHS = ("runs/demo", "models/demo")
README_MAX_LINES = 300
README_START = "# owt_tf\n\n```bash\npip install -e .[test]\npython -m pytest -q\n```\n"


def markdown_files() -> list:
    """README.md and every docs/*.md, as paths relative to the repository."""
    return ["README.md"] + sorted(os.path.relpath(p, ROOT)
                                  for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def code_blocks(text: str, languages=("bash",)) -> list:
    """The bodies of the fenced code blocks whose language is one of `languages`."""
    return [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
            if lang in languages]


def owt_tf_commands(block: str) -> list:
    """Every `python -m owt_tf.*` command of a code block, without its comment, a command
    continued over lines (a trailing backslash) joined into one."""
    lines, joined = [], ""
    for line in block.splitlines():
        part = line.split(" #")[0].rstrip()
        if part.endswith("\\"):
            joined += part[:-1].strip() + " "
            continue
        lines.append(joined + part.strip())
        joined = ""
    return [line for line in lines if re.match(r"python -m owt_tf\.[\w.]+(\s|$)", line)]


def walkthrough_commands() -> list:
    """Every `python -m owt_tf.*` line of the README's bash blocks that uses the
    walkthrough's run or model directory, in README order, without its comment."""
    return [command for block in code_blocks(_read("README.md"))
            for command in owt_tf_commands(block)
            if any(p in command for p in WALKTHROUGH_PATHS)]


def test_the_walkthrough_is_train_evaluate_export_evaluate():
    modules = [shlex.split(c)[2] for c in walkthrough_commands()]
    assert modules[0] == "owt_tf.train" and "owt_tf.export" in modules, modules
    assert modules.index("owt_tf.export") < len(modules) - 1  # the export is evaluated too


@pytest.mark.slow
def test_readme_walkthrough_runs_as_written(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for command in walkthrough_commands():
        proc = subprocess.run([sys.executable] + shlex.split(command)[1:], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        if "owt_tf.evaluate" in command:
            assert re.search(r"top-1 error [0-9.]+%", proc.stdout), proc.stdout
        if "--ten-crop" in command:  # digits train without mirror images
            assert "trains without mirror images" in proc.stderr, proc.stderr[-2000:]
        if "owt_tf.train" in command:
            assert "writing to runs/demo" in proc.stdout, proc.stdout[:2000]
            with open(tmp_path / "runs" / "demo" / "run_config.json") as f:
                assert json.load(f)["run"]["logdir"] == "runs/demo"
            _assert_the_demo_learned(proc.stdout, tmp_path / "runs" / "demo")
    assert os.path.exists(tmp_path / "models" / "demo" / "1" / "saved_model.pb")


def _assert_the_demo_learned(stdout: str, logdir) -> None:
    """The demo as shipped (600 steps, K=2, owt-b) learns digits (chance: 90 % error; the
    README shows 0.84 %), sends activations, and leaves its last checkpoint and TensorBoard
    events. The suite's one run of the whole demo: this walkthrough's first command."""
    done = re.search(r"^done: 600 steps .*\| val top-1 error ([0-9.]+)% .* loss ([0-9.]+) \| "
                     r"[0-9]+ img/s \| ([0-9.]+) MB/step/replica", stdout, re.M)
    assert done, stdout[-2000:]
    assert float(done.group(1)) < 10.0, done.group(0)  # its loss matched a number: finite
    assert float(done.group(3)) > 0, done.group(0)
    assert (logdir / "checkpoints" / "ckpt-600.index").exists(), os.listdir(logdir / "checkpoints")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logdir))


def test_readme_is_short_and_starts_with_the_set_up_commands():
    text = _read("README.md")
    assert text.startswith(README_START), text[:200]
    assert len(text.splitlines()) < README_MAX_LINES, len(text.splitlines())


def heading_anchors(text: str) -> set:
    """The anchors GitHub gives a page's headings (outside code blocks): lower case,
    punctuation dropped, spaces as hyphens, a repeated one numbered -1, -2, ..."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def relative_links(text: str) -> list:
    """The targets of a page's Markdown links and images that are not URLs, outside code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    return [t for t in targets if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", t)]


def test_markdown_link_helpers():
    page = ("# Title: one\n\n## `--scheme` auto's rule\n\n```bash\n# not a heading\n```\n"
            "[a](docs/x.md#y) ![i](study/p.png) [u](https://e.org) `[c](skip.md)` [h](#title-one)\n")
    assert heading_anchors(page) == {"title-one", "--scheme-autos-rule"}
    assert relative_links(page) == ["docs/x.md#y", "study/p.png", "#title-one"]
    # a program's output that starts with the command's name is not a command
    block = ("python -m owt_tf.train --a 1 \\\n    --b 2   # note\ntensorboard --logdir runs\n"
             "python -m owt_tf.train: alexnet_tiny on digits\n")
    assert owt_tf_commands(block) == ["python -m owt_tf.train --a 1 --b 2"]
    prose = "Run `python -m owt_tf.plan --json`, not `python -m owt_tf.*`.\n```bash\nx\n```\n"
    assert inline_commands(prose) == ["python -m owt_tf.plan --json"]


def test_every_relative_link_of_the_readme_and_docs_resolves():
    broken = []
    for page in markdown_files():
        text = _read(page)
        for target in relative_links(text):
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path \
                else os.path.join(ROOT, page)
            if not os.path.exists(full):
                broken.append(f"{page}: {target} (no file {os.path.relpath(full, ROOT)})")
            elif anchor and full.endswith(".md"):
                with open(full) as f:
                    if anchor not in heading_anchors(f.read()):
                        broken.append(f"{page}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def inline_commands(text: str) -> list:
    """The `python -m owt_tf.*` commands quoted as inline code in a page's prose."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return owt_tf_commands("\n".join(re.findall(r"`([^`\n]+)`", text)))


def shown_commands() -> list:
    """(page, command) for every `python -m owt_tf.*` command in a bash block of README.md
    or docs/*.md, in a plain block where a command is shown above its output, and quoted
    inline in the prose."""
    found = []
    for page in markdown_files():
        text = _read(page)
        for block in code_blocks(text, ("bash", "")):
            found += [(page, command) for command in owt_tf_commands(block)]
        found += [(page, command) for command in inline_commands(text)]
    return found


@functools.lru_cache(maxsize=None)
def module_help(module: str) -> str:
    """`python -m owt_tf.<module> --help`, run once per module."""
    env = {**os.environ, "COLUMNS": "200",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", f"owt_tf.{module}", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"owt_tf.{module} --help\n{proc.stderr[-2000:]}"
    return proc.stdout


def command_flags(command: str) -> list:
    """(module, --flag) for each long flag of a shown command; launch's flags after `--`
    are train's."""
    words = shlex.split(command)
    module = words[2][len("owt_tf."):]
    found = []
    for word in words[3:]:
        if word == "--" and module == "launch":
            module = "train"
        elif word.startswith("--") and len(word) > 2:
            found.append((module, word.split("=")[0]))
    return found


def test_command_flags_split_launch_from_train():
    assert command_flags("python -m owt_tf.launch --workers 2 -- --steps 6 --lr=0.1") == [
        ("launch", "--workers"), ("train", "--steps"), ("train", "--lr")]


def test_every_shown_command_names_a_module_and_its_flags():
    commands = shown_commands()
    assert len(commands) > 20 and {p for p, _ in commands} >= {"README.md", "docs/cli.md"}
    wrong = []
    for page, command in commands:
        module = shlex.split(command)[2][len("owt_tf."):]
        if not os.path.exists(os.path.join(ROOT, "owt_tf", *module.split(".")) + ".py"):
            wrong.append(f"{page}: {command}: no module owt_tf/{module}.py")
            continue
        for owner, flag in command_flags(command):
            if not re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", module_help(owner)):
                wrong.append(f"{page}: {command}: {flag} is not in owt_tf.{owner} --help")
    assert not wrong, "\n".join(wrong)


def test_every_file_docs_design_names_exists():
    """docs/design.md's map of the tree: each `dir/file.py` (or .md) it names is there,
    from the repository, owt_tf/ or docs/."""
    text = _read("docs/design.md")
    named = set(re.findall(r"([A-Za-z_][\w.-]*(?:/[\w.-]+)+\.(?:py|md))", text))
    assert len(named) > 40, named  # the map is read
    missing = [path for path in sorted(named)
               if not any(os.path.exists(os.path.join(ROOT, base, path))
                          for base in ("", "owt_tf", "docs"))]
    assert not missing, missing
