"""Sphinx configuration for the gpupool documentation (Sphinx + MyST, built with ``-n -W``)."""

from __future__ import annotations

import gpupool

project = "gpupool"
author = "gpupool developers"
copyright = "gpupool developers"
version = release = gpupool.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
# No intersphinx: the docs build offline (CI machines without internet), so
# nothing can be resolved against docs.python.org; the standard library is
# named in plain code spans instead of cross-referenced.

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_typehints_description_target = "documented"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

nitpicky = True
#: Targets outside this project that cannot resolve offline (no intersphinx).
#: Add a genuinely external target here (e.g. ``("py:class",
#: "concurrent.futures.process.BrokenProcessPool")``) only when a page needs
#: it; a gpupool name that does not resolve is a bug in the docs, not an entry.
nitpick_ignore: list[tuple[str, str]] = [
    ("py:class", "collections.abc.Callable"),
    ("py:class", "collections.abc.Iterable"),
    ("py:class", "collections.abc.Iterator"),
    ("py:class", "collections.abc.Mapping"),
    ("py:class", "collections.abc.Sequence"),
    ("py:class", "os.PathLike"),
    ("py:class", "concurrent.futures.Future"),
    ("py:class", "concurrent.futures._base.Future"),
    ("py:exc", "BrokenProcessPool"),
    ("py:class", "concurrent.futures.process.BrokenProcessPool"),
    # A type variable is not a documentable target (gpupool.track's result type).
    ("py:class", "T"),
]

html_theme = "furo"
html_title = f"gpupool {release}"
html_static_path = ["_static"]
html_css_files = ["wide.css"]
