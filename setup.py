"""Build the optional native kernels (a plain C ABI library, loaded with ctypes).

Everything else is in pyproject.toml. The library is optional: when no C++ compiler is found
or the build fails for any reason, a warning is printed and the pure-Python package is
installed; ``qkv.engine.kernels.native.info()`` then says the native kernels are not built, and
why (the build leaves the reason next to where the library would be: :data:`NOTE`).

How the library is built (issue 44):

- ``QKV_NATIVE_BUILD=0`` skips it: nothing is compiled.
- Its units (one per kernel family, and one per vector clone of the decode step) are compiled
  in parallel, one per core, the longest first; one line on stderr says so before they start
  (pip shows it with ``-v``, and in its ``--log`` file).
- A library compiled before from the same sources, flags and compiler is copied from a cache
  (``QKV_NATIVE_CACHE``: a folder, or ``0`` for none; by default ``~/.cache/qkv/native``)
  instead of compiled again: a reinstall, an editable install after ``pip install .``, or the
  wheel that ``python -m build`` builds from the sdist. Its key is a hash of every file in the
  sources' folder, the extension's flags, the compiler's commands and what ``--version`` says,
  so that any change compiles anew.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext

BUILD_ENV = "QKV_NATIVE_BUILD"  # "0": build no library
CACHE_ENV = "QKV_NATIVE_CACHE"  # the cache's folder, or "0" for none
NOTE = "_native_build.txt"  # why the library is not built, next to where it would be
CACHE_KEEP = 4  # libraries the cache keeps (the most recently used); about 1.5 MB each
CACHE_SCHEME = 1  # raise when what the key covers changes
# Compiler's environment variables that change what it reads (the key covers them).
COMPILER_ENV = ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH", "LIBRARY_PATH", "GCC_EXEC_PREFIX")
# The compiler's seconds for all units on one core (GCC 12, x86-64), for the message.
CPU_SECONDS = 180


class OutOfTreeBuild(build):
    """``build`` whose working folder is outside the checkout (one per checkout, in the temp
    folder), so ``pip install -e .`` leaves no ``build/`` folder there: one would shadow the
    ``build`` package and ``python -m build`` would fail. ``--build-base`` still overrides it."""

    def initialize_options(self) -> None:
        super().initialize_options()
        here = os.path.dirname(os.path.abspath(__file__))
        tag = hashlib.sha256(here.encode()).hexdigest()[:12]
        self.build_base = os.path.join(tempfile.gettempdir(), f"qkv-build-{tag}")


def skipped() -> bool:
    """Whether ``QKV_NATIVE_BUILD=0`` asks for no library."""
    return os.environ.get(BUILD_ENV, "").strip() == "0"


def jobs(asked: int | bool | None = None) -> int:
    """How many units compile at once: ``asked`` (build_ext's ``--parallel``) when a number,
    else the cores this process may use."""
    if asked and asked is not True:
        return max(1, int(asked))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def cache_dir() -> Path | None:
    """The cache's folder (``QKV_NATIVE_CACHE``, else the user's cache folder), or None for no
    cache (``QKV_NATIVE_CACHE=0``)."""
    given = os.environ.get(CACHE_ENV, "").strip()
    if given == "0":
        return None
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qkv" / "native"


def source_files(ext: Extension, root: str = ".") -> list[str]:
    """Every file the library is compiled from: its sources, their folders' other files (the
    headers, and the sources that ``decode_<clone>.cpp`` include) and its ``depends``, as
    paths relative to ``root``, sorted."""
    files = set(ext.sources) | set(ext.depends)
    for folder in {os.path.dirname(s) for s in ext.sources}:
        for name in os.listdir(os.path.join(root, folder)):
            if os.path.isfile(os.path.join(root, folder, name)):
                files.add(os.path.join(folder, name))
    return sorted(files)


class NoCompiler(Exception):
    """The C++ compiler does not run (none installed, or ``CXX`` points nowhere)."""


def compiler_identity(
    commands: dict[str, Any], run: Callable[..., Any] = subprocess.run
) -> list[str]:
    """``commands`` (the compiler object's command lines: name -> argument list) and what each
    program they start says to ``--version`` (or that it did not run)."""
    said = [f"{name}={value!r}" for name, value in sorted(commands.items())]
    programs = sorted({v[0] for v in commands.values() if isinstance(v, list) and v})
    for program in programs:
        try:
            said.append(f"{program} --version: {version(program, run)}")
        except NoCompiler as exc:  # the C compiler, say, where only the C++ one is used
            said.append(f"{program}: {exc}")
    return said


def version(program: str, run: Callable[..., Any] = subprocess.run) -> str:
    """What ``program --version`` says; :class:`NoCompiler` when it does not run or fails."""
    try:
        done = run([program, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NoCompiler(f"no C++ compiler: {program} did not run ({exc})") from exc
    if done.returncode != 0:
        raise NoCompiler(f"no C++ compiler: {program} --version exited with {done.returncode}")
    return str(done.stdout).strip()


def cache_key(
    ext: Extension, identity: Sequence[str], options: dict[str, Any], root: str = "."
) -> str:
    """The library's cache key: a hash of every source file (name and bytes), the extension's
    and build_ext's flags (``options``), the compiler's identity, the compiler's environment
    variables and the platform."""
    h = hashlib.sha256(f"qkv native cache {CACHE_SCHEME}\n".encode())
    for name in source_files(ext, root):
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        h.update(f"file {Path(name).as_posix()} {len(data)}\n".encode())
        h.update(data)
    fields = (
        "extra_compile_args", "extra_link_args", "define_macros", "undef_macros",
        "include_dirs", "libraries", "library_dirs", "runtime_library_dirs", "extra_objects",
        "export_symbols", "language",
    )  # fmt: skip
    for name in fields:
        h.update(f"ext.{name}={getattr(ext, name, None)!r}\n".encode())
    for name, value in sorted(options.items()):
        h.update(f"build_ext.{name}={value!r}\n".encode())
    for line in identity:
        h.update(f"compiler {line}\n".encode())
    for name in COMPILER_ENV:
        h.update(f"env {name}={os.environ.get(name)!r}\n".encode())
    h.update(f"platform {sysconfig.get_platform()} {sys.platform}\n".encode())
    return h.hexdigest()


def parallel_compile(
    compile_one: Callable[..., list[str]], n: int, first: Sequence[str] = ()
) -> Callable[..., list[str]]:
    """A ``CCompiler.compile`` that compiles its sources ``n`` at a time (each by
    ``compile_one``, the compiler's own method, on one source), starting them in the order of
    ``first`` (the longest first; distutils sorts the sources by name), the others after, and
    returning the objects in the order of the sources given. The first failure stops the units
    not yet started and is raised."""
    rank = {s: i for i, s in enumerate(first)}

    def compile(sources: list[str], *args: Any, **kwargs: Any) -> list[str]:
        if n <= 1 or len(sources) <= 1:
            return compile_one(sources, *args, **kwargs)
        start = sorted(sources, key=lambda s: rank.get(s, len(rank)))  # stable
        with ThreadPoolExecutor(max_workers=n) as pool:
            futures = {s: pool.submit(compile_one, [s], *args, **kwargs) for s in start}
            wait(futures.values(), return_when=FIRST_EXCEPTION)
            for f in futures.values():
                f.cancel()  # those not started; the running ones finish
            failed = [f.exception() for f in futures.values() if not f.cancelled()]
            for exc in failed:
                if exc is not None:
                    raise exc
            return [obj for s in sources for obj in futures[s].result()]

    return compile


def _say(message: str) -> None:
    print(f"qkv: {message}", file=sys.stderr, flush=True)


class OptionalBuildExt(build_ext):
    """``build_ext`` that never fails the install (the NumPy kernels work without it), compiles
    the units in parallel and reuses a library compiled before (see the module's notes)."""

    def run(self) -> None:
        # in place: an editable install (or --inplace) copies the library into the sources
        self._in_place = bool(self.inplace or getattr(self, "editable_mode", False))
        self._not_built: set[str] = set()
        if skipped():
            for ext in self.extensions:
                self._give_up(ext, f"{BUILD_ENV}=0 was set when qkv was installed")
            return
        try:
            super().run()
        except Exception as exc:  # no compiler, a compiler that fails, a missing header...
            for ext in self.extensions:
                if ext.name not in self._not_built:
                    self._give_up(ext, f"the build failed: {exc}")

    def build_extension(self, ext: Extension) -> None:
        try:
            self._build(ext)
        except NoCompiler as exc:
            self._give_up(ext, str(exc))
        except Exception as exc:
            self._give_up(ext, f"the build failed: {exc or type(exc).__name__}")

    def copy_extensions_to_source(self) -> None:
        # setuptools' step for editable installs: only the libraries that were built
        kept = self.extensions
        self.extensions = [e for e in kept if e.name not in self._not_built]
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = kept

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # a C ABI library for ctypes, not a Python module: no PyInit_ function

    # --- the build ---------------------------------------------------------------------

    def _build(self, ext: Extension) -> None:
        target = self.get_ext_fullpath(ext.name)
        cached = self._cache_entry(ext)
        if cached is not None and cached.is_file():
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(cached, target)
            os.utime(cached.parent)  # recently used: kept by the pruning (by folder times)
            self._built(ext)
            _say(
                f"the native kernels were compiled before from these sources with this "
                f"compiler: copied from {cached.parent} ({CACHE_ENV}=0 compiles them anew)"
            )
            return
        n = min(jobs(self.parallel), len(ext.sources))
        _say(
            f"compiling the optional native kernels: {len(ext.sources)} C++ units, {n} at a "
            f"time (about {max(15, round(CPU_SECONDS / n))} s on {n} cores; "
            f"{BUILD_ENV}=0 skips them)"
        )
        start = time.monotonic()
        own_compile, force = self.compiler.compile, self.force
        for obj in self.compiler.object_filenames(ext.sources, output_dir=self.build_temp):
            os.makedirs(os.path.dirname(obj) or ".", exist_ok=True)  # before the threads
        self.compiler.compile = parallel_compile(own_compile, n, ext.sources)
        self.force = True  # the cache decides what is up to date, not the files' times
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile, self.force = own_compile, force
        self._built(ext)
        _say(f"compiled the native kernels in {time.monotonic() - start:.0f} s")
        if cached is not None:
            self._store(target, cached)

    def _cache_entry(self, ext: Extension) -> Path | None:
        """Where the cache holds this library (None: no cache); :class:`NoCompiler` where the
        C++ compiler does not run."""
        names = ("compiler_so", "compiler_so_cxx", "compiler_cxx", "linker_so", "linker_so_cxx")
        commands = {n: getattr(self.compiler, n) for n in names if hasattr(self.compiler, n)}
        cxx = commands.get("compiler_so_cxx") or commands.get("compiler_so") or []
        if cxx:
            version(cxx[0])  # no compiler: say so before anything is compiled
        folder = cache_dir()
        if folder is None:
            return None
        identity = compiler_identity(commands)
        # Python's own include folders are left out: no source includes Python.h (a ctypes
        # library), and a build in a fresh virtual environment (python -m build) would
        # otherwise never find its library.
        python = {
            sysconfig.get_paths().get("include"),
            sysconfig.get_paths().get("platinclude"),
            os.path.join(sys.exec_prefix, "include"),
        }
        options = {
            "include_dirs": [d for d in self.include_dirs or [] if d not in python],
            "define": self.define,
            "undef": self.undef,
            "libraries": self.libraries,
            "library_dirs": self.library_dirs,
            "rpath": self.rpath,
            "link_objects": self.link_objects,
            "debug": self.debug,
        }
        root = os.path.dirname(os.path.abspath(__file__))
        key = cache_key(ext, identity, options, root)
        return folder / key[:40] / os.path.basename(self.get_ext_filename(ext.name))

    @staticmethod
    def _store(built: str, entry: Path) -> None:
        """Put the library just built in the cache (written whole, then renamed), keeping the
        CACHE_KEEP most recently used; a cache that cannot be written only says so."""
        try:
            entry.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            entry.parent.mkdir(mode=0o700, exist_ok=True)
            part = entry.with_name(f"{entry.name}.{os.getpid()}.part")
            shutil.copyfile(built, part)
            os.replace(part, entry)
            entries = sorted(
                (p for p in entry.parent.parent.iterdir() if p.is_dir()),
                key=lambda p: p.stat().st_mtime,
                reverse=True,
            )
            for old in entries[CACHE_KEEP:]:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            _say(f"the library was not cached ({exc})")

    # --- what is left next to the library ----------------------------------------------

    def _places(self, ext: Extension) -> list[str]:
        """Where the library goes: the build folder, and the sources for an editable install."""
        places = [self.get_ext_fullpath(ext.name)]
        if getattr(self, "_in_place", False):
            inplace, self.inplace = self.inplace, True
            try:
                places.append(self.get_ext_fullpath(ext.name))
            finally:
                self.inplace = inplace
        return places

    def _built(self, ext: Extension) -> None:
        for place in self._places(ext):  # a note from an earlier install would be stale
            note = os.path.join(os.path.dirname(place), NOTE)
            if os.path.isfile(note):
                os.remove(note)

    def _give_up(self, ext: Extension, why: str) -> None:
        """No library: say why, on stderr and in the note the runtime reads, and remove one an
        earlier install left (it was built from other sources or flags)."""
        self._not_built.add(ext.name)
        _say(f"the optional native kernels were not built ({why}); the NumPy kernels will be used")
        for place in self._places(ext):
            if os.path.isfile(place):
                os.remove(place)
            os.makedirs(os.path.dirname(place), exist_ok=True)
            with open(os.path.join(os.path.dirname(place), NOTE), "w", encoding="utf-8") as f:
                f.write(why + "\n")


_SRC = "src/qkv/engine/kernels/native_src"
# The units, the longest to compile first (they start in this order): the decode step's vector
# clones, each in two units, its pieces for paged K/V (decode_<clone>_paged.cpp) and for
# contiguous K/V (decode_<clone>.cpp; decode_avx512*.cpp also the AVX512_BF16 ones; decode.cpp
# itself the baseline clone's contiguous pieces and the C ABI, decode_paged.cpp its paged
# ones), then one per kernel family. Each instantiation is compiled in one unit only; the
# split costs about a second of parsing the headers per unit, and lets 2 cores share the
# decode step's pieces instead of waiting on one long unit.
UNITS = (
    "decode_avx512_paged", "decode_avx2_paged", "decode_avx512", "decode_paged",
    "decode", "decode_avx2", "forward", "backward_bf16", "forward_bf16", "backward",
)  # fmt: skip
HEADERS = ("abi", "common", "bf16", "pool", "tiles", "widen")


def _native() -> list[Extension]:
    if sys.platform == "win32":
        return []  # the source uses GCC/Clang attributes
    return [
        Extension(
            "qkv.engine.kernels._native",
            sources=[f"{_SRC}/{name}.cpp" for name in UNITS],
            depends=[f"{_SRC}/{name}.h" for name in HEADERS],
            language="c++",
            # No -march: the vector clones are chosen at run time (see common.h).
            extra_compile_args=[
                "-O3",
                "-std=c++17",
                "-fopenmp-simd",
                "-pthread",
                "-fno-math-errno",
                "-fno-trapping-math",
                "-ffp-contract=fast",  # a * b + c as one FMA where the clone has it
                # No notes that a vector argument's ABI changed with GCC 4.6: every function
                # passing vectors is internal and inlined (none crosses the library's ABI).
                "-Wno-psabi",
                # No debug information (Python's CFLAGS ask for -g): the same machine code,
                # a library a quarter the size, and about 15% less compile time.
                "-g0",
            ],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its helpers
    setup(ext_modules=_native(), cmdclass={"build": OutOfTreeBuild, "build_ext": OptionalBuildExt})
