"""Build native/cuda/*.cu with nvcc into strata/_cuda_kernels.so (a plain shared library loaded by cffi in ABI mode),
with its C declarations (native/cuda/strata_cuda.h) copied beside it as strata/_cuda_kernels.h: what cffi reads.

Real machine code for sm_80, sm_86, sm_89, sm_90 and sm_120 (each only if this nvcc accepts it) plus PTX of the
newest accepted arch, so newer GPUs JIT-compile. Without nvcc this does nothing and succeeds: Strata then runs on
the CPU backend only. Usage: ``python native/build_cuda.py [--arch 90 ...] [--out PATH]``; setup.py calls
``build_cuda_kernels()``.
"""
from __future__ import annotations

import argparse
import os
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


def build_cuda_kernels(out: str | os.PathLike | None = None, archs: list[str] | None = None,
                       verbose: bool = True) -> str | None:
    """Compile the kernels; returns the .so path, or None when nvcc is absent (not an error).

    Raises RuntimeError (one line plus nvcc's output) if nvcc is present but compilation fails.
    """
    nvcc = find_nvcc()
    if nvcc is None:
        if verbose:
            print("build_cuda: nvcc not found; skipping the CUDA kernels (CPU backend only)")
        return None
    out = Path(out) if out else DEFAULT_OUT
    archs = archs or supported_archs(nvcc)
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
    return str(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="compute capability without dot, e.g. 90 (repeatable)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        p = build_cuda_kernels(a.out, a.arch)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    if p:
        print("build_cuda: wrote", p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
