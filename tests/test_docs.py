"""The documents' links: every relative link to a file or a heading (``docs/RESULTS.md#...``, ``#...``) resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def headings(path: Path) -> list[tuple[str, str]]:
    """``(heading line, anchor)`` of a markdown file's headings, in order, with GitHub's anchors: lower case,
    punctuation dropped, spaces to hyphens, repeats numbered (-1, -2, ...); headings inside code blocks are not
    headings."""
    seen: dict[str, int] = {}
    out = []
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        text = re.sub(r"[`*]", "", line.lstrip("#").strip()).lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.append((line, slug if n == 0 else f"{slug}-{n}"))
    return out


def anchors(path: Path) -> set[str]:
    """The heading anchors of a markdown file (:func:`headings`)."""
    return {anchor for _, anchor in headings(path)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.name}: " + "; ".join(broken)


# ------------------------------------------------------------------------------------------- commands and figures
FENCE = re.compile(r"^```")
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:x\b|×|tok/s|tokens/s|ms\b|MiB\b|GiB\b|MB\b|%)")
INLINE_COMMAND = re.compile(r"`(?:\.venv[\w.-]*/bin/\S+|vase |python |benchmarks/|make |bash benchmarks/|lscpu|free )")


def _blocks(path: Path) -> tuple[list[str], list[str]]:
    """``(prose lines, fenced code lines)`` of a markdown file."""
    prose, code, fenced = [], [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        (code if fenced else prose).append(line)
    return prose, code


def _shell_lines(doc: Path) -> list[str]:
    """The lines of a document's shell code blocks (```bash, ```sh or unlabelled; not Python, not output)."""
    lines, fence = [], None
    for line in doc.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fence = None if fence is not None else (line[3:].strip() or "sh")
            continue
        if fence in ("bash", "sh", "shell"):
            lines.append(line)
    return lines


def _commands(doc: Path) -> list[list[str]]:
    """The shell commands of a document's shell code blocks (continuation lines joined, comments dropped), split."""
    import shlex

    out, pending = [], ""
    for line in _shell_lines(doc):
        line = pending + line.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        try:
            out.append(shlex.split(line))
        except ValueError:  # not a shell line (Python, a table)
            continue
    return out


def _vase_options() -> dict[str, set[str]]:
    """Every ``vase`` subcommand and the options it takes."""
    import typer

    from vase.cli import app

    out = {}
    for name, cmd in typer.main.get_command(app).commands.items():
        out[name] = {o for p in cmd.params for o in p.opts + p.secondary_opts} | {"--help"}
        for sub, subcmd in getattr(cmd, "commands", {}).items():  # a group: vase bench paired ...
            out[f"{name} {sub}"] = {o for p in subcmd.params for o in p.opts + p.secondary_opts} | {"--help"}
    return out


def _script_options(path: Path) -> set[str]:
    """The options a benchmark script declares (``add_argument("--x", ...)``), from its source."""
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text())) | {"--help", "-h"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_documented_commands_name_real_programs_and_flags(doc):
    """Every ``vase`` command, ``python -m vase...`` module and ``benchmarks/`` script in a document's code blocks
    exists and takes the flags written (vLLM's own flags, after ``python -m vase.vllm.serve`` / ``bench``, are vLLM's
    to check)."""
    vase = _vase_options()
    wrong = []
    for argv in _commands(doc):
        args = [a for a in argv if "=" not in a or a.startswith("-")]  # VAR=value prefixes dropped
        if args and args[0] in ("make",):
            targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
            wrong += [f"make {t}" for t in args[1:] if not t.startswith("-") and t not in targets]
            continue
        prog = next((i for i, a in enumerate(args) if a.endswith("vase") or a.endswith("python")), None)
        if prog is None:
            prog = next((i for i, a in enumerate(args) if a.startswith("benchmarks/")), None)
            if prog is None:
                continue
            prog -= 1
        rest = args[prog + 1 :]
        if args[prog].endswith("vase"):
            if not rest or rest[0] not in vase:
                wrong.append(" ".join(argv))
                continue
            name, opts = rest[0], rest[1:]
            if len(rest) > 1 and f"{rest[0]} {rest[1]}" in vase:
                name, opts = f"{rest[0]} {rest[1]}", rest[2:]
            flags = {a.split("=")[0] for a in opts if a.startswith("-")}
            wrong += [f"vase {name} {f}" for f in sorted(flags - vase[name])]
        elif rest[:2] == ["-m", "vase.vllm.serve"] or rest[:2] == ["-m", "vase.vllm.bench"]:
            if rest[1] == "vase.vllm.serve" and "--vase" not in rest and "--help" not in rest:
                wrong.append(" ".join(argv) + " (no --vase)")
        elif rest and rest[0].startswith("benchmarks/"):
            script = ROOT / rest[0]
            if not script.is_file():
                wrong.append(f"{rest[0]}: no such script")
            elif script.suffix == ".py":
                flags = {a.split("=")[0] for a in rest[1:] if a.startswith("--")}
                wrong += [f"{rest[0]} {f}" for f in sorted(flags - _script_options(script))]
    assert not wrong, f"{doc.name}: commands that would fail: " + "; ".join(wrong)


def _sections(doc: Path):
    """``(heading, prose, code)`` per section (``#`` to ``###`` headings) of a markdown file."""
    out, head, lines, fenced = [], "(top)", [], False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if not fenced and re.match(r"#{1,3} ", line):
            out.append((head, lines))
            head, lines = line, []
        else:
            lines.append(line)
    out.append((head, lines))
    for head, lines in out:
        prose, code, fenced = [], [], False
        for line in lines:
            if FENCE.match(line):
                fenced = not fenced
                continue
            (code if fenced else prose).append(line)
        yield head, "\n".join(prose), code


def _has_command(prose: str, code: list[str]) -> bool:
    return any(line.strip() and not line.startswith("|") for line in code) or bool(INLINE_COMMAND.search(prose))


def _commanded_sections() -> set[tuple[str, str]]:
    """``(file name, anchor)`` of every section that gives a command."""
    out = set()
    for doc in DOCS:
        slugs = iter(_section_anchors(doc))
        for (_, prose, code), slug in zip(_sections(doc), slugs):
            if _has_command(prose, code):
                out.add((doc.name, slug))
    return out


def _section_anchors(doc: Path) -> list[str]:
    """The anchor of each section of :func:`_sections` (``''`` for the text before the first heading)."""
    return ["", *(anchor for line, anchor in headings(doc) if re.match(r"#{1,3} ", line))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_figure_comes_with_its_command(doc):
    """A measured figure (a ratio, tokens/s, ms, MiB, a percentage) comes with the command that produced it: within
    its section (a code block, or inline), or, in a summary, its paragraph (or table row) links to the section that
    gives it."""
    commanded = _commanded_sections()
    missing = []
    for head, prose, code in _sections(doc):
        if _has_command(prose, code):
            continue
        for para in re.split(r"\n\s*\n|\n(?=[-*|] )", prose):
            figures = FIGURE.findall(re.sub(r"`[^`]*`", "", para))
            if not figures:
                continue
            links = []
            for target in LINK.findall(para):
                file, _, anchor = target.partition("#")
                links.append(((doc.parent / file).name if file else doc.name, anchor))
            if not any(link in commanded for link in links):
                missing.append(f"{head.strip('# ')}: {', '.join(figures[:3])}")
    assert not missing, f"{doc.name}: figures without their command: " + "; ".join(missing)
