"""The code on every page (README.md and the documentation site's ``docs/**/*.md``) runs as
pasted, or names only what exists; every link between the pages leads somewhere; and the
README's promises about a machine without a GPU hold (quiet output, the planner without
environment variables).

* A ``python`` block runs in a subprocess (8 virtual CPU devices, ``JAX_PLATFORMS=cpu``, a fresh
  working directory) and must exit 0 with nothing on stderr but the planner's progress lines.
  A block whose first line is ``# continues the quick start`` runs after the quick start in the
  same program (one subprocess: the quick start, then each such block, README.md's first, then
  the pages' in path order). A block
  whose first line is ``# excerpt of PATH`` does not run: each of its code lines must be one of
  PATH's (comments and whitespace aside; a ``...`` line marks what is left out).
* A ``bash`` block is checked, not run (its commands train or compile for minutes): each file it
  names exists, each ``--flag`` is one its command accepts, each ``FILE.py:NAME`` names a function
  in that file, each pip extra is in pyproject.toml. A command this test does not know fails it.
* Every ``examples/*.py`` is on the examples page, with its command.
* A relative link leads to a file that exists and, with ``#anchor``, to a heading of that page;
  the README's table sends each common need to its page.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap
import tokenize
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: README.md first (it holds the quick start), then the site's pages in path order.
PAGES = [README] + sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)
README_MAX_LINES = 200  # a few screens: the rest lives on the site's pages
CONTINUES = "# continues the quick start"
EXCERPT = re.compile(r"#\s*excerpt of (\S+)\s*$")
NOISE = re.compile(r"Traceback|warning|cuda|absl", re.IGNORECASE)
TIMEOUT_S = 600  # a generous bound for a loaded 2-core machine; the blocks take seconds each


# -- reading the pages -------------------------------------------------------------------------


def code_blocks(text: str, name: str = "README.md") -> list[tuple[int, str, str]]:
    """``(line, language, code)`` of every fenced block (its opening fence's 1-based line; the
    code dedented by the fence's indentation, as in a list item). A MyST directive
    (```` ```{include} ../README.md ````) is a block whose language is ``{include}``."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.fullmatch(r"( *)```(\{[\w-]+\}|\w*)(?:\s.*)?", lines[i])
        if not m:
            i += 1
            continue
        indent, language, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and not re.fullmatch(rf"{indent}```\s*", lines[i]):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{name}:{start + 1}: the code block is never closed"
        blocks.append((start + 1, language, textwrap.dedent("\n".join(body)) + "\n"))
        i += 1
    return blocks


def section(text: str, heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def first_line(code: str) -> str:
    return next((line.strip() for line in code.splitlines() if line.strip()), "")


def _where(page: pathlib.Path, line: int) -> str:
    return f"{page.relative_to(ROOT)}:{line}"


TEXT = README.read_text()
#: ``(where, language, code)`` of every block of every page, ``where`` as ``docs/howto/zero3.md:12``.
BLOCKS = [(_where(page, line), language, code) for page in PAGES
          for line, language, code in code_blocks(page.read_text(), str(page.relative_to(ROOT)))]
PYTHON = [(where, code) for where, language, code in BLOCKS if language == "python"]
BASH = [(where, code) for where, language, code in BLOCKS if language == "bash"]
_HEADING = TEXT[: TEXT.index("\n## Quick start\n")].count("\n") + 2  # the heading's line
QUICK_START = _where(README, min(line for line, language, _ in code_blocks(TEXT)
                                 if language == "python" and line > _HEADING))


def runnable_units() -> list:
    """One pytest param per program: the quick start with the blocks continuing it, then every
    other block that is neither an excerpt nor a continuation."""
    quick = [(where, code) for where, code in PYTHON if where == QUICK_START]
    assert quick, "the Quick start section must hold a python block"
    chain = quick + [(where, code) for where, code in PYTHON if first_line(code).startswith(CONTINUES)]
    units = [("quick_start", chain)]
    for where, code in PYTHON:
        if where == QUICK_START or first_line(code).startswith(CONTINUES) or EXCERPT.fullmatch(first_line(code)):
            continue
        units.append((where, [(where, code)]))
    params = []
    for name, blocks in units:
        needs_plugin = any("jd.plan." in code or "jax_drain.plan" in code for _, code in blocks)
        params.append(pytest.param(blocks, id=name, marks=[pytest.mark.gpu_compile] if needs_plugin else []))
    return params


# -- python blocks -----------------------------------------------------------------------------


def _program(blocks: list[tuple[str, str]]) -> str:
    parts = []
    for where, code in blocks:
        parts.append(f"print('### {where}', flush=True)\n{code}")
    return "\n".join(parts)


@pytest.mark.parametrize("blocks", runnable_units())
def test_python_blocks_run_as_pasted(blocks, tmp_path):
    (tmp_path / "readme_block.py").write_text(_program(blocks))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "readme_block.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    started = re.findall(r"^### (\S+:\d+)$", done.stdout, re.M)
    where = started[-1] if started else blocks[0][0]
    assert done.returncode == 0, f"the block at {where} failed:\n{done.stderr[-4000:]}"
    noise = [line for line in done.stderr.splitlines() if NOISE.search(line)]
    assert not noise, f"the blocks from {where} wrote to stderr:\n" + "\n".join(noise[:20])
    assert len(started) == len(blocks)
    if blocks[0][0] == QUICK_START:
        # What the quick start says it does: the loss falls, the checkpoints are where it says
        # (the continuing blocks restore the last one onto another mesh).
        losses = [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", done.stdout, re.M)]
        assert len(losses) == 4 and losses[-1] < 0.25 * losses[0], losses
        steps = sorted(int(p.name) for p in (tmp_path / "runs/quickstart/checkpoints").iterdir() if p.name.isdigit())
        assert steps == [100, 200]


def _code_lines(code: str) -> list[str]:
    """The code of each line, comments dropped and whitespace collapsed; blank lines left out."""
    cut: dict[int, int] = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            cut[tok.start[0]] = tok.start[1]
    lines = []
    for number, line in enumerate(code.splitlines(), start=1):
        line = " ".join(line[: cut.get(number, len(line))].split())
        if line:
            lines.append(line)
    return lines


@pytest.mark.parametrize("where,code", [(w, code) for w, code in PYTHON if EXCERPT.fullmatch(first_line(code))],
                         ids=lambda v: v if ":" in v else "")
def test_excerpts_are_the_named_files_code(where, code):
    path = ROOT / EXCERPT.fullmatch(first_line(code)).group(1)
    assert path.is_file(), f"{where}: the excerpt names {path.relative_to(ROOT)}, which does not exist"
    source = set(_code_lines(path.read_text()))
    missing = [c for c in _code_lines(code) if c != "..." and c not in source]
    assert not missing, f"{where}: not in {path.relative_to(ROOT)}: {missing}"


def test_every_python_block_runs_or_is_marked():
    """A block is the quick start, continues it, is an excerpt, or runs on its own: the last
    kind must not use names it does not define (the README once shared `P`, `params`, ...)."""
    for where, code in PYTHON:
        head = first_line(code)
        if where == QUICK_START or head.startswith(CONTINUES) or EXCERPT.fullmatch(head):
            continue
        assert re.search(r"^import |^from ", code, re.M), f"{where}: a block that runs alone imports"
        compile(code, where, "exec")


# -- bash blocks -------------------------------------------------------------------------------


def _commands(code: str) -> list[tuple[str, list[str]]]:
    """``(text, tokens)`` of each command: continuation lines joined, comments dropped, split at
    ``&&`` and ``;``, leading ``NAME=value`` assignments removed."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        command: list[str] = []
        for tok in tokens + ["&&"]:
            if tok in ("&&", ";"):
                while command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", command[0]):
                    command.pop(0)
                if command:
                    out.append((line.strip(), command))
                command = []
            else:
                command.append(tok)
    return out


@functools.cache
def _help(script: str) -> str:
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script} --help failed: {done.stderr[-2000:]}"
    return done.stdout


def _planner_flags() -> set[str]:
    from jax_drain.planner import cli

    return set(cli._parser()._option_string_actions)


def _check_arguments(text: str, args: list[str], accepts) -> None:
    for arg in args:
        if arg.startswith("-") and arg != "-":
            flag = arg.split("=", 1)[0]
            assert accepts(flag), f"`{text}`: {flag} is not an option of this command"
        elif re.fullmatch(r"[\w./-]+\.py:\w+", arg):
            path, name = arg.split(":")
            assert (ROOT / path).is_file(), f"`{text}`: no file {path}"
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"`{text}`: {path} has no {name}()"
        elif re.fullmatch(r"(examples|benchmarks|jax_drain|tests|docs)/[\w./-]+", arg):
            assert (ROOT / arg).exists(), f"`{text}`: no {arg}"


def _check(text: str, tokens: list[str]) -> None:
    program, args = tokens[0], tokens[1:]
    if program in (".", "source"):
        assert args and args[0].endswith("bin/activate"), f"`{text}`: sources what?"
    elif program == "pip":
        assert args[:1] == ["install"], f"`{text}`: only pip install is known here"
        extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
        for arg in args[1:]:
            if m := re.fullmatch(r"\.\[([\w,-]+)\]", arg):
                unknown = set(m.group(1).split(",")) - extras
                assert not unknown, f"`{text}`: pyproject.toml has no extra {sorted(unknown)}"
    elif program in ("python", "python3") and args[:2] == ["-m", "venv"]:
        pass
    elif program == "python" and args[:2] == ["-m", "jax_drain.plan"]:
        flags = _planner_flags()
        _check_arguments(text, args[2:], lambda f: f in flags)
    elif program == "python" and args[:2] == ["-m", "pytest"]:
        _check_arguments(text, [a for a in args[2:] if a.startswith("tests/")], lambda f: True)
    elif program == "python" and args and args[0].endswith(".py"):
        assert (ROOT / args[0]).is_file(), f"`{text}`: no file {args[0]}"
        helptext = _help(args[0])
        _check_arguments(text, args[1:], lambda f: re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", helptext))
    elif program == "sphinx-build":
        source = [a for a in args if not a.startswith("-") and a not in ("html",)]
        assert source and (ROOT / source[0] / "conf.py").is_file(), f"`{text}`: no Sphinx project {source[:1]}"
    else:
        pytest.fail(f"`{text}`: tests/test_readme.py does not know how to check {program!r}; teach it")


@pytest.mark.parametrize("where,code", BASH, ids=lambda v: v if ":" in v else "")
def test_bash_blocks_name_what_exists(where, code):
    commands = _commands(code)
    assert commands, f"{where}: an empty bash block"
    for text, tokens in commands:
        _check(text, tokens)


def test_every_example_is_on_the_examples_page_with_its_command():
    page = (DOCS / "examples.md").read_text()
    commands = "\n".join(code for _, language, code in code_blocks(page, "docs/examples.md") if language == "bash")
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert f"`examples/{path.name}`" in page, f"examples/{path.name} is not on docs/examples.md"
        assert f"examples/{path.name}" in commands, f"docs/examples.md has no command that runs examples/{path.name}"


# -- links between the pages -------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """The anchor of a Markdown heading, as GitHub and MyST (``myst_heading_anchors``) make it."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # no headings inside code
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_to_a_page_and_heading(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto: ...
        path, _, anchor = target.partition("#")
        goal = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}: ({target})"
        assert goal.exists(), f"{where}: no such file"
        if anchor and goal.suffix == ".md":
            assert anchor in _anchors(goal), f"{where}: {goal.relative_to(ROOT)} has no heading #{anchor}"


def test_the_readme_is_short_and_sends_each_need_to_its_page():
    """A newcomer finds, from the README's table alone, the page for each common need."""
    lines = TEXT.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"
    rows = [line for line in section(TEXT, "Where to go").splitlines() if line.startswith("| ") and "](" in line]
    needs = {"ZeRO-3": "docs/howto/zero3.md", "pjit": "docs/howto/tensor_parallel.md",
             "Muon": "docs/howto/whole_parameters.md", "several hosts": "docs/howto/several_hosts.md",
             "before I rent": "docs/howto/plan.md", "checkpoints": "docs/howto/checkpoints.md"}
    for need, target in needs.items():
        row = next((r for r in rows if need in r), None)
        assert row, f"README.md's 'Where to go' table has no row for {need!r}"
        assert f"]({target}" in row, f"README.md's row for {need!r} does not link {target}: {row}"


# -- quiet without a GPU -----------------------------------------------------------------------

NO_GPU = pytest.mark.skipif(any(os.path.exists(d) for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")),
                            reason="checks a machine without an NVIDIA GPU")

QUIET_SCRIPT = """
import jax_drain as jd
import jax, jax.numpy as jnp, numpy as np, optax
params = {"w": np.ones((16, 16), np.float32)}
loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
mesh = jax.make_mesh((jax.device_count(),), ("data",))
batch = {"x": np.ones((8, 16), np.float32)}
step = jd.make_train_step(params, loss, optax.sgd(0.1), mesh, jd.TrainConfig(bucket_size=64), example_batch=batch)
state, metrics = step(step.init(), batch)
jd.save_checkpoint("ckpt", state)
state, extra = jd.restore_checkpoint("ckpt", step.abstract_state())
print("ok", int(state.step))
"""


@NO_GPU
def test_a_run_without_jax_platforms_is_quiet(tmp_path):
    """No JAX_PLATFORMS: jax tries every plugin; with the CUDA plugin installed and no GPU that
    printed absl lines and a 20-line traceback, and orbax warned on every save and restore."""
    (tmp_path / "run.py").write_text(QUIET_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    done = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "ok 1"
    assert done.stderr == ""


@NO_GPU
@pytest.mark.gpu_compile
def test_the_planner_from_python_needs_no_environment_variables(tmp_path):
    """``jd.plan.plan_model`` with no JAX_PLATFORMS, even after jax initialised its backends
    before jax_drain was imported (the plugin is then registered late): the table on print,
    one progress line per strategy on stderr and nothing else there."""
    script = """
import jax, jax.numpy as jnp
jax.devices()  # jax starts before jax_drain: its plugin discovery has run without it
import jax_drain as jd
loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
params = {"w": jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)}
batch = {"x": jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)}
print(jd.plan.plan_model(loss, params, batch, ["no_comm", "fp32_accum+drain"], num_buckets=2))
"""
    (tmp_path / "plan.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
    done = subprocess.run([sys.executable, "plan.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(r"^  fp32_accum\+drain +\d", done.stdout, re.M) and "verdict:" in done.stdout
    # What jax printed itself, before jax_drain was imported, is not jax_drain's to hide (its
    # plugin traceback); from the planner on, stderr holds the progress lines and nothing else.
    assert "planning " in done.stderr, done.stderr[-4000:]
    progress = done.stderr[done.stderr.index("planning "):].splitlines()
    assert progress[0].startswith("planning ") and progress[0].endswith("2 strategies")
    assert [line.split(" ... ")[0] for line in progress[1:]] == ["  [1/2] no_comm", "  [2/2] fp32_accum+drain"]


def test_the_stderr_filter_drops_only_the_cuda_stub_lines(capfd):
    from jax_drain import _quiet

    noise = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
             "I0000 00:00:1796308406.910447    7192 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
             "GPU will not be used.\n")
    with _quiet.filtered_stderr():
        # First: pytest's capture may take Python's line past the descriptor, straight into its
        # file, where the filter's own writes (from its thread) could otherwise land mid-line.
        print("a real Python warning", file=sys.stderr, flush=True)
        os.write(2, noise.encode())
        os.write(2, b"E0000 a real error from C++\n")
        os.write(2, b"no newline at the end")
    assert sorted(capfd.readouterr().err.splitlines()) == [
        "E0000 a real error from C++", "a real Python warning", "no newline at the end"]


def test_orbax_notes_about_other_directories_still_show(tmp_path, caplog):
    """The checkpoint filter moves orbax's notes about jax_drain's own directories to DEBUG;
    the same note about anyone else's directory, and any other orbax warning, still shows."""
    import jax_drain.checkpoint as ckpt

    ckpt._orbax(tmp_path / "ours")
    absl = logging.getLogger("absl")
    with caplog.at_level(logging.DEBUG):
        absl.warning("Given directory is read only=%s", tmp_path / "ours")
        absl.warning("Given directory is read only=%s", tmp_path / "theirs")
        absl.warning("something else went wrong in %s", tmp_path / "ours")
    shown = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert ("jax_drain.checkpoint", "DEBUG", f"orbax: Given directory is read only={tmp_path / 'ours'}") in shown
    assert ("absl", "WARNING", f"Given directory is read only={tmp_path / 'theirs'}") in shown
    assert ("absl", "WARNING", f"something else went wrong in {tmp_path / 'ours'}") in shown
    assert not any(n == "absl" and m.endswith("ours") and "read only" in m for n, _, m in shown)


# -- the planner's output ----------------------------------------------------------------------


@pytest.mark.gpu_compile
def test_the_planner_cli_shows_progress_and_what_it_wrote(tmp_path, capsys):
    from jax_drain.planner import cli

    png, out = tmp_path / "plan.png", tmp_path / "plan.json"
    assert cli.main(["--preset", "tiny", "--strategy", "no_comm,fp32_accum+drain", "--num-buckets", "2",
                     "--json", str(out), "--plot", str(png)]) == 0
    stdout, stderr = capsys.readouterr()
    lines = stderr.splitlines()
    assert lines[0].startswith("planning preset tiny") and lines[0].endswith("2 strategies")
    assert re.fullmatch(r"  \[1/2\] no_comm \.\.\. [\d.,]+ MiB temp, compiled in [\d.]+ s", lines[1])
    assert re.fullmatch(r"  \[2/2\] fp32_accum\+drain \.\.\. [\d.,]+ MiB temp, compiled in [\d.]+ s", lines[2])
    assert len(lines) == 3
    assert stdout.rstrip().splitlines()[-2:] == [f"wrote {out}", f"wrote {png}"]
    assert png.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 0
    assert cli.main(["--preset", "tiny", "--strategy", "no_comm", "--num-buckets", "2", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
