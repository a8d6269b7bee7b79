"""The documentation cannot rot: its code runs, its site builds strictly, its figures are printed.

- Every ```python block of README.md and docs/**/*.md runs, the blocks of one page in order in
  one namespace, in a fresh process whose working directory is a temporary folder. A block opts
  out only by being ```bash or ```text (every fence must name its language). Where a page shows
  realistic sizes (a million-step run), `SMALL` lists the replacements that shrink it for the
  test; each must still match the page, so a shrunk snippet cannot drift from the shown one.
- `mkdocs build --strict` builds the site into a temporary folder; broken links and missing
  API references fail it (checked on a deliberately broken copy).
- README.md stays a front page (at most 250 lines) carrying the two commands verbatim.
- The figures the docs quote about `data/breakout_store` are what the named command prints.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
LANGUAGES = {"python", "bash", "text", "json", "yaml", "toml"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)

MAIN_JOB = 'pip install torch==2.13.0 -e ".[atari]" && python scripts/train_dqn.py'
TEST_JOB = 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q'
README_MAX_LINES = 250
DOCS_INSTALL = 'pip install -e ".[docs]"'

# Replacements that shrink a page's snippets for the test (page relative to the repo root).
SMALL: dict[str, list[tuple[str, str]]] = {
    "docs/guides/sb3.md": [
        ("buffer_size=1_000_000", "buffer_size=2_000"),
        ("model.learn(100_000)", "model.learn(64)"),
        ("total_steps, save_every = 1_000_000, 50_000", "total_steps, save_every = 96, 32"),
    ],
    "docs/guides/ray.md": [("a.run.remote(1000)", "a.run.remote(200)")],
    "docs/guides/cleanrl.md": [("    1_000_000, envs", "    2_000, envs")],
}
# Optional packages a page's snippets import, and the extra that installs them.
NEEDS: dict[str, tuple[list[str], str]] = {
    "docs/guides/sb3.md": (["stable_baselines3", "ale_py"], "sb3,atari"),
    "docs/guides/cleanrl.md": (["stable_baselines3", "ale_py"], "sb3,atari"),
    "docs/guides/ray.md": (["ray", "gymnasium"], "ray,atari"),
    "docs/guides/datasets.md": (["gymnasium", "minari"], "atari,minari"),
    "docs/lifecycle.md": (["gymnasium"], "atari"),
}


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, its text and the page line it starts on."""

    language: str
    code: str
    line: int


def blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown text, in order."""
    return [Block(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 2)
            for m in FENCE.finditer(text)]


def rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def shrink(page: str, code: str) -> tuple[str, set[str]]:
    """`code` with the page's `SMALL` replacements applied, and those that matched."""
    used = set()
    for old, new in SMALL.get(page, []):
        if old in code:
            code, used = code.replace(old, new), used | {old}
    return code, used


def skip_or_fail(reason: str) -> None:
    """Skip where an optional tool is missing, but fail in CI, which installs every extra."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: CI installs every extra, so this must not be missing)")
    pytest.skip(reason)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process that imports this checkout's mmreplay."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def test_blocks_finds_fences_and_their_lines():
    text = "# t\n\n```python\nx = 1\n```\ntext\n```bash\nls\n```\n"
    assert blocks(text) == [Block("python", "x = 1\n", 4), Block("bash", "ls\n", 8)]


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_fence_names_its_language(page):
    """An untagged fence would be neither run nor visibly opted out."""
    text = page.read_text()
    found = blocks(text)
    assert text.count("\n```") + text.startswith("```") == 2 * len(found), \
        f"{rel(page)}: an unmatched or indented ``` fence"
    bad = [(b.line, b.language) for b in found if b.language not in LANGUAGES]
    assert not bad, f"{rel(page)}: fences must name one of {sorted(LANGUAGES)}; got {bad}"


PYTHON_PAGES = [p for p in PAGES if any(b.language == "python" for b in blocks(p.read_text()))]

RUNNER = """
import json, sys
scope = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1])):
    code = "\\n" * (block["line"] - 1) + block["code"]
    exec(compile(code, block["page"], "exec"), scope)
"""


@pytest.mark.integration
@pytest.mark.parametrize("page", PYTHON_PAGES, ids=rel)
def test_python_blocks_run(page, tmp_path):
    """The page's Python blocks, in order, in one namespace, in a fresh process."""
    name = rel(page)
    modules, extra = NEEDS.get(name, ([], ""))
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        skip_or_fail(f"{name} needs {missing}: pip install torch==2.13.0 -e \".[{extra}]\"")
    shrunk, used = [], set()
    for b in blocks(page.read_text()):
        if b.language == "python":
            code, matched = shrink(name, b.code)
            shrunk.append({"page": str(page), "line": b.line, "code": code})
            used |= matched
    unused = {old for old, _ in SMALL.get(name, [])} - used
    assert not unused, f"{name} no longer shows {unused}: update SMALL with the page"
    proc = run_blocks(shrunk, tmp_path)
    assert proc.returncode == 0, f"{name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def run_blocks(shrunk: list[dict], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run blocks in a fresh process whose working directory is an empty temporary folder."""
    (tmp_path / "blocks.json").write_text(json.dumps(shrunk))
    work = tmp_path / "cwd"
    work.mkdir()
    env = child_env(MINARI_DATASETS_PATH=str(tmp_path / "minari"))
    return subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path / "blocks.json")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)


def test_run_blocks_shares_a_namespace_and_reports_the_failing_line(tmp_path):
    second = "assert x == 41\nraise ValueError(x)\n"
    proc = run_blocks([{"page": "p.md", "line": 3, "code": "x = 41\n"},
                       {"page": "p.md", "line": 9, "code": second}], tmp_path)
    assert proc.returncode != 0
    assert 'File "p.md", line 10' in proc.stderr and "ValueError: 41" in proc.stderr


def test_missing_optional_package_fails_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        skip_or_fail("needs x")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        skip_or_fail("needs x")


def test_readme_is_a_front_page_with_both_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, \
        "README.md is a front page: move detail to docs/"
    shell = [b.code for b in blocks(text) if b.language == "bash"]
    for command in (MAIN_JOB, TEST_JOB):
        assert any(command in code.splitlines() for code in shell), \
            f"README.md must carry, on a line of its own in a bash block: {command}"


def test_readme_links_resolve():
    """README.md is not part of the site build, so its relative links are checked here."""
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t and not t.startswith("mailto:")]
    assert local, "README.md links to no docs page"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


# --- the site build --------------------------------------------------------------------------

def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None or (
                "." in module and importlib.util.find_spec(module) is None):
            skip_or_fail(f"the docs build needs {module}: {DOCS_INSTALL}")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
         "--site-dir", str(site)],
        cwd=config.parent, env=child_env(NO_MKDOCS_2_WARNING="1"), capture_output=True,
        text=True, timeout=300)


# What each API reference page must show (mkdocstrings anchors).
API_NAMES = {
    "store": ["mmreplay.ReplayStore.create", "mmreplay.ReplayStore.sample_sequences"],
    "spec": ["mmreplay.StoreSpec"],
    "batch": ["mmreplay.Batch", "mmreplay.SequenceBatch"],
    "errors": ["mmreplay.errors.InvalidInputError", "mmreplay.errors.InvalidStoreError"],
    "sb3": ["mmreplay.integrations.sb3.FrameOnceReplayBuffer"],
    "gymnasium": ["mmreplay.integrations.gymnasium.RecordToStore"],
    "ray": ["mmreplay.integrations.ray.start_store_actor", "mmreplay.integrations.ray.BlockWriter",
            "mmreplay.integrations.ray.RemoteBatches"],
    "datasets": ["mmreplay.datasets.dopamine.import_dopamine",
                 "mmreplay.datasets.minari.import_minari"],
}


@pytest.mark.integration
def test_site_builds_strictly(tmp_path):
    proc = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-6000:]
    for page, names in API_NAMES.items():
        html = (tmp_path / "site" / "api" / page / "index.html").read_text()
        missing = [n for n in names if f'id="{n}"' not in html]
        assert not missing, f"api/{page}.md did not render {missing}"


def broken_copy(tmp_path: Path, addition: str) -> Path:
    """A copy of the site's sources whose Getting started page ends with `addition`."""
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    os.symlink(ROOT / "mmreplay", copy / "mmreplay")
    page = copy / "docs" / "getting-started.md"
    page.write_text(page.read_text() + "\n" + addition + "\n")
    return copy / "mkdocs.yml"


@pytest.mark.integration
@pytest.mark.parametrize("addition", [
    "See [the missing page](guides/no-such-page.md).",
    "See [a missing heading](guides/resume.md#no-such-heading).",
    "::: mmreplay.NoSuchName",
], ids=["link", "anchor", "api-reference"])
def test_strict_build_fails_on_broken_references(tmp_path, addition):
    proc = mkdocs_build(broken_copy(tmp_path, addition), tmp_path / "site")
    assert proc.returncode != 0, f"mkdocs build --strict accepted: {addition}"


# --- figures the docs quote ------------------------------------------------------------------

INSPECTION = DOCS / "guides" / "inspection.md"
FIGURE_ROW = re.compile(r"^\|([^|]+)\|([^|]+)\|\s*`([\w.]+)`\s*\|$", re.M)


def run_cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "mmreplay", *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def quoted_mismatches(table: str, printed: dict) -> list[str]:
    """Rows of a "figure | value | `json.field`" table whose value differs from `printed`."""
    wrong = []
    for figure, shown, field in FIGURE_ROW.findall(table):
        actual = printed
        for key in field.split("."):
            actual = actual[key]
        if not same_figure(shown.strip(), actual):
            wrong.append(f"{figure.strip()}: the docs say {shown.strip()}, the command prints "
                         f"{field} = {actual!r}")
    return wrong


def same_figure(shown: str, actual: object) -> bool:
    """`shown` as the docs write it ("3,016", "201.5 KiB", "103.1×", "zstd") against a value."""
    if shown.endswith(" KiB"):
        return f"{actual / 1024:.1f}" == shown[:-4]  # type: ignore[operator]
    if shown.endswith("×"):
        return f"{actual:.1f}" == shown[:-1]
    if isinstance(actual, int):
        return shown.replace(",", "") == str(actual)
    return shown == str(actual)


def test_quoted_table_check_catches_a_wrong_figure():
    printed = {"disk": {"frames_bytes": 206357, "compression_ratio": 103.126},
               "counts": {"frames_kept": 3016}, "spec": {"codec": "zstd"}}
    right = ("| a | 201.5 KiB | `disk.frames_bytes` |\n| b | 103.1× | `disk.compression_ratio` |\n"
             "| c | 3,016 | `counts.frames_kept` |\n| d | zstd | `spec.codec` |\n")
    assert quoted_mismatches(right, printed) == []
    wrong = right.replace("3,016", "3,015").replace("103.1×", "49.4×")
    assert len(quoted_mismatches(wrong, printed)) == 2


def test_breakout_store_figures_are_what_info_prints():
    text = INSPECTION.read_text()
    assert "mmreplay info data/breakout_store --json" in text
    rows = FIGURE_ROW.findall(text)
    assert len(rows) >= 8, "the figures table of the inspection guide is missing"
    printed = json.loads(run_cli("info", "data/breakout_store", "--json"))
    assert quoted_mismatches(text, printed) == []


def transcripts() -> list[tuple[str, Block]]:
    """```text blocks that show one `$ mmreplay ...` command on a shipped store and its output."""
    found = []
    for page in PAGES:
        for b in blocks(page.read_text()):
            lines = b.code.splitlines()
            if (b.language == "text" and len(lines) > 1 and lines[0].startswith("$ mmreplay ")
                    and not any(line.startswith("$ ") for line in lines[1:])
                    and "data/" in lines[0]):
                found.append((rel(page), b))
    return found


@pytest.mark.parametrize("page,block", transcripts(), ids=lambda x: getattr(x, "line", x))
def test_transcript_is_what_the_command_prints(page, block):
    command, *shown = block.code.splitlines()
    printed = run_cli(*command.removeprefix("$ mmreplay ").split())
    assert [line.rstrip() for line in printed.splitlines()] == [s.rstrip() for s in shown], \
        f"{page}:{block.line}: {command!r} prints something else now"


def test_transcripts_are_found():
    assert any("episodes data/breakout_store" in b.code for _, b in transcripts())
