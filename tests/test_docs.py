"""The documentation site covers the public API: every name users import has a page, every
module is on the module page, every ``TrainConfig`` field is explained in its docstring.

The build itself (``sphinx-build -W -n``: warnings and broken references fail it) runs in
``.ci/run``; these checks are what a new public name or field would otherwise slip past.
"""

from __future__ import annotations

import dataclasses
import pathlib
import pkgutil
import re

import jax_drain
import jax_drain.plan

API = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api"


def _documented(*pages: str) -> set[str]:
    """Names given to ``auto*::`` or ``py:*::`` directives on the pages (the last dotted part)."""
    text = "\n".join((API / page).read_text() for page in pages)
    return {m.rpartition(".")[2] for m in re.findall(r"^\.\. (?:auto\w+|py:\w+):: ([\w.]+)", text, re.M)}


def test_every_public_name_has_a_page():
    topic_pages = ("training.rst", "optimizer.rst", "sync.rst", "checkpoint.rst")
    missing = sorted(set(jax_drain.__all__) - _documented(*topic_pages))
    assert not missing, f"jax_drain names on no page of docs/api ({', '.join(topic_pages)}): {missing}"
    missing = sorted(set(jax_drain.plan.__all__) - _documented("planner.rst"))
    assert not missing, f"jax_drain.plan names missing from docs/api/planner.rst: {missing}"


def test_every_module_is_on_the_module_page():
    text = (API / "modules.rst").read_text() + (API / "planner.rst").read_text() + (API / "index.rst").read_text()
    on_page = set(re.findall(r"^\.\. automodule:: ([\w.]+)", text, re.M))
    modules = {m.name for m in pkgutil.walk_packages(jax_drain.__path__, "jax_drain.")
               if not any(part.startswith("_") for part in m.name.split("."))}
    missing = sorted(modules - on_page)
    assert not missing, f"modules missing from docs/api/modules.rst: {missing}"


def test_every_train_config_field_is_explained():
    """The docs list TrainConfig's fields from the dataclass itself (docs/conf.py); what each
    one means comes from the docstring's Attributes section, which must name every field."""
    doc = jax_drain.TrainConfig.__doc__
    attributes = doc.split("Attributes:", 1)[1]
    missing = [f.name for f in dataclasses.fields(jax_drain.TrainConfig)
               if not re.search(rf"(?<![\w`]){f.name}(?![\w])", attributes)]
    assert not missing, f"TrainConfig fields its docstring does not explain: {missing}"
