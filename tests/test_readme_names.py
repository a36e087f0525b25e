"""Every dotted name the README and its guide pages in docs/ (``test_readme.DOC_FILES``) spell
(``sparsync.RankSetup``, ``sparsync.compress.hooks.compression_hook``, ...) resolves as a user would write it
after importing its module: attribute by attribute from the top package, so a name shadowed by a function of the
same name (``sparsync.launch`` is the function) is caught."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from test_readme import DOC_FILES

ROOT = Path(__file__).resolve().parents[1]
TEXT = "\n".join((ROOT / path).read_text() for path in DOC_FILES)
NAMES = sorted(set(re.findall(r"(?<![\w./-])(sparsync(?:_bench)?(?:\.[A-Za-z_]\w*)+)", TEXT)))


def resolve(dotted: str) -> object:
    """``import <the longest module prefix>``, then ``dotted`` evaluated from the top package."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    obj: object = importlib.import_module(parts[0])
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj


def test_the_readme_names_library_objects() -> None:
    assert "sparsync.RankSetup" in NAMES and len(NAMES) >= 20, NAMES


@pytest.mark.parametrize("dotted", NAMES)
def test_readme_name_resolves(dotted: str) -> None:
    resolve(dotted)
