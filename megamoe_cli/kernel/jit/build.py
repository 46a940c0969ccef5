"""Content-hashed, lock-safe, parallel nvcc builds of kernel variants into cubins.

One variant = one generated ``.cu`` (every shape and config a compile-time constant).
Its cache key is a sha256 over the source text, every header under its include
dirs, its flags and ``nvcc --version``; the cubin lives at
``cache_dir()/<name>-<key[:16]>/kernel.cubin`` beside ``kernel.cu``, ``ptxas.txt``
and ``report.json``.

NOTES: safety when several ranks build at once.  Each variant directory has a
``.lock`` file taken with ``fcntl.flock``; the holder re-checks for the finished
cubin, compiles into a uniquely named temp file in the same directory and
publishes with ``os.replace`` after ``report.json`` is in place, so the cubin's
presence means the variant is complete.  flock locks die with their process (and
Python opens files close-on-exec, so compiler children never inherit one): a
build killed midway leaves only temp files, which the next lock holder removes.
Lock files are never deleted, so no two processes can lock different inodes of
one path.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ...errors import MegaMoEError, MegaMoETimeout
from ...files import atomic_write

ENV_CACHE_DIR = "MEGAMOE_CACHE_DIR"
ENV_NVCC = "MEGAMOE_NVCC"
ENV_LOCK_TIMEOUT = "MEGAMOE_JIT_LOCK_TIMEOUT"

DEFAULT_LOCK_TIMEOUT_S = 1200.0
KEY_SCHEMA = "megamoe-jit-1"
HEADER_SUFFIXES = (".cuh", ".h", ".hpp")
BASE_FLAGS: Tuple[str, ...] = (
    "-cubin",
    "-O3",
    "-std=c++17",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-Xptxas",
    "-v",
    "--expt-relaxed-constexpr",
    "-lineinfo",
)
LOG_TAIL_LINES = 60

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_TEMP_MARK = ".tmp-"


class BuildError(RuntimeError):
    """nvcc failed on a variant; the message holds the command and the log's tail."""

    def __init__(self, name: str, command: str, log: str, also_failed: Sequence[str] = ()):
        self.name = name
        self.command = command
        self.log = log
        self.also_failed = tuple(also_failed)
        tail = "\n".join(log.rstrip().splitlines()[-LOG_TAIL_LINES:])
        message = f"nvcc failed on kernel variant '{name}'\ncommand: {command}\ncompiler log (last {LOG_TAIL_LINES} lines):\n{tail}"
        if self.also_failed:
            message += f"\n(these variants failed too: {', '.join(self.also_failed)})"
        super().__init__(message)


@dataclass(frozen=True)
class KernelSource:
    """One variant: the full text of a generated ``.cu`` plus what it compiles with."""

    name: str
    source: str
    flags: Tuple[str, ...] = ()
    include_dirs: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise MegaMoEError(
                f"KernelSource.name must match {_NAME_RE.pattern} (it names a cache directory), got {self.name!r}"
            )
        if not isinstance(self.source, str) or not self.source.strip():
            raise MegaMoEError(f"KernelSource '{self.name}': source must be non-empty .cu text")
        object.__setattr__(self, "flags", tuple(self.flags))
        object.__setattr__(self, "include_dirs", tuple(str(d) for d in self.include_dirs))
        for flag in self.flags:
            if not isinstance(flag, str):
                raise MegaMoEError(f"KernelSource '{self.name}': flags must be strings, got {flag!r}")
        for directory in self.include_dirs:
            if not Path(directory).is_dir():
                raise MegaMoEError(f"KernelSource '{self.name}': include dir {directory!r} does not exist")


@dataclass(frozen=True)
class FunctionReport:
    """What ptxas said about one function of the cubin."""

    registers: int = 0
    spill_stores_bytes: int = 0
    spill_loads_bytes: int = 0
    stack_frame_bytes: int = 0
    smem_bytes: int = 0
    barriers: int = 0
    entry: bool = False

    @property
    def has_spills(self) -> bool:
        return self.spill_stores_bytes > 0 or self.spill_loads_bytes > 0


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_USED_RE = re.compile(r"Used (\d+) registers")
_BARRIERS_RE = re.compile(r"used (\d+) barriers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


@dataclass(frozen=True)
class PtxasReport:
    """``ptxas -v`` output of one variant, parsed per function (mangled names)."""

    functions: Dict[str, FunctionReport] = field(default_factory=dict)
    raw: str = ""

    @property
    def has_spills(self) -> bool:
        return any(f.has_spills for f in self.functions.values())

    @property
    def serialized_wgmma(self) -> List[str]:
        """ptxas's notes that it serialized WGMMAs (C7514/C7515...): each one costs the overlap
        of a whole WGMMA pipeline, so the kernel must have none."""
        return [line.strip() for line in self.raw.splitlines() if "wgmma.mma_async instructions are serialized" in line]

    @property
    def entries(self) -> Dict[str, FunctionReport]:
        return {name: f for name, f in self.functions.items() if f.entry}

    def __getitem__(self, name: str) -> FunctionReport:
        return self.functions[name]

    def summary(self) -> str:
        parts = []
        for name, f in sorted(self.entries.items()):
            spill = f", SPILLS {f.spill_stores_bytes}B st/{f.spill_loads_bytes}B ld" if f.has_spills else ""
            parts.append(f"{name}: {f.registers} regs, {f.smem_bytes} B smem, {f.stack_frame_bytes} B stack{spill}")
        if self.serialized_wgmma:
            parts.append("WGMMAs SERIALIZED by ptxas")
        return "; ".join(parts) or "no entry functions"

    @classmethod
    def parse(cls, text: str) -> "PtxasReport":
        fields: Dict[str, dict] = {}
        entry: Optional[str] = None
        props_for: Optional[str] = None
        for line in text.splitlines():
            match = _ENTRY_RE.search(line)
            if match:
                entry = match.group(1)
                fields.setdefault(entry, {})["entry"] = True
                continue
            match = _PROPS_RE.search(line)
            if match:
                props_for = match.group(1)
                fields.setdefault(props_for, {})
                continue
            match = _FRAME_RE.search(line)
            if match and props_for is not None:
                stack, stores, loads = (int(g) for g in match.groups())
                fields[props_for].update(
                    stack_frame_bytes=stack, spill_stores_bytes=stores, spill_loads_bytes=loads
                )
                props_for = None
                continue
            match = _USED_RE.search(line)
            if match and entry is not None:
                entry_fields = fields[entry]
                entry_fields["registers"] = int(match.group(1))
                barriers = _BARRIERS_RE.search(line)
                if barriers:
                    entry_fields["barriers"] = int(barriers.group(1))
                smem = _SMEM_RE.search(line)
                if smem:
                    entry_fields["smem_bytes"] = int(smem.group(1))
        return cls({name: FunctionReport(**values) for name, values in fields.items()}, text)

    def to_dict(self) -> dict:
        return {"functions": {name: asdict(f) for name, f in self.functions.items()}, "raw": self.raw}

    @classmethod
    def from_dict(cls, data: dict) -> "PtxasReport":
        return cls(
            {name: FunctionReport(**values) for name, values in data["functions"].items()},
            data.get("raw", ""),
        )


@dataclass(frozen=True)
class BuiltKernel:
    name: str
    cubin_path: Path
    key: str
    report: PtxasReport
    from_cache: bool = False


def cache_dir() -> Path:
    """``$MEGAMOE_CACHE_DIR`` or ``~/.cache/megamoe/jit``."""
    configured = os.environ.get(ENV_CACHE_DIR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "megamoe" / "jit"


def find_nvcc() -> str:
    candidates = [os.environ.get(ENV_NVCC), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "nvcc"))
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise MegaMoEError(f"nvcc not found: set {ENV_NVCC}, put CUDA's bin directory on PATH, or set CUDA_HOME")


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    result = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    if result.returncode != 0:
        raise MegaMoEError(f"'{nvcc} --version' exited with {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def _file_digest(path: str) -> str:
    # Read every time: an mtime-keyed memo misses same-size edits within one timestamp tick.
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _headers(include_dir: str) -> List[Tuple[str, str]]:
    """(relative path, absolute path) of every header under ``include_dir``, sorted."""
    found = []
    for root, dirs, files in os.walk(include_dir):
        dirs.sort()
        for filename in files:
            if filename.endswith(HEADER_SUFFIXES):
                absolute = os.path.join(root, filename)
                found.append((os.path.relpath(absolute, include_dir).replace(os.sep, "/"), absolute))
    return sorted(found)


def variant_key(kernel: KernelSource, nvcc: Optional[str] = None) -> str:
    """sha256 over the source, every header under the include dirs, the flags and nvcc's version.

    Every ``*.cuh``/``*.h``/``*.hpp`` under each include dir counts, included or not: pass
    the project's own header trees, not system ones.
    """
    nvcc = nvcc or find_nvcc()
    digest = hashlib.sha256()

    def feed(tag: str, value: str) -> None:
        data = value.encode()
        digest.update(f"{tag}:{len(data)}:".encode())
        digest.update(data)

    feed("schema", KEY_SCHEMA)
    feed("source", kernel.source)
    for flag in BASE_FLAGS + kernel.flags:
        feed("flag", flag)
    feed("nvcc", nvcc_version(nvcc))
    for index, include_dir in enumerate(kernel.include_dirs):
        for relative, absolute in _headers(include_dir):
            feed("header", f"{index}/{relative}")
            feed("content", _file_digest(absolute))
    return digest.hexdigest()


def _nvcc_argv(nvcc: str, kernel: KernelSource, source_path: Path, output_path: Path) -> List[str]:
    argv = [nvcc, *BASE_FLAGS, *kernel.flags]
    for include_dir in kernel.include_dirs:
        argv.append(f"-I{os.path.abspath(include_dir)}")
    argv += [str(source_path), "-o", str(output_path)]
    return argv


def _write_atomic(path: Path, data: str) -> None:
    atomic_write(path, lambda temp: Path(temp).write_text(data), prefix=path.name + _TEMP_MARK)


def _is_cubin(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


class _Variant:
    """One requested variant and its place in the cache."""

    def __init__(self, kernel: KernelSource, key: str):
        self.kernel = kernel
        self.key = key
        self.directory = cache_dir() / f"{kernel.name}-{key[:16]}"
        self.cubin = self.directory / "kernel.cubin"
        self.report_json = self.directory / "report.json"
        self.lock_path = self.directory / ".lock"
        self.lock_file = None
        self.temp_cubin: Optional[Path] = None
        self.argv: List[str] = []
        self.failure_note = ""

    def finished(self) -> Optional[BuiltKernel]:
        if not _is_cubin(self.cubin):
            return None
        try:
            data = json.loads(self.report_json.read_text())
        except (OSError, ValueError):
            return None
        if data.get("key") != self.key:
            return None
        return BuiltKernel(self.kernel.name, self.cubin, self.key, PtxasReport.from_dict(data["report"]), True)

    def try_lock(self) -> bool:
        self.directory.mkdir(parents=True, exist_ok=True)
        lock_file = open(self.lock_path, "a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            return False
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        self.lock_file = lock_file
        return True

    def lock(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while not self.try_lock():
            if time.monotonic() >= deadline:
                holder = ""
                try:
                    holder = self.lock_path.read_text().strip()
                except OSError:
                    pass
                raise MegaMoETimeout(
                    f"timed out after {timeout_s:g} s waiting for the build lock {self.lock_path} of kernel "
                    f"variant '{self.kernel.name}': another process (pid {holder or 'unknown'}) is still "
                    f"compiling it; raise {ENV_LOCK_TIMEOUT} if its build is legitimately slow"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def unlock(self) -> None:
        if self.lock_file is not None:
            fcntl.flock(self.lock_file, fcntl.LOCK_UN)
            self.lock_file.close()
            self.lock_file = None

    def prepare(self, nvcc: str) -> None:
        """Under the lock: drop leftovers of killed builds, write the source, pick a temp output."""
        for leftover in self.directory.glob(f"*{_TEMP_MARK}*"):
            leftover.unlink(missing_ok=True)
        source_path = self.directory / "kernel.cu"
        _write_atomic(source_path, self.kernel.source)
        self.temp_cubin = self.directory / f"kernel.cubin{_TEMP_MARK}{os.getpid()}-{os.urandom(4).hex()}"
        self.argv = _nvcc_argv(nvcc, self.kernel, source_path, self.temp_cubin)

    @property
    def log_path(self) -> Path:
        assert self.temp_cubin is not None
        return Path(f"{self.temp_cubin}.log")

    def read_log(self) -> str:
        try:
            log = self.log_path.read_text(errors="replace")
        except OSError:
            log = ""
        return f"{log}\n{self.failure_note}" if self.failure_note else log

    def commit(self, nvcc: str) -> BuiltKernel:
        """Parse the log, write the report, then publish the cubin (the completion mark)."""
        assert self.temp_cubin is not None
        log = self.read_log()
        report = PtxasReport.parse(log)
        _write_atomic(self.directory / "ptxas.txt", log)
        _write_atomic(
            self.report_json,
            json.dumps(
                {
                    "name": self.kernel.name,
                    "key": self.key,
                    "command": shlex.join(self.argv),
                    "nvcc_version": nvcc_version(nvcc),
                    "headers": [
                        f"{index}/{relative}"
                        for index, include_dir in enumerate(self.kernel.include_dirs)
                        for relative, _ in _headers(include_dir)
                    ],
                    "report": report.to_dict(),
                },
                indent=1,
            ),
        )
        os.replace(self.temp_cubin, self.cubin)
        self.log_path.unlink(missing_ok=True)
        return BuiltKernel(self.kernel.name, self.cubin, self.key, report, False)

    def discard(self) -> None:
        if self.temp_cubin is not None:
            self.temp_cubin.unlink(missing_ok=True)
            self.log_path.unlink(missing_ok=True)


def _find_ninja() -> Optional[str]:
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja
    except ImportError:
        return None
    candidate = os.path.join(ninja.BIN_DIR, "ninja")
    return candidate if os.path.isfile(candidate) else None


def _ninja_path(path: Path) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _shell_command(variant: _Variant) -> str:
    """nvcc with its output (ptxas -v goes to stderr) captured per variant; no partial output on failure."""
    out = shlex.quote(str(variant.temp_cubin))
    log = shlex.quote(str(variant.log_path))
    return f"{shlex.join(variant.argv)} > {log} 2>&1 || (rm -f {out}; exit 1)"


def _compile_with_ninja(ninja: str, variants: List[_Variant], jobs: int, verbose: bool) -> str:
    build_dir = Path(tempfile.mkdtemp(prefix=".ninja-", dir=cache_dir()))
    try:
        lines = ["ninja_required_version = 1.3", "rule nvcc", "  command = $cmd", "  description = nvcc $name", ""]
        for variant in variants:
            lines += [
                f"build {_ninja_path(variant.temp_cubin)}: nvcc {_ninja_path(variant.directory / 'kernel.cu')}",
                f"  cmd = {_shell_command(variant).replace('$', '$$')}",
                f"  name = {variant.kernel.name}",
                "",
            ]
        (build_dir / "build.ninja").write_text("\n".join(lines))
        result = subprocess.run(
            [ninja, "-C", str(build_dir), "-j", str(jobs), "-k", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if verbose:
            sys.stderr.write(result.stdout)
        return result.stdout
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def _compile_one(variant: _Variant) -> None:
    assert variant.temp_cubin is not None
    with open(variant.log_path, "w") as log:
        result = subprocess.run(variant.argv, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        variant.temp_cubin.unlink(missing_ok=True)


def _compile(variants: List[_Variant], nvcc: str, jobs: int, verbose: bool) -> Tuple[List[BuiltKernel], List[_Variant], str]:
    """Compile the locked variants; commit the ones that succeeded, return the failures."""
    for variant in variants:
        variant.prepare(nvcc)
        if verbose:
            sys.stderr.write(f"jit: {shlex.join(variant.argv)}\n")
    ninja = _find_ninja() if len(variants) > 1 else None
    driver_output = ""
    if ninja is not None:
        driver_output = _compile_with_ninja(ninja, variants, jobs, verbose)
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(_compile_one, variants))
    built, failed = [], []
    for variant in variants:
        if variant.temp_cubin is None or not _is_cubin(variant.temp_cubin):
            failed.append(variant)
        elif variant_key(variant.kernel, nvcc) != variant.key:
            variant.failure_note = (
                "a header under the include dirs changed while this variant compiled, so the cubin may not "
                "match its key; it was not cached. Build again."
            )
            failed.append(variant)
        else:
            kernel = variant.commit(nvcc)
            if verbose:
                sys.stderr.write(f"jit: built {variant.cubin} ({kernel.report.summary()})\n")
            built.append(kernel)
    return built, failed, driver_output


def build(
    sources: Sequence[KernelSource],
    jobs: Optional[int] = None,
    verbose: bool = False,
    *,
    lock_timeout_s: Optional[float] = None,
) -> List[BuiltKernel]:
    """Return one ``BuiltKernel`` per source (same order), compiling only what the cache lacks.

    Missing variants compile in parallel (one ninja edge each, ``-j jobs``, default CPU
    count).  Variants another process is compiling are waited for (``lock_timeout_s``,
    default ``$MEGAMOE_JIT_LOCK_TIMEOUT`` or 1200 s) rather than compiled twice.
    """
    sources = list(sources)
    for source in sources:
        if not isinstance(source, KernelSource):
            raise MegaMoEError(f"build() takes KernelSource objects, got {type(source).__name__}")
    jobs = max(1, jobs or os.cpu_count() or 1)
    if lock_timeout_s is None:
        lock_timeout_s = float(os.environ.get(ENV_LOCK_TIMEOUT, DEFAULT_LOCK_TIMEOUT_S))
    nvcc = find_nvcc()
    cache_dir().mkdir(parents=True, exist_ok=True)

    variants: Dict[str, _Variant] = {}
    order: List[str] = []
    for source in sources:
        key = variant_key(source, nvcc)
        identity = f"{source.name}-{key}"
        variants.setdefault(identity, _Variant(source, key))
        order.append(identity)

    done: Dict[str, BuiltKernel] = {}
    for identity, variant in variants.items():
        hit = variant.finished()
        if hit is not None:
            done[identity] = hit
    pending = sorted(identity for identity in variants if identity not in done)
    if verbose:
        sys.stderr.write(f"jit: {len(variants)} variants, {len(variants) - len(pending)} cached\n")

    while pending:
        owned: List[str] = []
        for identity in pending:
            if variants[identity].try_lock():
                owned.append(identity)
        if not owned:
            # Everything left is being compiled elsewhere: wait in key order (no lock cycles).
            for identity in pending:
                variants[identity].lock(lock_timeout_s)
                owned.append(identity)
        try:
            to_compile = []
            for identity in owned:
                hit = variants[identity].finished()
                if hit is not None:
                    done[identity] = hit
                else:
                    to_compile.append(variants[identity])
            if to_compile:
                built, failed, driver_output = _compile(to_compile, nvcc, jobs, verbose)
                for kernel in built:
                    done[f"{kernel.name}-{kernel.key}"] = kernel
                if failed:
                    first = failed[0]
                    log = first.read_log() or driver_output
                    error = BuildError(
                        first.kernel.name, shlex.join(first.argv), log, [v.kernel.name for v in failed[1:]]
                    )
                    for variant in failed:
                        variant.discard()
                    raise error
        finally:
            for identity in owned:
                variants[identity].unlock()
        pending = [identity for identity in pending if identity not in done]

    return [done[identity] for identity in order]
