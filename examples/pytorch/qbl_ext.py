"""Build (just in time) and load the ``qbl_torch`` PyTorch extension.

    import qbl_ext
    ext = qbl_ext.load()                          # builds on first use, then cached
    y = ext.forward(x, logits, weight, bias)      # x [..., in] float32 CUDA, contiguous
    layer = ext.Layer(in_features, out_features, max_tokens)
    y = layer.forward(x, logits, weight, bias); m = layer.last_mixed(); s = layer.last_scale()

The extension is compiled from ``qbl_torch.cu`` against the library's headers in
``<repo>/include`` (no copy of any kernel) with ``torch.utils.cpp_extension.load``; the build
directory is ``examples/pytorch/build`` (git-ignored). A rebuild happens only when the source,
the headers it includes or the flags change.

Environment:
    QBL_TORCH_VERBOSE=1        show the compiler command lines and output
    QBL_TORCH_CXX_STD=c++20    force the C++ standard (default: c++17, see below)

C++ standard: the build uses ``-std=c++17`` (the library's own standard). Some torch / nvcc
combinations only compile torch's headers as C++20 (torch >= 2.13 requires it; nvcc 13.3
mis-parses torch's ATen/core/List_inl.h in C++17 mode). If the C++17 build fails, ``load()``
retries once with ``-std=c++20`` and remembers the standard that worked in
``build/cxx_std.txt``, so later processes try it first.
"""

from __future__ import annotations

import os
import pathlib
import threading
import warnings

HERE = pathlib.Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
SOURCE = HERE / "qbl_torch.cu"
INCLUDE_DIR = REPO_ROOT / "include"
BUILD_DIR = HERE / "build"
_STD_FILE = BUILD_DIR / "cxx_std.txt"

EXTENSION_NAME = "qbl_torch"
CUDA_ARCH_FLAGS = ["-gencode=arch=compute_90,code=sm_90"]  # H100 / H200

_lock = threading.Lock()
_module = None


def cuda_cflags(cxx_std: str = "c++17") -> list[str]:
    """nvcc flags of the build (arch flags given here stop torch from adding its own)."""
    return ["-O3", f"-std={cxx_std}", *CUDA_ARCH_FLAGS]


def _standards_to_try() -> list[str]:
    forced = os.environ.get("QBL_TORCH_CXX_STD")
    if forced:
        return [forced]
    order = ["c++17", "c++20"]
    try:
        remembered = _STD_FILE.read_text().strip()
    except OSError:
        remembered = ""
    if remembered in order:
        order.remove(remembered)
        order.insert(0, remembered)
    return order


def _build(verbose: bool):
    import torch
    from torch.utils.cpp_extension import load as cpp_load

    if not torch.cuda.is_available():
        raise RuntimeError("qbl_ext: the qbl_torch extension needs a CUDA device")
    if not SOURCE.is_file():
        raise FileNotFoundError(f"qbl_ext: missing {SOURCE}")
    if not (INCLUDE_DIR / "qbl" / "qbl.cuh").is_file():
        raise FileNotFoundError(f"qbl_ext: qbl headers not found under {INCLUDE_DIR}")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)

    failures = []
    standards = _standards_to_try()
    for i, std in enumerate(standards):
        try:
            module = cpp_load(
                name=EXTENSION_NAME,
                sources=[str(SOURCE)],
                extra_include_paths=[str(INCLUDE_DIR)],
                extra_cuda_cflags=cuda_cflags(std),
                extra_ldflags=["-lcublasLt"],
                build_directory=str(BUILD_DIR),
                verbose=verbose,
            )
        except (RuntimeError, OSError, ImportError) as e:  # compile / link / import failure
            failures.append((std, e))
            more = i + 1 < len(standards)
            warnings.warn(f"qbl_ext: building {EXTENSION_NAME} with -std={std} failed"
                          + (f"; retrying with -std={standards[i + 1]}" if more else ""),
                          RuntimeWarning, stacklevel=3)
            continue
        try:
            _STD_FILE.write_text(std + "\n")
        except OSError:
            pass
        # Make sure torch's own CUDA state (caching allocator, streams) is initialized before
        # the extension allocates from C++.
        torch.cuda.init()
        return module

    detail = "\n\n".join(f"--- -std={std} ---\n{e}" for std, e in failures)
    raise RuntimeError(f"qbl_ext: could not build the {EXTENSION_NAME} extension "
                       f"(set QBL_TORCH_VERBOSE=1 for the full compiler output):\n{detail}")


def load(verbose: bool | None = None):
    """Returns the compiled ``qbl_torch`` module, building it on first use (thread-safe)."""
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                if verbose is None:
                    verbose = os.environ.get("QBL_TORCH_VERBOSE", "0") not in ("", "0")
                _module = _build(verbose)
    return _module


def forward(x, logits, weight, bias=None, allow_tf32: bool = False):
    """Shortcut for ``load().forward(...)``."""
    return load().forward(x, logits, weight, bias, allow_tf32)
