"""The README and docs/ stay true: their commands exist, their links resolve, every setting is documented."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# Folders whose settings.py files are services' settings (not the venv, not tests).
PACKAGES = ("shardline", "gateway", "tokenizer_svc", "scheduler_svc", "gpu_worker_svc", "tracing", "batch_svc")

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.MULTILINE)


def _prose(page: Path) -> str:
    """The page without its fenced code blocks, where brackets are code, not links."""
    return _FENCE.sub("", page.read_text())


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in _HEADING.findall(_prose(page))}


def _relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def _readme_commands() -> list[str]:
    section = _section(README.read_text(), "## Two commands")
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block, "the Two commands section has no bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.MULTILINE)}


def test_the_readme_gives_a_new_user_exactly_two_make_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    targets = _makefile_targets()
    for command in commands:
        words = command.split()
        assert words[0] == "make" and len(words) == 2, command
        assert words[1] in targets, f"{command}: no such target in the Makefile"


def test_ci_runs_the_readmes_test_command():
    test_command = _readme_commands()[1]
    ci_lines = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert test_command in ci_lines


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) < 200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_that_exists(page):
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _relative_links(README) if t.partition("#")[0]}
    assert [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked] == []


def _settings_variables() -> set[str]:
    """SHARDLINE_<FIELD> for every field of every service's pydantic-settings class."""
    names = set()
    files = [f for package in PACKAGES for f in (ROOT / package).rglob("settings.py")]
    assert files
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "BaseSettings" for b in node.bases):
                assert 'env_prefix="SHARDLINE_"' in ast.unparse(node).replace("'", '"'), file
                names |= {
                    f"SHARDLINE_{s.target.id.upper()}"
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id != "model_config"
                }
    return names


def _env_example_variables() -> set[str]:
    lines = (ROOT / ".env.example").read_text().splitlines()
    return {m.group(2) for line in lines if (m := re.fullmatch(r"(#\s*)?([A-Z][A-Z0-9_]*)=(.*)", line.strip()))}


def test_deploy_documents_every_setting_and_every_env_example_variable():
    text = (DOCS / "deploy.md").read_text()
    missing = sorted(v for v in _settings_variables() | _env_example_variables() if f"`{v}`" not in text)
    assert not missing


def test_the_compose_section_documents_what_env_example_offers():
    # What a compose user reads: every .env.example variable, and no table row offering one it lacks.
    section = (DOCS / "deploy.md").read_text()
    section = section[section.index("## Deploy with docker compose") :]
    offered = _env_example_variables()
    assert sorted(v for v in offered if f"`{v}`" not in section) == []
    tabled = {
        name
        for row in section.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", row.split("|")[1])
    }
    assert tabled - offered == set()


def test_the_docs_name_no_setting_that_does_not_exist():
    known = _settings_variables() | _env_example_variables()
    named = {v for page in PAGES for v in re.findall(r"\bSHARDLINE_[A-Z0-9_]*[A-Z0-9]\b", page.read_text())}
    assert sorted(named - known) == []


# Folders the commands write into, which a fresh checkout does not have yet.
_OUTPUTS = ("results/",)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_SOURCE_PATH = re.compile(r"\.(py|proto|cpp|ya?ml|json|sh|md|toml)$")


def _named_paths(page: Path) -> list[str]:
    """Repository paths a page names in code spans (`gateway/params.py: validate_sampling` names the
    file): those with a folder and a source suffix, or ending in a slash."""
    paths = []
    for span in _CODE_SPAN.findall(page.read_text()):
        path = span.split(":")[0].strip()
        if "/" not in path or any(c in path for c in "<*{ ") or path.startswith(("~", ".", "/", *_OUTPUTS)):
            continue
        if _SOURCE_PATH.search(path) or path.endswith("/"):
            paths.append(path)
    return paths


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_page_names_exists(page):
    assert [path for path in _named_paths(page) if not (ROOT / path).exists()] == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_benchmark_a_page_runs_exists(page):
    modules = set(re.findall(r"\bbenchmarks\.(\w+)", page.read_text())) - {"md"}  # not benchmarks.md
    assert sorted(m for m in modules if not (ROOT / "benchmarks" / f"{m}.py").exists()) == []
