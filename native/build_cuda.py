"""Build native/cuda/*.cu with nvcc into strata/_cuda_kernels.so (a plain shared library loaded by cffi in ABI mode),
with its C declarations (native/cuda/strata_cuda.h) copied beside it as strata/_cuda_kernels.h: what cffi reads.

Real machine code for sm_80, sm_86, sm_89, sm_90 and sm_120 (each only if this nvcc accepts it) plus PTX of the
newest accepted arch, so newer GPUs JIT-compile. Without nvcc this does nothing and succeeds: Strata then runs on
the CPU backend only. A build is kept with a stamp (the hash of native/cuda/, the nvcc version and the archs): an
unchanged tree is not compiled again. Usage: ``python native/build_cuda.py [--arch 90 ...] [--out PATH]
[--force]``, or ``--cupy-spec`` (the CuPy package that matches this machine's NVIDIA driver, or nothing without a
GPU); setup.py calls ``build_cuda_kernels(only_if_usable=True)``: only where a GPU is visible or STRATA_CUDA=1.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC_DIR = ROOT / "native" / "cuda"
DEFAULT_OUT = ROOT / "strata" / "_cuda_kernels.so"
WANTED_ARCHS = ("80", "86", "89", "90", "120")


def find_nvcc() -> str | None:
    """Path of nvcc ($NVCC, $CUDA_HOME/bin, PATH, /usr/local/cuda/bin), or None."""
    cands = [os.environ.get("NVCC")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "bin", "nvcc"))
    cands += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def supported_archs(nvcc: str) -> list[str]:
    """The WANTED_ARCHS this nvcc can target (from ``nvcc --list-gpu-arch``)."""
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ["80", "90"]
    have = {ln.strip().split("_", 1)[1] for ln in out.split() if ln.strip().startswith("compute_")}
    return [a for a in WANTED_ARCHS if a in have]


def gpu_visible() -> bool:
    """Whether this machine shows an NVIDIA GPU (the driver's device list, or a /dev/nvidiaN node)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True
    return any(re.fullmatch(r"nvidia\d+", p.name) for p in Path("/dev").glob("nvidia*"))


def driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the NVIDIA driver supports (from nvidia-smi), or None."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def cupy_spec() -> str | None:
    """The CuPy wheel for this machine's driver ('cupy-cuda12x' / 'cupy-cuda13x'), or None without a GPU."""
    if not gpu_visible():
        return None
    v = driver_cuda_version()
    if v is None or v[0] < 12:
        return None
    return f"cupy-cuda{min(v[0], 13)}x"


def source_stamp(nvcc: str, archs: list[str]) -> str:
    """What a build is made of: the sha256 of native/cuda/'s files, the nvcc version, the archs."""
    h = hashlib.sha256()
    for p in sorted(SRC_DIR.iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    try:
        h.update(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    except OSError:
        pass
    h.update(",".join(archs).encode())
    return h.hexdigest()


def build_cuda_kernels(out: str | os.PathLike | None = None, archs: list[str] | None = None,
                       verbose: bool = True, *, only_if_usable: bool = False, force: bool = False) -> str | None:
    """Compile the kernels; returns the .so path, or None when nvcc is absent or (only_if_usable) no GPU is
    visible and STRATA_CUDA=1 is not set (not an error). An existing build of the same sources, nvcc and archs is
    kept unless `force`.

    Raises RuntimeError (one line plus nvcc's output) if nvcc is present but compilation fails.
    """
    if only_if_usable and not gpu_visible() and os.environ.get("STRATA_CUDA") != "1":
        if verbose:
            print("build_cuda: no NVIDIA GPU visible; skipping the CUDA kernels (STRATA_CUDA=1 builds them anyway)")
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        if verbose:
            print("build_cuda: nvcc not found; skipping the CUDA kernels (CPU backend only)")
        return None
    out = Path(out) if out else DEFAULT_OUT
    archs = archs or supported_archs(nvcc)
    stamp_file = out.with_suffix(".stamp")
    stamp = source_stamp(nvcc, archs)
    if not force and out.is_file() and out.with_suffix(".h").is_file() and stamp_file.is_file() \
            and stamp_file.read_text().strip() == stamp:
        if verbose:
            print(f"build_cuda: {out} is up to date (same sources, nvcc and archs)")
        return str(out)
    srcs = sorted(str(p) for p in SRC_DIR.glob("*.cu"))
    gencode = []
    for a in archs:
        gencode += [f"-gencode=arch=compute_{a},code=sm_{a}"]
    gencode += [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    # --threads 0: the per-architecture compilations of each file run in parallel on every core (the decode
    # matvecs' template variants make matvec_fused.cu the long one)
    cmd = [nvcc, "-O3", "-std=c++17", "--shared", "-Xcompiler", "-fPIC", "-lineinfo", "--use_fast_math",
           "--threads", "0", "-I", str(SRC_DIR), *gencode, "-o", str(out), *srcs]
    if verbose:
        print("build_cuda:", " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"build_cuda: nvcc failed (exit {r.returncode})\n{r.stdout}{r.stderr}")
    shutil.copyfile(SRC_DIR / "strata_cuda.h", out.with_suffix(".h"))   # the declarations of this very build
    stamp_file.write_text(stamp + "\n")
    return str(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="compute capability without dot, e.g. 90 (repeatable)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--force", action="store_true", help="compile even when the build is up to date")
    ap.add_argument("--cupy-spec", action="store_true",
                    help="print the CuPy package matching this machine's NVIDIA driver (nothing without a GPU)")
    a = ap.parse_args(argv)
    if a.cupy_spec:
        spec = cupy_spec()
        if spec:
            print(spec)
        return 0
    try:
        p = build_cuda_kernels(a.out, a.arch, force=a.force)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    if p:
        print("build_cuda: wrote", p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
