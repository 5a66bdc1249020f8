"""Nox sessions for the gpipe monorepo (run ``nox -l`` to list them).

Packages are discovered from ``packages/*/pyproject.toml``; each one's sibling dependency
closure comes from its ``[project].dependencies`` (and, for its tests, its ``test`` extra), so
a new package needs no change here.
torch is only installed from a local wheel in one of pip's find-links directories (such as
/opt/wheels) and is pinned for the rest of each session; it is never resolved from an index.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"
DIST_DIR = ROOT / "dist"
DOCS_DIR = ROOT / "docs"

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
# Every torch this machine holds (torch is never downloaded): 2.13.0+cpu in /opt/wheels, and
# 2.14.1 (a CUDA build, which runs on the CPU) in a local index; both for Python 3.11 only.
TORCH_VERSIONS = ["2.13.0", "2.14.1"]
# The interpreter and torch used by every session other than the test matrix.
DEV_PYTHON = "3.11"
DEV_TORCH = TORCH_VERSIONS[0]

# Tool pins, so that lint and type results do not drift with new releases.
RUFF = "ruff==0.17.5"
MYPY = "mypy>=2.4,<2.5"
SPHINX = ["sphinx>=8", "myst-parser>=4"]
TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6"]
# The plot extra of gpipe (Timeline.plot, the demo's --plot, the plot in the docs).
PLOT = "matplotlib>=3.6"

nox.options.sessions = ["tests", "lint", "typecheck", "docs", "build"]
# Two sessions at a time, each in a process of its own (the default sessions allow it; the
# demo and the benchmarks run alone): the test suite's processes keep about one core busy,
# and this machine has two. The test cells come first, the longest sessions.
nox.options.parallel = 2
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"
# Never fetch interpreters from the network (newer nox downloads missing ones by default).
if hasattr(nox.options, "download_python"):
    nox.options.download_python = "never"


def _expose_pyenv_interpreters() -> None:
    """Put pyenv's interpreters for the test matrix on PATH, one ``pythonX.Y`` link each.

    pyenv's shims refuse versions that are installed but not selected, so nox would report
    those interpreters as missing. Only the ``pythonX.Y`` executables are exposed, so that
    ``python`` and ``python3`` keep meaning what they meant.
    """
    versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if not versions.is_dir():
        return
    links = ROOT / ".nox" / "interpreters"
    for python in PYTHONS:
        candidates = sorted(
            versions.glob(f"{python}.*/bin/python{python}"),
            key=lambda path: Version(path.parent.parent.name),
        )
        if not candidates:
            continue
        links.mkdir(parents=True, exist_ok=True)
        link = links / f"python{python}"
        # Made beside it and moved over it, so that two nox processes started at once
        # (.ci/run starts two) never see it missing or fail to make it.
        made = links / f".python{python}.{os.getpid()}"
        made.unlink(missing_ok=True)
        made.symlink_to(candidates[-1])
        os.replace(made, link)
    if links.is_dir():
        os.environ["PATH"] = os.pathsep.join([str(links), os.environ.get("PATH", "")])


_expose_pyenv_interpreters()
# A Python version that is not installed skips its cells instead of failing the run, also
# under CI=true (where nox would otherwise default to an error); but without DEV_PYTHON
# nothing would be tested, so then every missing interpreter is an error.
nox.options.error_on_missing_interpreters = shutil.which(f"python{DEV_PYTHON}") is None


# --------------------------------------------------------------------------------------------
# Package discovery
# --------------------------------------------------------------------------------------------


def _requirement_name(requirement: str) -> str:
    """The normalized distribution name of a requirement string (PEP 508)."""
    return canonicalize_name(Requirement(requirement).name)


@dataclass(frozen=True)
class Package:
    """One distribution under ``packages/``."""

    name: str
    path: Path
    import_name: str
    version: str
    siblings: tuple[str, ...]
    external: tuple[str, ...]
    #: The requirements of its optional extras (``gpipe[plot]``), siblings aside.
    extras: tuple[str, ...] = ()
    #: The siblings that only its tests need (its ``test`` extra).
    test_siblings: tuple[str, ...] = ()
    #: What building it needs (its ``[build-system].requires``).
    build_requires: tuple[str, ...] = ()

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    @property
    def src(self) -> Path:
        return self.path / "src"

    @property
    def tests(self) -> Path:
        return self.path / "tests"


def _read_version(package_dir: Path, project: dict, tool: dict) -> str:
    if "version" in project:
        return str(project["version"])
    version_path = tool.get("hatch", {}).get("version", {}).get("path")
    if version_path is None:
        raise ValueError(f"{package_dir}: no static version and no [tool.hatch.version].path")
    text = (package_dir / version_path).read_text(encoding="utf-8")
    match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.MULTILINE)
    if match is None:
        raise ValueError(f"{package_dir / version_path}: no __version__ found")
    return match.group(1)


def _read_import_name(package_dir: Path, name: str, tool: dict) -> str:
    wheel = tool.get("hatch", {}).get("build", {}).get("targets", {}).get("wheel", {})
    packages = wheel.get("packages") or []
    if packages:
        return Path(packages[0]).name
    return name.replace("-", "_")


@functools.cache
def discover_packages() -> tuple[Package, ...]:
    """Every package under ``packages/``, in dependency (topological) order."""
    raw: dict[str, tuple[Path, dict, dict]] = {}
    build_requires: dict[str, tuple[str, ...]] = {}
    for pyproject in sorted(PACKAGES_DIR.glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        project = data.get("project", {})
        name = canonicalize_name(project["name"])
        raw[name] = (pyproject.parent, project, data.get("tool", {}))
        build_requires[name] = tuple(data.get("build-system", {}).get("requires", ()))

    packages: dict[str, Package] = {}
    for name, (path, project, tool) in raw.items():
        siblings: list[str] = []
        external: list[str] = []
        for requirement in project.get("dependencies", []):
            if _requirement_name(requirement) in raw:
                siblings.append(_requirement_name(requirement))
            else:
                external.append(requirement)
        extras = [
            requirement
            for requirements in project.get("optional-dependencies", {}).values()
            for requirement in requirements
            if _requirement_name(requirement) not in raw
        ]
        test_siblings = [
            _requirement_name(requirement)
            for requirement in project.get("optional-dependencies", {}).get("test", [])
            if _requirement_name(requirement) in raw
        ]
        packages[name] = Package(
            name=name,
            path=path,
            import_name=_read_import_name(path, name, tool),
            version=_read_version(path, project, tool),
            siblings=tuple(siblings),
            external=tuple(external),
            extras=tuple(dict.fromkeys(extras)),
            test_siblings=tuple(test_siblings),
            build_requires=build_requires[name],
        )

    # Dependencies first; alphabetical among the packages that are ready at the same time.
    sorter = TopologicalSorter({name: package.siblings for name, package in packages.items()})
    try:
        sorter.prepare()
    except CycleError as error:
        raise RuntimeError(f"dependency cycle among packages: {error.args[1]}") from None
    ordered: list[Package] = []
    while sorter.is_active():
        ready = sorted(sorter.get_ready())
        ordered.extend(packages[name] for name in ready)
        sorter.done(*ready)
    return tuple(ordered)


def closure(package: Package, *, tests: bool = False) -> list[Package]:
    """``package`` and every sibling it needs, transitively, in dependency order.

    With ``tests``, also the siblings that only its tests need (its ``test`` extra).
    """
    by_name = {p.name: p for p in discover_packages()}
    needed: set[str] = set()
    stack = [package.name, *(package.test_siblings if tests else ())]
    while stack:
        name = stack.pop()
        if name not in needed:
            needed.add(name)
            stack.extend(by_name[name].siblings)
    return [p for p in discover_packages() if p.name in needed]


def external_requirements(packages: list[Package] | tuple[Package, ...]) -> list[str]:
    """The non-sibling requirements of ``packages``, torch excluded (it is installed first)."""
    requirements: list[str] = []
    for package in packages:
        for requirement in package.external:
            if _requirement_name(requirement) != "torch" and requirement not in requirements:
                requirements.append(requirement)
    return requirements


# --------------------------------------------------------------------------------------------
# torch, from local wheels only
# --------------------------------------------------------------------------------------------


def _local_indexes(session: nox.Session, python: str) -> list[str]:
    """The package indexes of pip's configuration that are directories on this machine
    (``file://`` URLs): an index of wheels on local disk is no download."""
    output = session.run(python, "-m", "pip", "config", "list", silent=True, external=True)
    urls: list[str] = []
    for line in str(output or "").splitlines():
        key, _, value = line.partition("=")
        if key.endswith(("index-url", "extra-index-url")):
            urls += [url for url in shlex.split(value)[0].split() if url.startswith("file:")]
    return list(dict.fromkeys(urls))


def install_torch(
    session: nox.Session, version: str, *, python: str = "python", skip: bool = False
) -> None:
    """Install torch ``version`` from this machine's disk and pin it for the rest of the session.

    torch itself comes from pip's find-links directories (``--no-index``), else from the
    indexes of pip's configuration that are local directories (``file://``; such as the one
    holding the 5.5 GB CUDA build of torch 2.14.1, which runs on the CPU too): it is never
    downloaded. Its own dependencies come from pip's indexes after. Without a fitting wheel
    the session is skipped (``skip=True``) or fails, with the reason.
    """
    pip = (python, "-m", "pip", "install", "--quiet")
    attempts: list[list[str]] = [["--no-index"]]
    local = _local_indexes(session, python)
    if local:
        attempts.append(["--index-url", local[0]])
        for url in local[1:]:
            attempts[-1] += ["--extra-index-url", url]
    for where in attempts:
        try:
            session.run(*pip, *where, "--no-deps", f"torch=={version}", external=True)
            break
        except nox.command.CommandFailed:
            continue
    else:
        reason = (
            f"no torch=={version} wheel for Python {session.python} in pip's find-links "
            f"directories or local indexes ({local}), and that torch is not installed; torch "
            "is never downloaded"
        )
        if skip:
            session.skip(reason)
        session.error(reason)
    session.run(*pip, f"torch=={version}", external=True)  # its dependencies
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text(f"torch=={version}\n", encoding="utf-8")
    # Every later pip call in this session (build isolation included) keeps this torch.
    session.env["PIP_CONSTRAINT"] = str(constraints)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def install_build_requirements(
    session: nox.Session, packages: list[Package] | tuple[Package, ...]
) -> None:
    """Install what building ``packages`` needs into the session, once, so that they build
    without an isolated environment each (the build session's run of the README's
    ``pip wheel`` command builds them isolated, as users do)."""
    requirements = [r for p in packages for r in p.build_requires]
    if requirements:
        session.install(*dict.fromkeys(requirements))


def build_wheels(session: nox.Session, packages: list[Package] | tuple[Package, ...]) -> dict:
    """Build a wheel of each package (from the working tree) into the session's tmp dir."""
    out = Path(session.create_tmp()) / "wheels"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    install_build_requirements(session, packages)
    session.run(
        "python", "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "--wheel-dir", str(out), *[p.rel for p in packages],
    )  # fmt: skip
    wheels: dict[str, Path] = {}
    for package in packages:
        # Wheel file names use the distribution name with dashes turned into underscores.
        found = sorted(out.glob(f"{package.name.replace('-', '_')}-{package.version}-*.whl"))
        if not found:
            session.error(f"no wheel built for {package.name} in {out}")
        wheels[package.name] = found[-1]
    return wheels


def uninstall_gpipe(session: nox.Session) -> None:
    """Remove every installed distribution whose name starts with ``gpipe``."""
    output = session.run(
        "python",
        "-c",
        "import importlib.metadata as m\n"
        "print(' '.join(sorted({d.metadata['Name'] for d in m.distributions()"
        " if d.metadata['Name'] and d.metadata['Name'].lower().startswith('gpipe')})))",
        silent=True,
    )
    names = str(output or "").split()
    if names:
        session.run("python", "-m", "pip", "uninstall", "--quiet", "--yes", *names)


def install_all_packages(session: nox.Session) -> None:
    """Install every package from the working tree (non-editable) and its external deps."""
    packages = discover_packages()
    wheels = build_wheels(session, packages)
    uninstall_gpipe(session)
    session.install("--no-deps", *[str(wheels[p.name]) for p in packages])
    external = external_requirements(packages)
    if external:
        session.install(*external)
    session.run("python", "-m", "pip", "check")


# --------------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------------


# pytest's options whose value is the next argument, which is never a package then.
_PYTEST_VALUE_OPTIONS = frozenset(
    ["-k", "-m", "-p", "-o", "-c", "--deselect", "--ignore", "--ignore-glob", "--rootdir"]
)


def select_packages(args: list[str]) -> tuple[list[Package], list[str]]:
    """The packages named among ``args``, and the other arguments (for pytest).

    A package is named by its distribution name (``gpipe-skip``, in any spelling that
    normalizes to it: ``gpipe_skip``, ``GPipe.Skip``), its import name, or its directory
    (``packages/gpipe-skip``). No package named: all of them. An argument that looks like a
    package (``gpipe`` and a word, not an option or an existing path) but is none is an error.
    The value of a pytest option that takes one (``-k gpipe``) is always pytest's.
    """
    packages = discover_packages()
    by_name: dict[str, Package] = {}
    for package in packages:
        by_name[package.name] = package
        by_name[canonicalize_name(package.import_name)] = package
        by_name[package.rel] = package
    selected: list[Package] = []
    rest: list[str] = []
    for k, arg in enumerate(args):
        key = arg.rstrip("/")
        package = by_name.get(key) or by_name.get(canonicalize_name(key))
        if k and args[k - 1] in _PYTEST_VALUE_OPTIONS:
            rest.append(arg)
        elif package is not None and not arg.startswith("-"):
            selected.append(package)
        elif re.fullmatch(r"gpipe([-_.]\w+)?", arg, re.IGNORECASE) and not Path(arg).exists():
            names = ", ".join(p.name for p in packages)
            raise ValueError(f"no package named {arg!r} (packages: {names})")
        else:
            rest.append(arg)
    chosen = {p.name for p in selected}
    return [p for p in packages if p.name in chosen] or list(packages), rest


#: The packages whose tests run with every torch of the matrix; the others' run with
#: DEV_TORCH only. A second torch tests what depends on torch's version: these packages call
#: torch's private or version-dependent APIs, the others only its public tensor and module
#: API (gpipe-skip, gpipe-bn, gpipe-balance) or transformers' (gpipe-transformers, whose
#: torch calls are public ones). gpipe-microbatch: the saved-tensor hooks of the thread
#: state (torch._C._autograd); gpipe-checkpoint: autograd's checkpoint validity and the
#: generators' states; gpipe-core: autograd's graph nodes and saved tensors (the split
#: backward, torch's checkpoint), torch.distributed's point-to-point and groups, and its
#: cluster tests on the other payload channel (see payload_modes); gpipe: torch's elastic
#: agent and torchrun, which start the demo's processes.
EVERY_TORCH = ("gpipe-microbatch", "gpipe-checkpoint", "gpipe-core", "gpipe")


def payload_modes(torch: str) -> dict[str, str]:
    """The payload channel gpipe-core's cluster tests run on in a cell, so that a CI run
    tests each channel once: the tagged one (gloo's default) with DEV_TORCH, the strict one
    (the protocol NCCL needs) with the other torch versions, the CUDA build among them.
    ``GPIPE_TEST_PAYLOADS`` set by the caller wins (pytest alone runs both)."""
    if "GPIPE_TEST_PAYLOADS" in os.environ:
        return {}
    return {"GPIPE_TEST_PAYLOADS": "tagged" if torch == DEV_TORCH else "strict"}


@nox.session(allow_parallel=True)
@nox.parametrize("torch", TORCH_VERSIONS)
@nox.parametrize("python", PYTHONS)
def tests(session: nox.Session, torch: str) -> None:
    """Each package's tests and docstring examples, with only its own dependency closure installed.

    With DEV_TORCH, every package's; with another torch, those of EVERY_TORCH (what a second
    torch tests), unless packages are named. Arguments after ``--`` that name packages
    (``gpipe-skip``, ``gpipe_skip`` or ``packages/gpipe-skip``) choose whose tests run; the
    others go to pytest. A cell without
    its torch is skipped with the reason, except those of Python 3.11 (DEV_PYTHON), whose
    torch this machine holds: they fail, so that the run cannot pass without testing it.
    """
    try:
        chosen, pytest_args = select_packages(list(session.posargs))
    except ValueError as error:
        session.error(str(error))
    if torch != DEV_TORCH and len(chosen) == len(discover_packages()):
        # What another torch tests (see EVERY_TORCH); packages named after -- run anyway.
        chosen = [p for p in chosen if p.name in EVERY_TORCH]
    install_torch(session, torch, skip=session.python != DEV_PYTHON)
    session.install(*TEST_DEPS)
    for package in chosen:
        if not package.tests.is_dir() or not any(package.tests.rglob("test_*.py")):
            session.error(f"{package.name} has no tests (expected {package.rel}/tests/test_*.py)")
    needed_by = {package.name: closure(package, tests=True) for package in chosen}
    wheels = build_wheels(
        session, [p for p in discover_packages() if any(p in c for c in needed_by.values())]
    )

    for package in chosen:
        needed = needed_by[package.name]
        session.log(f"{package.name}: closure {[p.name for p in needed]}")
        uninstall_gpipe(session)
        session.install("--no-deps", *[str(wheels[p.name]) for p in needed])
        external = external_requirements(needed)
        # The package's own optional extras too, so that its tests cover them.
        external += [r for r in package.extras if r not in external]
        if external:
            session.install(*external)
        session.run("python", "-m", "pip", "check")
        # The tests, and the docstring examples of the installed package (--pyargs), so that
        # each module is imported once, under its own name.
        session.run(
            "python", "-m", "pytest", f"{package.rel}/tests",
            "--doctest-modules", "--pyargs", package.import_name, *pytest_args,
            env=payload_modes(torch),
        )  # fmt: skip
    uninstall_gpipe(session)


@nox.session(allow_parallel=True)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the repository."""
    session.install(RUFF)
    session.run("ruff", "check", ".", *session.posargs)
    session.run("ruff", "format", "--check", ".")


@nox.session(python=DEV_PYTHON, allow_parallel=True)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on every package's source tree (one run over all of them)."""
    install_torch(session, DEV_TORCH)
    packages = discover_packages()
    external = external_requirements(packages)
    session.install(MYPY, *external)
    # Sibling imports resolve to the working tree, for packages added after pyproject.toml's
    # mypy_path was last edited too.
    session.env["MYPYPATH"] = os.pathsep.join(str(p.src) for p in packages)
    # One run over every package: each module (and each third-party stub, transformers' the
    # largest) is analysed once.
    session.run(
        "mypy", "--strict", *[f"{p.rel}/src/{p.import_name}" for p in packages], *session.posargs
    )


@nox.session(python=DEV_PYTHON, allow_parallel=True)
def docs(session: nox.Session) -> None:
    """Sphinx HTML build (warnings and unresolved references are errors); the pages' examples."""
    install_torch(session, DEV_TORCH)
    # matplotlib draws the plot of docs/timeline.rst while the docs build.
    session.install(*SPHINX, PLOT)
    install_all_packages(session)
    out = DOCS_DIR / "_build" / "html"
    session.run(
        "sphinx-build", "-W", "-n", "--keep-going", "-E", "-b", "html",
        str(DOCS_DIR), str(out), *session.posargs,
    )  # fmt: skip
    # The pages' examples (testcode and doctest blocks) run, so that none can rot.
    session.run(
        "sphinx-build", "-W", "--keep-going", "-b", "doctest",
        str(DOCS_DIR), str(DOCS_DIR / "_build" / "doctest"),
    )  # fmt: skip


@nox.session(python=DEV_PYTHON, allow_parallel=True)
def build(session: nox.Session) -> None:
    """Build every package into dist/; check the READMEs' install commands in a fresh venv.

    The top-level README's commands (the plain install and the plot extra) run exactly as
    written, and gpipe must then be the version just built, imported from the fresh venv; the
    guide and the plot hints must give the same commands. Each package README's commands are
    dry-run: they must install that package's closure, all from dist/.
    """
    session.install("build")
    packages = discover_packages()
    install_build_requirements(session, packages)
    shutil.rmtree(DIST_DIR, ignore_errors=True)
    DIST_DIR.mkdir()
    for package in packages:
        session.run(
            "python", "-m", "build", "--no-isolation", "--outdir", str(DIST_DIR), package.rel
        )  # fmt: skip
    for package in packages:
        base = f"{package.name.replace('-', '_')}-{package.version}"
        for artifact in (f"{base}.tar.gz", f"{base}-py3-none-any.whl"):
            if not (DIST_DIR / artifact).is_file():
                session.error(f"missing build artifact dist/{artifact}")

    install, install_plot = _readme_install_commands(ROOT / "README.md")
    # The guide and the plot hints give the same commands as the README.
    guide = (DOCS_DIR / "guide.rst").read_text(encoding="utf-8")
    for command in (install, install_plot):
        if f"$ {command}\n" not in guide:
            session.error(f"docs/guide.rst does not give the README's command: {command}")
    hint_sources = [
        PACKAGES_DIR / "gpipe-core" / "src" / "gpipe_core" / "trace" / "_timeline.py",
        PACKAGES_DIR / "gpipe" / "src" / "gpipe" / "_cli.py",
    ]
    for source in hint_sources:
        if install_plot not in source.read_text(encoding="utf-8"):
            session.error(f"{source.relative_to(ROOT)} does not give the README's {install_plot}")

    venv_dir = Path(session.create_tmp()) / "fresh-venv"
    shutil.rmtree(venv_dir, ignore_errors=True)
    session.run("python", "-m", "venv", str(venv_dir))
    bin_dir = venv_dir / ("Scripts" if sys.platform == "win32" else "bin")
    python = str(bin_dir / "python")
    # torch from the local wheel only, pinned (PIP_CONSTRAINT) for the commands below.
    install_torch(session, DEV_TORCH, python=python)
    # Each command runs in a shell with the fresh venv activated, as a user would type it.
    activate = f". {shlex.quote(str(bin_dir / 'activate'))} && "
    by_name = {p.name: p for p in packages}

    dry_runs: dict[str, dict[str, str]] = {}

    def installs(command: str) -> dict[str, str]:
        """What ``command`` would install (a dry run): distribution name -> where from.

        A command that the READMEs and the docs give more than once is dry-run once."""
        if command in dry_runs:
            return dry_runs[command]
        report = Path(session.create_tmp()) / "install-report.json"
        dry_run = f" --dry-run --quiet --report {shlex.quote(str(report))}"
        session.run("sh", "-c", activate + command + dry_run, external=True)
        items = json.loads(report.read_text(encoding="utf-8"))["install"]
        dry_runs[command] = {
            canonicalize_name(i["metadata"]["name"]): i["download_info"]["url"] for i in items
        }
        return dry_runs[command]

    # Each package README's commands, dry runs in the fresh venv: exactly the package's
    # closure (every wheel for a command that installs dist/*.whl, as gpipe's README does:
    # its extras' siblings too), every one from the wheel just built in dist/.
    for package in packages:
        readme = package.path / "README.md"
        for command in _readme_install_commands(readme, expected=None):
            got = {n: url for n, url in installs(command).items() if n in by_name}
            every = "dist/*.whl" in shlex.split(command)
            want = {
                p.name: (DIST_DIR / f"{p.name.replace('-', '_')}-{p.version}-py3-none-any.whl")
                .resolve()
                .as_uri()
                for p in (packages if every else closure(package))
            }
            if got != want:
                session.error(f"{readme.relative_to(ROOT)}: {command!r} installs {got}, not {want}")

    # The README's commands exactly as written, in the fresh venv, from the checkout's root:
    # the stack (gpipe's closure), without its transformers extra.
    stack = closure(by_name["gpipe"])
    for command in (install, install_plot):
        session.run("sh", "-c", activate + command, external=True)
    session.run(python, "-m", "pip", "check", external=True)
    check = (
        "import importlib.metadata as m, os, sys\n"
        "from gpipe import GPipe\n"
        "import gpipe, matplotlib\n"
        "print(gpipe.__version__, gpipe.__file__)\n"
        f"assert gpipe.__version__ == {packages[-1].version!r}, gpipe.__version__\n"
        "expected = " + repr({p.name: p.version for p in stack}) + "\n"
        "got = {n: m.version(n) for n in expected}\n"
        "assert got == expected, f'installed {got}, built {expected}'\n"
        "import importlib.util\n"
        "extra = [n for n in ('gpipe-transformers', 'transformers') if importlib.util.find_spec("
        "n.replace('-', '_'))]\n"
        "assert not extra, f'the stack installs its transformers extra too: {extra}'\n"
        f"venv = os.path.realpath({str(venv_dir)!r})\n"
        "assert os.path.realpath(gpipe.__file__).startswith(venv + os.sep), gpipe.__file__\n"
    )
    session.run(python, "-c", check, external=True)

    # Every other shell command of the READMEs and the docs, in the fresh venv; a command
    # given in several places is checked once.
    checked: dict[str, str] = {}
    for where, command in documented_commands():
        key = re.sub(r"\s+#.*$", "", command)
        if key in checked:
            session.log(f"{where}: {command} (as {checked[key]}, checked)")
            continue
        checked[key] = where
        session.log(f"{where}: {command}")
        for part in command.split(" && "):
            check_command(session, part, activate, python, installs)


# An inline command that the docs give as what not to type: PyPI's "gpipe" is another project.
_NOT_COMMANDS = {"pip install gpipe"}


def documented_commands() -> list[tuple[str, str]]:
    """Every shell command of the READMEs and the docs: ``(file:line, command)``.

    The lines of Markdown ``console`` blocks, the ``$`` lines of reStructuredText
    ``code-block:: console`` blocks (``\\`` continued), and inline ``pip install ...``
    literals, except :data:`_NOT_COMMANDS`.
    """
    found: list[tuple[str, str]] = []
    for path in [ROOT / "README.md", *sorted(PACKAGES_DIR.glob("*/README.md"))]:
        in_block = False
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                in_block = line.strip() == "```console"
            elif in_block and line.strip():
                found.append((f"{path.relative_to(ROOT)}:{number}", line.strip()))
            for inline in re.findall(r"`(pip install [^`]+)`", line):
                found.append((f"{path.relative_to(ROOT)}:{number}", inline))
    for path in sorted(DOCS_DIR.glob("**/*.rst")):
        if "_build" in path.parts:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        in_block, pending = False, ""
        for number, line in enumerate(lines, 1):
            if line.startswith(".. code-block::"):
                in_block = line.split("::")[1].strip() == "console"
                continue
            if in_block and line.strip() and not line.startswith(" "):
                in_block = False
            if in_block and (pending or line.strip().startswith("$ ")):
                text = line.strip().removeprefix("$ ")
                if text.endswith("\\"):
                    pending += text[:-1]
                    continue
                found.append((f"{path.relative_to(ROOT)}:{number}", pending + text))
                pending = ""
            for inline in re.findall(r"``(pip install [^`]+)``", line):
                found.append((f"{path.relative_to(ROOT)}:{number}", inline))
    return [(where, command) for where, command in found if command not in _NOT_COMMANDS]


def check_command(
    session: nox.Session,
    command: str,
    activate: str,
    python: str,
    installs: Callable[[str], object],
) -> None:
    """Check one documented command in the fresh venv: run it, dry-run it, or parse it.

    ``pip install`` is dry-run (it needs the index); ``pip wheel`` runs from the checkout's
    root; ``nox`` must name sessions of this file, the demo's arguments after ``--`` must
    pass the demo's checks; ``python -m gpipe demo`` and ``torchrun ... -m gpipe demo`` must
    pass them too (under torchrun, with its world size), torchrun's own arguments its parser;
    a benchmark script must start and take its arguments (``--help`` after them).
    """
    command = re.sub(r"\s+#.*$", "", command)  # a comment after it
    argv = shlex.split(command)
    if argv[0].startswith("python") and argv[1:3] == ["-m", "pip"]:
        argv = ["pip", *argv[3:]]
    where = f"documented command {command!r}"
    demo_check = (
        "import sys\nfrom gpipe._cli import build_parser, _check_demo\n"
        "world = int(sys.argv[1])\nargs = build_parser().parse_args(sys.argv[2:])\n"
        "_check_demo(args, None if world == 0 else (0, world))\n"
    )
    if argv[:2] == ["pip", "install"]:
        installs(command)
    elif argv[:2] == ["pip", "wheel"]:
        session.run("sh", "-c", activate + command, external=True)
    elif argv[0].startswith("python") and argv[1:3] == ["-m", "nox"]:
        args = argv[3:]
        sessions = [args[k + 1] for k, arg in enumerate(args) if arg == "-s"]
        known = {name.split("(")[0] for name in nox.registry.get()}
        if any(name not in known for name in sessions):
            session.error(f"{where}: no such session (sessions: {sorted(known)})")
        if sessions == ["demo"] and "--" in args:
            demo = ["demo", *args[args.index("--") + 1 :]]
            session.run(python, "-c", demo_check, "0", *demo, external=True)
    elif argv[0].startswith("python") and argv[1:4] == ["-m", "gpipe", "demo"]:
        session.run(python, "-c", demo_check, "0", *argv[3:], external=True)
    elif argv[0] == "torchrun":
        parse = (
            "import sys\nfrom torch.distributed.run import get_args_parser\n"
            "a = get_args_parser().parse_args(sys.argv[1:])\n"
            "nodes = a.nnodes.split(':')[-1]\n"
            "print(int(nodes) * int(a.nproc_per_node), a.module, a.training_script,"
            " *a.training_script_args)\n"
        )
        out = str(session.run(python, "-c", parse, *argv[1:], silent=True, external=True))
        world, module, script, *rest = out.split()
        if module == "True" and script == "gpipe":
            session.run(python, "-c", demo_check, world, *rest, external=True)
    elif argv[0].startswith("python") and argv[1].startswith("benchmarks/"):
        session.run("sh", "-c", f"{activate}{command} --help >/dev/null", external=True)
    else:
        session.error(f"{where}: no check for this kind of command")


def _readme_install_commands(readme: Path, expected: int | None = 2) -> list[str]:
    """The ``pip install`` lines of the code blocks in ``readme``'s "## Install" section.

    For the top-level README: the plain command, then the one with the ``plot`` extra (the
    one with the ``transformers`` extra is checked with the other documented commands).
    """
    text = readme.read_text(encoding="utf-8")
    match = re.search(r"^## Install\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise ValueError(f"{readme}: no '## Install' section")
    commands = re.findall(r"^(pip install .+)$", match.group(1), re.MULTILINE)
    if expected is None:
        if not commands:
            raise ValueError(f"{readme}: no 'pip install' command under '## Install'")
        return commands
    plain = [c for c in commands if "[plot]" not in c and "[transformers]" not in c]
    plot = [c for c in commands if "[plot]" in c]
    if len(plain) != 1 or len(plot) != 1:
        raise ValueError(
            f"{readme}: expected one 'pip install' command and one with [plot] under"
            f" '## Install' (found: {commands})"
        )
    return [plain[0], plot[0]]


@nox.session(python=DEV_PYTHON)
def demo(session: nox.Session) -> None:
    """Run the command-line demo: python -m gpipe demo [args] (-- --processes 2: across
    two processes)."""
    install_torch(session, DEV_TORCH)
    install_all_packages(session)
    # Without NumPy torch warns at import, in every process the demo starts: the demo's
    # output stays free of third-party warnings.
    session.install("numpy")
    if "--plot" in session.posargs:
        session.install(PLOT)
    session.run("python", "-m", "gpipe", "demo", *session.posargs)


@nox.session(python=DEV_PYTHON)
def bench(session: nox.Session) -> None:
    """Run every benchmarks/bench_*.py script, in sorted order (arguments go to each)."""
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    if not scripts:
        session.skip("no benchmarks/bench_*.py scripts yet")
    install_torch(session, DEV_TORCH)
    install_all_packages(session)
    # The peers that bench_step.py compares with, best effort: a script reports a peer that
    # is missing. torchgpipe without its dependencies, so the pinned torch stays.
    for requirement in (["--no-deps", "torchgpipe==0.0.7"], ["numpy"]):
        try:
            session.install(*requirement)
        except Exception as error:  # nox.command.CommandFailed, for one
            session.log(f"could not install {' '.join(requirement)} ({error}); going on")
    for script in scripts:
        session.run("python", str(script), *session.posargs)
