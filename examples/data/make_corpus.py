"""Regenerates ``python_docstrings.txt``: docstrings of Python's standard library, as plain ASCII.

The committed corpus was written by this script with CPython 3.11.7; other Python versions give a
slightly different text. The docstrings are part of CPython's source code, (c) Python Software
Foundation, distributed under the PSF License Agreement (``LICENSE-Python.txt``, copied from the
same CPython installation). See README.md.

    python examples/data/make_corpus.py            # rewrites examples/data/python_docstrings.txt
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import sys
import unicodedata
import warnings

# Pure-Python modules with plenty of prose; order fixed so the output is reproducible.
MODULES = (
    "abc argparse ast asyncio.events asyncio.futures asyncio.locks asyncio.queues asyncio.tasks "
    "base64 bisect calendar cmd codecs collections configparser contextlib copy csv dataclasses "
    "datetime decimal difflib email.message email.utils enum fnmatch fractions ftplib functools "
    "getopt gettext glob gzip heapq hmac html.parser http.client http.cookies http.server imaplib "
    "inspect ipaddress json locale logging logging.handlers mailbox mimetypes numbers operator "
    "optparse os pathlib pickle pprint queue random re reprlib sched secrets selectors shelve shlex "
    "shutil smtplib socket socketserver statistics string subprocess tarfile tempfile textwrap "
    "threading timeit tokenize trace traceback typing unittest.case unittest.mock urllib.parse "
    "urllib.request uuid warnings weakref zipfile"
).split()

MAX_CHARS = 400_000
OUT = pathlib.Path(__file__).with_name("python_docstrings.txt")


def ascii_text(text: str) -> str:
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return text.replace("\t", "    ").replace("\r", "")


def documented(module) -> list[tuple[str, str]]:
    """(qualified name, docstring) of the module, its public classes, functions and methods."""
    out = [(module.__name__, module.__doc__ or "")]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            out.append((f"{module.__name__}.{name}", obj.__doc__ or ""))
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if not attr.startswith("_") and inspect.isfunction(member):
                    out.append((f"{module.__name__}.{name}.{attr}", member.__doc__ or ""))
    return out


def main() -> None:
    seen: set[str] = set()
    parts: list[str] = []
    for module_name in MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            entries = documented(importlib.import_module(module_name))
        for name, doc in entries:
            doc = ascii_text(inspect.cleandoc(doc)).strip()
            if len(doc) >= 80 and doc not in seen:  # skip one-liners and inherited copies
                seen.add(doc)
                parts.append(f"{name}\n{doc}\n\n")
    text, size = [], 0
    for part in parts:  # whole entries only, up to MAX_CHARS
        if size + len(part) > MAX_CHARS:
            break
        text.append(part)
        size += len(part)
    OUT.write_text("".join(text), encoding="ascii")
    print(f"wrote {OUT}: {size} characters from {len(text)} of {len(parts)} docstrings "
          f"(Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
