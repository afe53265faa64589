"""README and docs/ say what is true today (issue 21): every relative link resolves, every file and test they
name exists, the rules table is the generated one, README stays a front page, and every command in a code block
runs as written (in this process, in a scratch folder that sees the repository), with the exit code it is
annotated with (``# exit N``; none means 0)."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest
from conftest import ROOT, in_process, mbmem, train

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Paths the prose names as files of this repository (a moved module must not leave a stale name behind).
REPO_PATH = re.compile(r"`((?:src|tests|bench|scripts|overlays|recipes|examples|docs|requirements)/[\w./-]+"
                       r"|train\.py|Makefile|pyproject\.toml)`")
TEST_REF = re.compile(r"`?((?:tests/)?(?:gpu/)?test_\w+\.py)::(\w+\*?)")  # test_x_* names a family
EXIT_NOTE = re.compile(r"\s+#\s*exit\s+(\d+)\s*$")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.MULTILINE)}


def _prose(path: Path) -> str:
    return FENCE.sub("", path.read_text())


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    bad = []
    for m in LINK.finditer(_prose(doc)):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not bad, f"{doc.name}: broken links: {bad}"


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to a page under docs/"
    linked = {m.group(1) for m in LINK.finditer((ROOT / "README.md").read_text()) if m.group(1)}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= {t.partition("#")[0] for t in linked}, f"pages README does not link: {pages - linked}"


@pytest.mark.parametrize("doc", [*DOCS, *sorted((ROOT / "overlays" / "mem").glob("*.yaml"))], ids=lambda p: p.name)
def test_named_files_and_tests_exist(doc):
    text = _prose(doc) if doc.suffix == ".md" else doc.read_text()
    missing = [p for p in REPO_PATH.findall(text) if not (ROOT / p.rstrip(".")).exists()]
    for file, name in TEST_REF.findall(text):
        path = ROOT / (file if file.startswith("tests/") else f"tests/{file}")
        pattern = rf"{name[:-1]}\w*" if name.endswith("*") else rf"{name}\b"
        if not path.exists() or not re.search(rf"^\s*(?:async\s+)?def {pattern}", path.read_text(), re.MULTILINE):
            missing.append(f"{file}::{name}")
    # Overlay YAML comments name rule modules relative to the package (core/rules/x.py).
    if doc.suffix == ".yaml":
        missing += [p for p in re.findall(r"\b(core/rules/\w+\.py)", text)
                    if not (ROOT / "src" / "mbmem_overlays" / p).exists()]
    assert not missing, f"{doc.name} names files or tests that do not exist: {missing}"


def test_rules_table_is_generated_from_the_checks():
    from mbmem_overlays.core import rules
    text = (ROOT / "docs" / "rules.md").read_text()
    table = text.split("<!-- rules-table -->\n", 1)[1].split("\n<!-- /rules-table -->", 1)[0]
    assert table == rules.markdown_table(), ("docs/rules.md's rules table differs from the checks; regenerate it with "
                                             "python -c 'from mbmem_overlays.core import rules; print(rules.markdown_table())'")


# ----------------------------------------------------------------------------- commands, run as written
def documented_commands() -> list[tuple[str, str, int, str | None]]:
    """(page, command, expected exit code, shown output) for each ``mbmem ...`` and ``python train.py ...`` line in
    a shell code block of README.md and docs/ (``\\`` continuations joined; blocks tagged ``no-run`` are skipped).
    A block of one command followed by an ``output`` block shows (part of) what it prints."""
    found = []
    for doc in DOCS:
        blocks = list(FENCE.finditer(doc.read_text()))
        for i, m in enumerate(blocks):
            info, body = m.group(1).strip(), m.group(2)
            if "no-run" in info or (info and info.split()[0] not in ("", "bash", "sh", "shell", "console")):
                continue
            follows = blocks[i + 1] if i + 1 < len(blocks) else None
            shown = (follows.group(2) if follows is not None and follows.group(1).strip() == "output"
                     and not doc.read_text()[m.end():follows.start()].strip() else None)
            for line in body.replace("\\\n", " ").splitlines():
                line = re.sub(r"^(?:\$\s+|\.venv/bin/)", "", line.strip())
                line = re.sub(r"^\.venv/bin/python ", "python ", line)
                note = EXIT_NOTE.search(line)
                expected = int(note.group(1)) if note else 0
                line = EXIT_NOTE.sub("", line)
                line = re.sub(r"\s+#\s.*$", "", line)  # a trailing comment
                if line.startswith(("mbmem ", "python train.py ")):
                    found.append((doc.name, line, expected, shown))
    return found


COMMANDS = documented_commands()


def documented_python() -> list[tuple[str, str]]:
    """(page, code) for each ``python`` code block of README.md and docs/ not tagged ``no-run``."""
    return [(doc.name, m.group(2)) for doc in DOCS for m in FENCE.finditer(doc.read_text())
            if m.group(1).split()[:1] == ["python"] and "no-run" not in m.group(1)]


PYTHON = documented_python()


@pytest.fixture
def scratch(tmp_path):
    """A folder that sees the repository's top-level entries, so that a command writing ``job.sh`` or
    ``plan.png`` writes there, never into the checkout."""
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv"):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


@pytest.mark.bridge
@pytest.mark.parametrize("page,command,expected,shown", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c, _, _ in COMMANDS])
def test_documented_commands_run_as_written(bridge, scratch, page, command, expected, shown):
    argv = shlex.split(command)
    env = {"MBMEM_RUNS_DIR": str(scratch / ".runs"), "MBMEM_QUIET": "1", "CUDA_VISIBLE_DEVICES": ""}
    before = dict(os.environ)
    if argv[0] == "mbmem":
        out = mbmem(*argv[1:], env=env, cwd=scratch)
    else:
        out = train(*argv[2:], env=env, cwd=scratch)
    assert dict(os.environ) == before
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == expected, f"{page}: {command}\nexit {out.returncode}\n{out.stderr[-3000:]}"
    if "--json" in argv or "run.json=true" in argv:
        assert "schema_version" in json.loads(out.stdout)
    elif argv[0] == "python" and expected == 0:  # no GPU here: train.py plans, and Bridge's validation passed
        assert "validation: PASSED" in out.stdout and "dry run" in out.stdout, out.stdout[-2000:]
    if shown is not None:  # each line the page shows is a line of the real output ("..." ends a shortened one)
        printed = [line.rstrip() for line in out.stdout.splitlines()]
        for line in filter(str.strip, shown.splitlines()):
            head = line.rstrip().removesuffix("...").rstrip()
            assert any(p.startswith(head) for p in printed) if line.rstrip().endswith("...") else line.rstrip() \
                in printed, f"{page}: {command}\nshown but not printed: {line!r}\n{out.stdout[-3000:]}"


@pytest.mark.bridge
@pytest.mark.parametrize("page,code", PYTHON, ids=[f"{p}:{i}" for i, (p, _) in enumerate(PYTHON)])
def test_documented_python_runs_as_written(bridge, scratch, page, code):
    def run(argv):
        exec(compile(code, f"<{page}>", "exec"), {"__name__": "__main__"})
        return 0
    before = dict(os.environ)
    out = in_process(run, [], env={"MBMEM_QUIET": "1"}, cwd=scratch, argv0=page)
    assert dict(os.environ) == before
    assert out.returncode == 0 and "Traceback" not in out.stderr, f"{page}:\n{code}\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"{page}: the example printed nothing"


def test_readme_overlay_table_names_every_overlay_with_its_aliases():
    """The front page's overlay table lists every built-in overlay, each with its aliases (issue 40)."""
    from mbmem_overlays.core.catalog import Catalog
    text = (ROOT / "README.md").read_text()
    table = text.split("\n## Overlays\n", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): set(re.findall(r"`(\w+)`", m.group(2) or ""))
            for m in re.finditer(r"^\| `(\w+)`(?: \(([^)]*)\))? \|", table, re.MULTILINE)}
    catalog = Catalog()
    builtin = {name: set(spec.aliases) for name, spec in catalog.specs.items() if spec.builtin}
    assert rows == builtin, f"README's overlay table differs from overlays/mem/: {set(rows) ^ set(builtin)}"
