"""What the README and the docs say about dependencies is what pyproject.toml declares.

Checked: every ``pip install`` line's extras exist, and a comment that names
distributions names the ones that install brings, all of what it adds (the
extras', or the base's without extras), and no other; every "depends on
``X``" names a dependency and every "``X`` is not a dependency" does not.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover  # Python 3.10: pip's own copy of the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

_INSTALL = re.compile(r"pip install (?:-e )?(?P<target>['\"]?(?:\.|gpupool)(?:\[[\w,]+\])?['\"]?)")


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


BASE = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
EXTRAS = {
    extra: {_name(r) for r in requirements}
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items()
}
#: Every distribution a page could name as installed: the package's, its extras', the tools'.
KNOWN = (
    BASE
    | set().union(*EXTRAS.values())
    | {
        _name(r)
        for group in PYPROJECT["dependency-groups"].values()
        for r in group
        if isinstance(r, str)
    }
)


def _install_lines() -> list[Any]:
    """Every ``pip install`` of the package in the pages: (page, line, extras, comment)."""
    found = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            match = _INSTALL.search(line)
            if match is None:
                continue
            extras = re.search(r"\[([\w,]+)\]", match.group("target"))
            comment = line.partition("#")[2] if "#" in line[match.end() :] else ""
            names = set(extras.group(1).split(",")) if extras else set()
            found.append(pytest.param(page.name, line, names, comment, id=f"{page.name}:{number}"))
    return found


def _named(text: str) -> set[str]:
    """The known distributions ``text`` names, as words."""
    words = {w.lower() for w in re.findall(r"[A-Za-z0-9][A-Za-z0-9._-]*", text)}
    return {name for name in KNOWN if name in words}


def test_the_pages_install_the_package_somewhere() -> None:
    lines = [param.values for param in _install_lines()]
    assert any(page == "getting-started.md" and not extras for page, _, extras, _ in lines)
    assert {extra for _, _, extras, _ in lines for extra in extras} == set(EXTRAS)


@pytest.mark.parametrize(("page", "line", "extras", "comment"), _install_lines())
def test_an_install_line_names_what_it_installs(
    page: str, line: str, extras: set[str], comment: str
) -> None:
    assert extras <= set(EXTRAS), f"{page}: {line!r} names an extra pyproject.toml lacks"
    named = _named(comment)
    brought = BASE.union(*(EXTRAS[e] for e in extras))
    assert named <= brought, f"{page}: {line!r} names {sorted(named - brought)}, not installed"
    added = set().union(*(EXTRAS[e] for e in extras)) if extras else BASE
    if named:
        assert added <= named, f"{page}: {line!r} leaves out {sorted(added - named)}"


def _claims(pattern: str) -> list[tuple[str, str]]:
    return [
        (page.name, name)
        for page in PAGES
        for name in re.findall(pattern, " ".join(page.read_text().split()))
    ]


def test_depends_on_names_a_dependency_and_not_a_dependency_does_not() -> None:
    depends = _claims(r"depends on `([\w.-]+)`")
    assert depends, "getting-started says what gpupool depends on"
    for page, name in depends:
        assert _name(name) in BASE, f"{page}: 'depends on `{name}`' is not in dependencies"
    for page, name in _claims(r"`([\w.-]+)` is not a dependency"):
        assert _name(name) not in BASE, f"{page}: '`{name}` is not a dependency' but it is"
    for page, name in _claims(r"([\w.-]+) is not a dependency"):
        assert _name(name) not in BASE, f"{page}: '{name} is not a dependency' but it is"
