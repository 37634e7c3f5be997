"""Sphinx configuration: the README and BUILD.md as pages, the API reference from the docstrings.

Build (CI runs it; warnings, broken references included, are errors)::

    pip install -e '.[docs]'
    sphinx-build -W -n -b html docs docs/_build/html

Public names are documented where users reach them: ``jax_drain.X`` (docs/api/*.rst, one page
per topic) and ``jax_drain.plan.X`` (docs/api/planner.rst). The module pages
(docs/api/modules.rst) show each module's docstring and its public names that neither namespace
re-exports. A docstring may refer to an object by any of its names (``GradSync`` inside
``jax_drain.sync``, ``jax_drain.sync.GradSync``, ``jax_drain.GradSync``): :func:`_resolve` finds
the page that documents it. A reference to nothing documented fails the build.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pathlib
import re
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The docs import jax_drain (and jax) but never run a computation: one CPU device is enough.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax_drain  # noqa: E402
import jax_drain.plan  # noqa: E402

project = "jax_drain"
author = "jax_drain authors"
release = version = jax_drain.__version__
copyright = "jax_drain authors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_theme_options = {"description": "drained, fp32-accumulated gradient reduce-scatter for JAX", "fixed_sidebar": True}
html_static_path: list[str] = []

myst_heading_anchors = 3  # README.md's in-page links (#wire-precision-...) resolve on the guide page
suppress_warnings = ["myst.header"]  # README.md starts at level 2 under the guide's own title

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = False

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the Args: sections say what each argument is; hints name other libraries' types
# Module pages show every public name with a docstring, not only those in a module's __all__.
autodoc_default_options = {"members": True, "show-inheritance": True, "ignore-module-all": True}
autodoc_mock_imports: list[str] = []

nitpicky = True
# Types of other libraries (jax, optax, flax, numpy, orbax) have no pages here (no network for
# intersphinx); jax_drain's own names must all resolve.
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|optax|flax|nnx|linen|numpy|np|jnp|orbax|ocp|matplotlib|typing|collections|abc|"
               r"dataclasses|enum|pathlib|os|concurrent)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Sequence|Mapping|Iterable|Iterator|NamedTuple|Enum|PyTree|AxisSpec|ExpertSpec|Mask|"
               r"object|int|float|str|bool|bytes|tuple|list|dict|set|frozenset|None|type|Exception|ValueError|"
               r"RuntimeError|KeyError|TypeError|FileExistsError|FileNotFoundError|OSError)"),
]

#: The namespaces users import public names from, in the order a name's home is chosen.
NAMESPACES = ("jax_drain", "jax_drain.plan")


def _exported(obj: Any, name: str | None = None) -> str | None:
    """The namespace that exports ``obj`` under its own name (its documented home), if any."""
    name = name or getattr(obj, "__name__", None)
    for namespace in NAMESPACES:
        module = sys.modules[namespace]
        if name in getattr(module, "__all__", ()) and getattr(module, name, None) is obj:
            return namespace
    return None


def _plural_literals(app, what, name, obj, options, lines):
    """``jax.Array``s (a plural of an inline literal, common in these docstrings) is not valid
    reST: the literal must end before a letter. Written as ``jax.Array``\\ s, it renders the same."""
    for i, line in enumerate(lines):
        lines[i] = re.sub(r"(?<![`\w])``(\S(?:[^`]*\S)?)``(?=[A-Za-z])", r"``\1``\\ ", line)


def _no_inline_attribute_types():
    """napoleon reads an attribute's or property's first line ``X: Y`` as type ``X``; these
    docstrings never give types there ("The bucket chains, in dispatch order: ..."), so keep
    the line as written."""
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    def parse(self):
        return self._consume_to_end()

    GoogleDocstring._parse_attribute_docstring = parse


def _skip_member(app, what, name, obj, skip, options):
    """On the module pages, leave out what a namespace page documents; everywhere, namedtuple
    field stubs ("Alias for field number 0")."""
    doc = getattr(obj, "__doc__", None) or ""
    if doc.startswith("Alias for field number"):
        return True
    if what == "module" and _exported(obj, name) is not None:
        return True
    return None


def _lookup(path: str) -> Any:
    """The object a dotted path names (a module, then attributes), or raises LookupError."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(obj, part):
                raise LookupError(path)
            obj = getattr(obj, part)
        return obj
    raise LookupError(path)


def _homes(path: str) -> list[str]:
    """The names under which the object ``path`` names may be documented: its namespace's, then
    its module's (a method or attribute: under each name of its class)."""
    try:
        obj = _lookup(path)
    except LookupError:
        return []
    if inspect.ismodule(obj):
        return [obj.__name__]
    head, _, attr = path.rpartition(".")
    try:
        owner = _lookup(head) if head else None
    except LookupError:
        owner = None
    if inspect.isclass(owner):  # a method or attribute: under its class, or the base defining it
        definers = [owner] + [c for c in owner.__mro__[1:] if attr in vars(c)][:1]
        return [f"{home}.{attr}" for c in definers for home in _homes(f"{c.__module__}.{c.__qualname__}")]
    homes = []
    if (namespace := _exported(obj, attr)) is not None:
        homes.append(f"{namespace}.{attr}")
    module = getattr(obj, "__module__", None)
    if module and inspect.ismodule(owner) and (inspect.isclass(obj) or inspect.isroutine(obj)):
        homes.append(f"{module}.{getattr(obj, '__qualname__', attr)}")
    homes.append(path)
    return homes


def _resolve(app, env, node, contnode):
    """A Python reference Sphinx could not resolve: the same object under its documented name."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    module, cls = node.get("py:module"), node.get("py:class")
    candidates = [target]
    if module and cls:
        candidates.append(f"{module}.{cls}.{target}")
    if module:
        candidates.append(f"{module}.{target}")
    domain = env.get_domain("py")
    homes = [home for candidate in candidates for home in _homes(candidate)]
    if not homes:
        # A name used in a docstring documented on a namespace page (so its py:module is the
        # namespace, not the module the name is defined in): the one documented object that
        # name ends, if there is exactly one.
        homes = [name for name in domain.objects if name.startswith("jax_drain.") and name.endswith(f".{target}")]
        homes = homes if len({id(_lookup_or_none(h)) for h in homes}) == 1 else []
    for home in homes:
        if home != node["reftarget"] and (home in domain.objects or home in domain.modules):
            found = domain.resolve_any_xref(env, node["refdoc"], app.builder, home, node, contnode)
            if found:
                return found[0][1]
    return None


def _lookup_or_none(path: str) -> Any:
    try:
        return _lookup(path)
    except LookupError:
        return None


def _fields_directive():
    from docutils import nodes
    from docutils.parsers.rst import Directive
    from docutils.statemachine import StringList

    class Fields(Directive):
        required_arguments = 1
        has_content = False

        def run(self):
            cls = _lookup(self.arguments[0])
            rows = []
            for field in dataclasses.fields(cls):
                if field.default is not dataclasses.MISSING:
                    value = field.default
                    default = f"{value.__module__}.{value.__qualname__}" if inspect.isclass(value) else repr(value)
                elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                    default = f"{field.default_factory.__name__}()"  # type: ignore[misc]
                else:
                    default = "(required)"
                rows.append(f"   * - ``{field.name}``\n     - ``{default}``")
            text = (f".. list-table:: the {len(rows)} fields of ``{self.arguments[0]}`` and their defaults\n"
                    "   :header-rows: 1\n\n   * - field\n     - default\n" + "\n".join(rows))
            container = nodes.container()
            self.state.nested_parse(StringList(text.splitlines()), self.content_offset, container)
            return container.children

    return Fields


def setup(app):
    _no_inline_attribute_types()
    app.connect("autodoc-process-docstring", _plural_literals, priority=400)  # before napoleon (500)
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("missing-reference", _resolve)
    app.add_directive("dataclass-fields", _fields_directive())
    return {"parallel_read_safe": True}
