"""Sphinx configuration for the gpipe documentation.

The packages are imported from the active environment (the ``docs`` nox session installs
them). For a quick manual build without installing, the working tree's ``packages/*/src``
directories are appended to ``sys.path`` as a fallback.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for src in sorted(ROOT.glob("packages/*/src")):
    if str(src) not in sys.path:
        sys.path.append(str(src))


def _release() -> str:
    try:
        return dist_version("gpipe")
    except PackageNotFoundError:
        about = (ROOT / "packages/gpipe/src/gpipe/__about__.py").read_text(encoding="utf-8")
        match = re.search(r"__version__\s*=\s*[\"']([^\"']+)", about)
        return match.group(1) if match else "unknown"


project = "gpipe"
author = "The gpipe developers"
copyright = "the gpipe developers"
release = _release()
version = ".".join(release.split(".")[:2])

# _ext/timeline_plot.py draws the plot of timeline.rst from a CPU run at build time.
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.doctest",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
    "timeline_plot",
    "cli_options",
]

source_suffix = {".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]
templates_path: list[str] = []

# -- doctest (sphinx-build -b doctest, run by nox -s docs) ----------------------------------

# The pages' examples are testcode and doctest blocks; the docstrings' examples are run by
# pytest --doctest-modules in the tests session, so plain >>> blocks are not run twice here.
doctest_test_doctest_blocks = ""

# -- autodoc / napoleon -------------------------------------------------------------------

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# autograd.Function subclasses would otherwise show torch's forward/backward docstrings,
# whose references only resolve inside torch's own documentation.
autodoc_inherit_docstrings = False
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# -- nitpicky references ----------------------------------------------------------------------
#
# The network is closed, so there is no intersphinx: references into torch, the standard
# library and builtins cannot resolve and are ignored here. References to gpipe's own objects
# must all resolve.

nitpick_ignore_regex = [
    # The type variable of FixedDevices' moves, which return the module they are called on.
    (r"py:class", r"gpipe_core\._moves\._Moved"),
    (r"py:.*", r"torch(\..*)?"),
    # torch.distributed as the modules import it (``dist.ProcessGroup``), where autodoc keeps
    # the annotation's text (a signature whose hints cannot all be evaluated at run time).
    (r"py:.*", r"dist\..*"),
    (r"py:.*", r"(typing|typing_extensions|collections|collections\.abc|contextlib)\..*"),
    (r"py:.*", r"(_thread|types|threading|queue|enum|abc|dataclasses|functools|argparse)\..*"),
    (r"py:.*", r"(os|pathlib|matplotlib|datetime)(\..*)?"),
    (r"py:.*", r"(Tensor|Module|Sequential|Stream|device|dtype|Generator|DeviceMesh)"),
    (
        r"py:.*",
        r"(None|NoneType|Any|int|float|str|bool|bytes|object|type|tuple|list|dict|set"
        r"|frozenset|slice|range|Ellipsis|Callable|Iterable|Iterator|Generator|Sequence"
        r"|Literal|NoReturn|Optional|Union|Self|TracebackType|BaseException|Exception"
        r"|ValueError|TypeError|RuntimeError|IndexError|KeyError)",
    ),
]

# -- MyST (Markdown changelogs) -------------------------------------------------------------

myst_heading_anchors = 2

# -- HTML ---------------------------------------------------------------------------------------

html_theme = "alabaster"
html_title = f"gpipe {release}"
html_static_path: list[str] = []


# -- private bases --------------------------------------------------------------------------


def _public_base(base: type) -> type:
    """``base``, or the first public class it derives from through gpipe's private modules."""
    while (
        base.__module__.startswith("gpipe")
        and any(part.startswith("_") for part in base.__module__.split(".")[1:])
        # a class its package exports (GPipe, a base of gpipe-transformers' pipeline) is public
        and getattr(sys.modules[base.__module__.split(".")[0]], base.__name__, None) is not base
    ):
        base = base.__bases__[0]
    return base


def _public_bases(app: object, name: str, obj: object, options: object, bases: list[type]) -> None:
    """A base class from a private module of gpipe (GPipe's ``_moves.FixedDevices`` and
    ``_collectives.Collectives``, itself a ``_layers.LayersModule``) shows as the first public
    class it derives from, once: its members are documented on the class itself."""
    bases[:] = list(dict.fromkeys(_public_base(base) for base in bases))


def setup(app: object) -> None:
    app.connect("autodoc-process-bases", _public_bases)  # type: ignore[attr-defined]
