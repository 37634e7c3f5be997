"""Keeps the CUDA PJRT plugin's start-up noise off stderr on machines without an NVIDIA GPU.

With the ``gpu-compile`` extra (``jax[cuda12-local]``) installed where there is no CUDA, every
run printed two kinds of noise, neither of them an error:

* ``import jax`` loads the plugin's CUDA kernel libraries, whose static initialisers each log
  "Could not find cuda drivers on your machine, GPU will not be used." through absl before absl
  is initialised: straight to file descriptor 2, out of reach of Python's logging and of
  ``TF_CPP_MIN_LOG_LEVEL``.
* jax's plugin discovery (on the first backend use) runs the plugin's CUDA version check, which
  fails without CUDA libraries: a 20-line "Unable to load CUDA" traceback logged by jax, and the
  plugin is left unregistered, so compile-only GPU devices (the planner) could not be created
  unless ``JAX_PLATFORMS=cpu`` had been set before jax started.

:func:`start` (run once by ``import jax_drain``) acts only where no NVIDIA GPU is visible (jax's
own test: ``/dev/nvidia0``, ``/dev/nvidiactl``, ``/dev/dxg``), a CUDA plugin is installed and
``JAX_PLATFORMS`` does not ask for CUDA:

* it imports jax, if nothing has yet, with file descriptor 2 passed through a filter that drops
  exactly those absl lines and writes everything else through as it arrives;
* it runs jax's plugin discovery now, with the version check skipped
  (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``, set for that call only): the check guards running on a
  GPU, and with no GPU visible jax never initialises the CUDA backend (it skips it itself). The
  plugin registers, so compile-only devices work without environment variables.

Where a GPU is visible nothing changes. Any other line on stderr, and any failure of discovery
itself, still shows. When jax initialised its backends before ``import jax_drain``,
:func:`register_cuda_plugin` lets the planner register the plugin late (same conditions).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pkgutil
import re
import sys
import threading
from typing import Callable, Iterator

# What jax checks (jax._src.hardware_utils.has_visible_nvidia_gpu), read before jax is imported.
_NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
_SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"

_NOISE = (
    re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"),
    re.compile(r"[IW]\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, "
               r"GPU will not be used\."),
)


def is_noise(line: str) -> bool:
    """Whether ``line`` (without its newline) is one of the CUDA stub's start-up messages."""
    return any(p.fullmatch(line.rstrip("\r")) for p in _NOISE)


@contextlib.contextmanager
def filtered_stderr(drop: Callable[[str], bool] = is_noise) -> Iterator[None]:
    """File descriptor 2 (C++ and Python writes alike) passes through ``drop`` while inside:
    the lines it accepts are dropped, every other line is written through as it arrives."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError, ValueError):  # no usable descriptor 2: nothing to filter
        yield
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def write(data: bytes) -> None:
        try:
            os.write(saved, data)
        except OSError:  # the real stderr is gone: keep draining the pipe, or writers would block
            pass

    def pump() -> None:
        pending = b""
        while chunk := os.read(read_end, 65536):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if not drop(line.decode("utf-8", "replace")):
                    write(line + b"\n")
        if pending and not drop(pending.decode("utf-8", "replace")):
            write(pending)
        os.close(read_end)

    thread = threading.Thread(target=pump, name="jax_drain-stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end closes: the pump reads to the end
        thread.join()
        os.close(saved)


def gpu_visible() -> bool:
    """An NVIDIA GPU is visible to this process, by jax's own test."""
    return any(os.path.exists(d) for d in _NVIDIA_DEVICES)


def cuda_plugins() -> list[str]:
    """The installed CUDA PJRT plugin modules (``jax_plugins.xla_cuda12``, ...)."""
    try:
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(f"jax_plugins.{m.name}" for m in pkgutil.iter_modules(spec.submodule_search_locations)
                  if m.name.startswith("xla_cuda"))


def _cuda_requested() -> bool:
    if "jax" in sys.modules:
        platforms = sys.modules["jax"].config.jax_platforms or ""
    else:
        platforms = os.environ.get("JAX_PLATFORMS", "")
    return any(p.strip().lower() in ("cuda", "gpu") for p in platforms.split(","))


def applies() -> bool:
    """No NVIDIA GPU is visible, a CUDA plugin is installed and CUDA was not asked for."""
    return not gpu_visible() and bool(cuda_plugins()) and not _cuda_requested()


@contextlib.contextmanager
def _cuda_check_skipped() -> Iterator[None]:
    old = os.environ.get(_SKIP_CHECK)
    os.environ[_SKIP_CHECK] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_SKIP_CHECK, None)
        else:
            os.environ[_SKIP_CHECK] = old


def start() -> None:
    """At ``import jax_drain``: import jax and discover its plugins quietly (see the module)."""
    if not applies():
        return
    if "jax" not in sys.modules:
        with filtered_stderr():
            import jax  # noqa: F401
    try:
        from jax._src import xla_bridge
    except ImportError:
        return
    discover = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    if discover is None or getattr(xla_bridge, "_plugins_registered", True):
        return  # another jax, or discovery already ran
    with _cuda_check_skipped(), filtered_stderr():
        discover()


def register_cuda_plugin() -> bool:
    """Registers an installed CUDA plugin that jax's discovery left unregistered (its version
    check failed because jax started before ``import jax_drain``); only where :func:`applies`.
    Returns whether it tried."""
    if not applies():
        return False
    for name in cuda_plugins():
        with _cuda_check_skipped(), filtered_stderr():
            importlib.import_module(name).initialize()
        return True
    return False
