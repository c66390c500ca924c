"""Builds and loads Kettle's CPU kernels (the C files of this folder): at install time, else the first time a
process needs them.

The shared library is compiled with the machine's C compiler into a folder `cpu-<key>`, keyed by the source, the
flags and the compiler, so later processes only load it (~1 ms). `scripts/install.sh` (the install of `make
serve`, `make test` and the container image) builds it into the environment, `<sys.prefix>/share/kettle/kernels/`
(`python -m kettle.kernels.build`), as a package with a C extension compiles it when installed: a first start
then waits only for the model's preparation. Where that folder lacks the key (a plain `pip install`, sources
edited since, `KETTLE_TUNING=installed-kernels=off`), the first process builds it into
`$KETTLE_CACHE/kernels/`. The flags name no `-march`: the library runs on any AVX2 CPU and picks its AVX-512 paths
at run time, so one built into an image on one machine serves on another. It links the OpenMP runtime PyTorch loaded
(`libgomp.so.1`, same soname) so its parallel loops share PyTorch's threads instead of starting a second pool that
would fight it for the cores.

`KETTLE_TUNING=cpu-kernels=off` turns the kernels off (PyTorch's own ops are used instead). Without a compiler, or on a
CPU without AVX2/FMA/F16C, `library()` returns None and the same PyTorch ops are used, with one warning.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from kettle import settings
from kettle.hub.cache import build_once, cache_root
from kettle.kernels import isa

FOLDER = Path(__file__).parent
SOURCES = tuple(
    FOLDER / name
    for name in (
        "cpu_kernels.c",
        "decoder_step.c",
        "gemm.c",
        "lanes.c",
        "lanes_avx2.c",
        "linear.c",
        "weight_types.c",
        "gguf_pack.c",
        "prefill_attention.c",
        "decode_attention.c",
    )
)
HEADERS = (
    FOLDER / "kernels.h",
    FOLDER / "avx2_forms.h",
    FOLDER / "lanes_avx2_tiles.h",
    FOLDER / "int_panels_avx2.h",
    FOLDER / "avx512_emulation.h",
)
LIBRARY = "libkettle_cpu.so"
# Where the install puts the library (`install`): inside the environment, so it goes with it (a venv removed, an
# image layer) and never mixes with another environment's build of other sources.
INSTALLED = Path(sys.prefix) / "share" / "kettle" / "kernels"
# -ffp-contract=off: a multiply and an add the source writes apart stay two roundings wherever the compiler inlines
# them (gcc's ISO C mode already does so; clang's default would fuse some): kernels written to one row's arithmetic
# (weight_types.c's `invariant_rows`) then compute its bits, not a contraction that one inlining chose.
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# `KETTLE_TUNING=emulate-avx512=on` (tests): the AVX-512 paths in SIMDe's portable intrinsics, taken on any CPU
# (kernels.h); a build of its own, never the installed one.
EMULATED_AVX512 = "-DEMULATE_AVX512"
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
OFF_SWITCH = "cpu-kernels=off"  # the KETTLE_TUNING item that turns the kernels off (kettle.settings)
COMPILER_NICE = 10  # the compilers' niceness (see `_lower_priority`)
log = logging.getLogger(__name__)
# The compilers running now, each the leader of its own process group (the driver and its cc1/as): a process that
# exits while they run (a launcher stopping on a bad model before the build is done) kills them on its way out
# instead of leaving them to finish in the background, holding its caller's output pipes open for seconds.
_running: set[subprocess.Popen] = set()
# Held while a compiler starts and while the exit kills them: the build's thread goes on during the interpreter's
# exit, and a compiler it started after the kill ran on (seen on a loaded machine). Once `_exiting`, a thread that
# would start one waits for the process's end instead (an exception there would print its traceback on the way out).
_starting = threading.Lock()
_exiting = False

_int, _ptr, _i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# The library's entry points (structs by pointer: kettle/kernels/structs.py, decoder_step.py) and their results.
SIGNATURES = {
    # weight, x, ldx, rows, y (NULL: return the path), ldy, path (or PATH_DECODE_ROWS / PATH_PROMPT_ROWS), tuning,
    # threads -> status, or the path
    "kettle_linear": ([_ptr, _ptr, _int, _int, _ptr, _int, _i32, _ptr, _i32], _i32),
    # weight, source GGUF type, blocks, row bytes, order (NULL: as stored), threads -> status
    "kettle_pack": ([_ptr, _i32, _ptr, _int, _ptr, _i32], _i32),
    # weight, ids (NULL: every row), count, out, threads
    "kettle_dequantize": ([_ptr, _ptr, _int, _ptr, _i32], None),
    # op, x, ldx, a, b, rows, width, heads, eps, out, out2, threads
    "kettle_rows": ([_i32, _ptr, _int, _ptr, _ptr, _int, _int, _int, ctypes.c_float, _ptr, _ptr, _i32], None),
    # attention, threads -> status
    "kettle_attention": ([_ptr, _i32], _i32),
    # k_new, ld_k, v_new, ld_v, slots, tokens, width, k_cache, v_cache, kv_dtype, threads
    "kettle_cache_write": ([_ptr, _int, _ptr, _int, _ptr, _int, _int, _ptr, _ptr, _i32, _i32], None),
    # model, k_caches, v_caches, embedded, rows, cos, sin, slots, tables, max_blocks, positions, out, threads, loras,
    # lora_slot -> status
    "kettle_decoder_step": (
        [_ptr, _ptr, _ptr, _ptr, _int, _ptr, _ptr, _ptr, _ptr, _int, _ptr, _ptr, _i32, _ptr, _ptr],
        _i32,
    ),
    # model, k_caches, v_caches, embedding, head, tokens, rows, steps, cos, sin, slots, tables, max_blocks, positions,
    # stop_ids, stops, ids, logprobs, threads -> the steps run
    "kettle_greedy_steps": (
        [
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _int,
            _int,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _int,
            _ptr,
            _ptr,
            _int,
            _ptr,
            _ptr,
            _i32,
        ],
        _i32,
    ),
}


def enabled() -> bool:
    """False when switched off (`KETTLE_TUNING=cpu-kernels=off`)."""
    return settings.current().cpu_kernels


def built_folder() -> Path | None:
    """The folder of the compiled library: the install's build, else the cache's, compiled first if missing; None
    when switched off or it cannot be built here (with one warning). Torch-free: the launcher calls it to build
    beside the model's preparation."""
    if not enabled():
        return None
    target = _target()
    if target is None:
        return None
    compiler, name = target
    installed = INSTALLED / name
    if settings.current().installed_kernels and (installed / LIBRARY).is_file():
        return installed
    try:
        return build_once(cache_root() / "kernels" / name, _compiler(compiler), "the CPU kernels")
    except (OSError, subprocess.CalledProcessError) as error:
        log.warning("CPU kernels failed to build (%s): using PyTorch's kernels", error)
        return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built first if needed; None when switched off or it cannot be built here."""
    folder = built_folder()
    if folder is None:
        return None
    try:
        lib = ctypes.CDLL(str(folder / LIBRARY))
    except OSError as error:
        log.warning("CPU kernels failed to load (%s): using PyTorch's kernels", error)
        return None
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    isa.restrict(lib, settings.current().cpu_isa)  # before anything asks which paths run
    runs = isa.describe(lib)
    log.info(
        "CPU kernels: %s%s",
        runs,
        " (emulated)" if runs.startswith("AVX-512") and settings.current().emulate_avx512 else "",
    )
    return lib


def instructions() -> str | None:
    """What the loaded library runs (`isa.describe`: "AVX-512 VNNI", "AVX2", ...), for /info and the benchmarks; None
    without the library."""
    lib = library()
    return isa.describe(lib) if lib is not None else None


def _target() -> tuple[str, str] | None:
    """The C compiler's path and the build's folder name (`cpu-<key>`); None, with one warning, where there is no
    compiler or the CPU lacks what the kernels need."""
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in isa.cpu_flags()]
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if missing or compiler is None:
        log.warning("CPU kernels unavailable (%s): using PyTorch's kernels", missing or "no C compiler")
        return None
    return compiler, f"cpu-{_key(compiler)}"


def _compiler(compiler: str):
    def build(out: Path) -> None:
        # One compiler per source, all at once, then the link: a first start waits for this build, and the sources
        # compiled one after another kept a core idle (11.5 s in one process against ~6 s on 2 cores here).
        compile_flags = [flag for flag in _flags() if flag != "-shared"]
        objects = [out / f"{source.stem}.o" for source in SOURCES]
        jobs = [
            _start([compiler, *compile_flags, "-c", str(source), "-o", str(obj)])
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        finished = [(job, _wait(job)) for job in jobs]  # every job waited for, failed or not
        for job, errors in finished:
            if job.returncode:
                raise subprocess.CalledProcessError(job.returncode, job.args, stderr=errors)
        link = [compiler, *_flags(), *map(str, objects), "-o", str(out / LIBRARY), "-lm"]
        job = _start(link)
        errors = _wait(job)
        if job.returncode:
            raise subprocess.CalledProcessError(job.returncode, link, stderr=errors)
        for obj in objects:
            obj.unlink()

    return build


def _start(command: list[str]) -> subprocess.Popen:
    """A compiler started at low priority as its own process group's leader, tracked until `_wait` has it."""
    with _starting:
        if not _exiting:
            job = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                process_group=0,
                preexec_fn=_lower_priority,
                text=True,
            )
            _running.add(job)
            return job
    threading.Event().wait()  # the process is exiting (`_stop_compilers`): this thread ends with it
    raise AssertionError("unreachable")


def _wait(job: subprocess.Popen) -> str:
    """The job's error output, once it has finished."""
    try:
        return job.communicate()[1]
    finally:
        _running.discard(job)


@atexit.register
def _stop_compilers() -> None:
    global _exiting
    with _starting:
        _exiting = True
        for job in list(_running):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)


def _lower_priority() -> None:
    """In each compiler, before it starts: a first start builds the kernels beside the model's preparation (a GGUF's
    config and tokenizer), one process against five compilers on the same cores. At the same priority the
    compilers took 5/6 of the CPU and the preparation, the longer of the two, finished last; below it, the
    preparation keeps a core and the compilers share what is left (docs/deployment.md)."""
    os.nice(COMPILER_NICE)


def _flags() -> tuple[str, ...]:
    return (*FLAGS, EMULATED_AVX512) if settings.current().emulate_avx512 else FLAGS


def _key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    sources = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(sources + " ".join(_flags()).encode() + version.encode())
    return digest.hexdigest()[:12]


def install(root: Path | None = None) -> Path | None:
    """Builds the library into `root` (default: the environment's share/kettle/kernels) unless it is there; the
    folder, or None (with the reason logged) where this machine cannot build it. Older keys' folders there are
    removed: they belong to sources this environment no longer has."""
    target = _target()
    if target is None:
        return None
    compiler, name = target
    root = root or INSTALLED
    if root.is_dir():
        for old in root.iterdir():
            if old.name.startswith("cpu-") and old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    try:
        return build_once(root / name, _compiler(compiler), "the CPU kernels")
    except (OSError, subprocess.CalledProcessError) as error:
        log.warning("CPU kernels failed to build (%s): the server will try again on its first start", error)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = install()
    print(f"Kettle's CPU kernels: {folder or 'not built (the server builds them on first start if it can)'}")
