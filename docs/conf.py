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
    "sphinx.ext.intersphinx",
    "sphinx.ext.napoleon",
]
# The standard library's names link to docs.python.org, resolved against a
# copy of its inventory kept here (the objects.inv of the Python 3.11
# documentation, Debian's python3.11-doc): the build never reaches the
# network, so it runs offline, as CI's machines do. To refresh it, copy a
# newer objects.inv over _intersphinx/python.inv.
intersphinx_mapping = {"python": ("https://docs.python.org/3", "_intersphinx/python.inv")}

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
#: Targets that resolve neither here nor in the Python inventory. Add one only
#: when a page needs it; a gpupool name that does not resolve is a bug in the
#: docs, not an entry.
nitpick_ignore: list[tuple[str, str]] = [
    # A type variable is not a documentable target (gpupool.track's result type).
    ("py:class", "T"),
]

html_theme = "furo"
html_title = f"gpupool {release}"
html_static_path = ["_static"]
html_css_files = ["wide.css"]
