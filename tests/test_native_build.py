"""The native library's build (issue 44, item 1): its units compile in parallel, the longest
first; a library compiled before from the same sources, flags and compiler is copied from the
cache, and any change compiles anew; ``QKV_NATIVE_BUILD=0`` builds none, and the runtime says
why the library is missing.

The builds here run setup.py on a copy of the tree with a stand-in compiler (a script that
answers ``--version``, writes each output file and logs its call), so they take seconds."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qkv.engine.kernels import native_lib

ROOT = Path(__file__).resolve().parents[1]
KERNELS = Path("src/qkv/engine/kernels")
pytest.importorskip("setuptools")


def load_setup():
    """setup.py as a module (it calls setup() only when run as __main__)."""
    spec = importlib.util.spec_from_file_location("qkv_setup_under_test", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


setup_py = load_setup()


# ----- the pieces: cache key, parallel compile, compiler check ---------------------------------


def native_ext():
    (ext,) = setup_py._native()
    return ext


def copy_sources(to: Path) -> Path:
    shutil.copytree(ROOT / KERNELS / "native_src", to / KERNELS / "native_src")
    return to


def key(root: Path, identity=("g++ --version: g++ 12",), options=None, ext=None) -> str:
    return setup_py.cache_key(ext or native_ext(), list(identity), options or {}, str(root))


@pytest.mark.skipif(sys.platform == "win32", reason="no native library on Windows")
def test_the_cache_key_follows_every_input_and_not_the_folder(tmp_path):
    a, b = copy_sources(tmp_path / "a"), copy_sources(tmp_path / "b")
    assert key(a) == key(b)  # the same sources elsewhere (an sdist unpacked): the same key
    first = key(a)
    header = a / KERNELS / "native_src" / "common.h"
    header.write_text(header.read_text() + "// one more line\n")
    assert key(a) != first  # a header
    copy = key(b)
    (b / KERNELS / "native_src" / "extra.h").write_text("// a new header\n")
    assert key(b) != copy  # a new file in the sources' folder
    assert key(a, identity=["g++ --version: g++ 13"]) != key(a)  # another compiler
    assert key(a, options={"debug": 1}) != key(a)  # build_ext's own flags
    ext = native_ext()
    ext.extra_compile_args = [*ext.extra_compile_args, "-march=native"]
    assert key(a, ext=ext) != key(a)  # the extension's flags


def test_the_compiler_identity_asks_each_program_and_a_missing_compiler_is_named():
    asked: list[list[str]] = []

    def run(argv, **kwargs):
        asked.append(argv)
        if argv[0] == "cc-missing":
            raise FileNotFoundError(2, "No such file or directory", argv[0])
        return subprocess.CompletedProcess(argv, 0 if argv[0] != "false" else 1, "v1\n", "")

    commands = {"compiler_so": ["cc-missing", "-O2"], "compiler_so_cxx": ["c++", "-fPIC"]}
    said = setup_py.compiler_identity(commands, run)
    assert ["c++", "--version"] in asked and ["cc-missing", "--version"] in asked
    assert "c++ --version: v1" in said and any("cc-missing did not run" in s for s in said)
    with pytest.raises(setup_py.NoCompiler, match=r"^no C\+\+ compiler: false --version"):
        setup_py.version("false", run)


def test_parallel_compile_starts_the_longest_first_and_returns_the_objects_in_order():
    started: list[str] = []
    running = {"now": 0, "most": 0}
    lock = threading.Lock()

    def compile_one(sources, output_dir=None):
        with lock:
            started.append(sources[0])
            running["now"] += 1
            running["most"] = max(running["most"], running["now"])
        time.sleep(0.05)
        with lock:
            running["now"] -= 1
        return [f"{output_dir}/{sources[0]}.o"]

    compile = setup_py.parallel_compile(compile_one, 2, first=["c", "a"])
    objects = compile(["a", "b", "c", "d"], output_dir="t")
    assert objects == ["t/a.o", "t/b.o", "t/c.o", "t/d.o"]  # the sources' order: the link's
    assert started[:2] == ["c", "a"] and sorted(started) == ["a", "b", "c", "d"]
    assert running["most"] == 2


def test_parallel_compile_raises_the_failure_and_starts_nothing_after_it():
    started: list[str] = []

    def compile_one(sources, output_dir=None):
        started.append(sources[0])
        if sources[0] == "bad":
            raise RuntimeError("command 'c++' failed with exit code 1")
        time.sleep(0.05)
        return [sources[0] + ".o"]

    compile = setup_py.parallel_compile(compile_one, 2)
    with pytest.raises(RuntimeError, match="exit code 1"):  # not CancelledError
        compile(["bad", "x", "y", "z", "w"])
    assert len(started) < 5


def test_the_jobs_are_the_cores_unless_asked():
    assert setup_py.jobs(3) == 3
    assert setup_py.jobs(None) == setup_py.jobs(True) >= 1


def test_the_runtime_reads_the_reason_the_build_left(tmp_path):
    assert native_lib.build_note(tmp_path).startswith("no C++ compiler when qkv was installed")
    (tmp_path / native_lib.BUILD_NOTE).write_text("QKV_NATIVE_BUILD=0 was set\nmore\n")
    assert native_lib.build_note(tmp_path) == "QKV_NATIVE_BUILD=0 was set"
    assert native_lib.BUILD_NOTE == setup_py.NOTE


# ----- setup.py build_ext on a copy of the tree, with a stand-in compiler ----------------------

FAKE = """
import sys
from pathlib import Path
args = sys.argv[1:]
if args == ["--version"]:
    print("stand-in c++ 1.0")
    sys.exit(0)
with open(LOG, "a") as log:
    log.write(("link" if "-shared" in args else "compile") + " " + " ".join(args) + "\\n")
Path(args[args.index("-o") + 1]).write_text("built\\n")
"""


@pytest.fixture
def tree(tmp_path):
    if sys.platform == "win32":
        pytest.skip("no native library on Windows")
    tree = tmp_path / "qkv"
    tree.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "_native_build.txt")
    shutil.copytree(ROOT / "src", tree / "src", ignore=ignore)
    return tree


def stand_in(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "calls.log"
    script = tmp_path / "fake-cxx"
    script.write_text(f"#!{sys.executable}\nLOG = {str(log)!r}\n{FAKE}")
    script.chmod(0o755)
    return script, log


def build(tree: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tree,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def libraries(tree: Path) -> list[Path]:
    return sorted((tree / KERNELS).glob("_native*"))


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_a_reinstall_copies_the_library_and_any_change_compiles_anew(tree, tmp_path):
    script, log = stand_in(tmp_path)
    cache = tmp_path / "cache"
    env = {
        "CC": str(script), "CXX": str(script), "LDSHARED": f"{script} -shared",
        "LDCXXSHARED": f"{script} -shared", "QKV_NATIVE_CACHE": str(cache),
        "QKV_NATIVE_BUILD": "",
    }  # fmt: skip
    first = build(tree, env)
    compiled = [c for c in calls(log) if c.startswith("compile")]
    assert len(compiled) == len(setup_py.UNITS) and sum(c.startswith("link") for c in calls(log))
    assert f"compiling the optional native kernels: {len(setup_py.UNITS)} C++ units" in first.stderr
    (library,) = libraries(tree)
    assert library.read_text() == "built\n" and len(list(cache.glob("*/_native*"))) == 1

    library.unlink()
    again = build(tree, env)  # unchanged: copied, nothing compiled
    assert len(calls(log)) == len(compiled) + 1, again.stderr[-2000:]
    assert "copied from" in again.stderr and libraries(tree) == [library]

    header = tree / KERNELS / "native_src" / "widen.h"
    header.write_text(header.read_text() + "\n// changed\n")
    build(tree, env)  # a header changed: compiled anew
    assert len(calls(log)) == 2 * (len(compiled) + 1)
    flag = {"CFLAGS": "-DQKV_SOMETHING", "CXXFLAGS": "-DQKV_SOMETHING"}
    build(tree, {**env, **flag})  # a flag changed: compiled anew
    assert len(calls(log)) == 3 * (len(compiled) + 1)
    assert "-DQKV_SOMETHING" in calls(log)[-2]
    build(tree, {**env, "QKV_NATIVE_CACHE": "0"})  # no cache: compiled
    assert len(calls(log)) == 4 * (len(compiled) + 1)


def test_qkv_native_build_0_builds_no_library_and_the_runtime_says_why(tree, tmp_path):
    script, log = stand_in(tmp_path)
    env = {"CC": str(script), "CXX": str(script), "QKV_NATIVE_BUILD": "0"}
    env["QKV_NATIVE_CACHE"] = str(tmp_path / "cache")
    suffix = subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    stale = tree / KERNELS / f"_native{suffix}"
    stale.write_text("an earlier install's library\n")
    run = build(tree, env)
    assert calls(log) == []  # nothing compiled, not even asked for its version
    assert not stale.exists() and libraries(tree) == [tree / KERNELS / native_lib.BUILD_NOTE]
    assert "QKV_NATIVE_BUILD=0" in run.stderr
    why = subprocess.run(
        [sys.executable, "-c", "from qkv.engine.kernels import native; print(native.info())"],
        env={**os.environ, "PYTHONPATH": str(tree / "src"), "QKV_NATIVE": ""},  # not off
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "'reason': 'not built (QKV_NATIVE_BUILD=0 was set when qkv was installed)'" in (
        why.stdout
    ), why.stderr[-2000:]
    assert "'active': False" in why.stdout

    build(tree, {**env, "QKV_NATIVE_BUILD": "1"})  # built again: the note goes
    assert [p.name for p in libraries(tree)] == [stale.name]


def test_a_missing_compiler_is_named_and_nothing_is_compiled(tree, tmp_path):
    missing = str(tmp_path / "no-such-compiler")
    run = build(tree, {"CC": missing, "CXX": missing, "QKV_NATIVE_BUILD": ""})
    note = (tree / KERNELS / native_lib.BUILD_NOTE).read_text()
    assert note.startswith(f"no C++ compiler: {missing} did not run"), note
    assert "compiling" not in run.stderr
    assert native_lib.build_note(tree / KERNELS) == note.strip()


def test_the_readme_and_the_install_page_name_the_switches_setup_py_reads():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    page = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert f"{setup_py.BUILD_ENV}=0" in readme and f"{setup_py.BUILD_ENV}=0" in page
    assert f"{setup_py.CACHE_ENV}=0" in page and "~/.cache/qkv/native" in page
    assert "the four libraries used last" in page and setup_py.CACHE_KEEP == 4


def test_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(setup_py.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert setup_py.cache_dir() == tmp_path / "qkv" / "native"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert setup_py.cache_dir() == Path.home() / ".cache" / "qkv" / "native"
    monkeypatch.setenv(setup_py.CACHE_ENV, str(tmp_path / "here"))
    assert setup_py.cache_dir() == tmp_path / "here"
    monkeypatch.setenv(setup_py.CACHE_ENV, "0")
    assert setup_py.cache_dir() is None


# ----- the build's log: no warnings from the compiler's own headers --------------------------

# A unit as the kernels' are written: common.h first, then the intrinsics header again (as
# decode.cpp includes it), and an AVX-512 intrinsic built on _mm512_undefined_ps, which GCC 12
# reports as reading an uninitialised value wherever it is inlined.
PROBE = """#include "common.h"
#include <immintrin.h>
namespace {
QKV_AVX512 void probe(const uint16_t* h, float* o) {
    _mm512_storeu_ps(o, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))));
}
}  // namespace
void (*keep)(const uint16_t*, float*) = probe;
"""


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and os.uname().machine == "x86_64"),
    reason="the AVX-512 clones are compiled on x86-64 Linux",
)
def test_the_kernels_headers_compile_without_a_warning_with_the_build_flags(tmp_path):
    # (GCC 12 printed a few hundred false "may be used uninitialized" reports from its own
    # avx512fintrin.h into every build's log, and -Wpsabi notes; common.h reads the header with
    # those two warnings off, and the build passes -Wno-psabi)
    # (CXX as the build reads it: a command with its own words, e.g. "ccache g++"; one that
    # does not run means no compiler, as for the build)
    found = shutil.which("g++") or shutil.which("c++") or ""
    cxx = shlex.split(os.environ.get("CXX", "")) or [found]
    if not cxx[0] or shutil.which(cxx[0]) is None:
        pytest.skip("no C++ compiler here (the library is not built either)")
    (tmp_path / "probe.cpp").write_text(PROBE)
    flags = [f for f in native_ext().extra_compile_args if f != "-g0"]
    done = subprocess.run(
        [*cxx, *flags, "-Wall", "-Werror", f"-I{ROOT / KERNELS / 'native_src'}", "-c",
         "probe.cpp", "-o", "probe.o"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""
