"""pytest configuration of the qbl PyTorch package's tests.

Run from the repository root after installing the package:

    pip install --no-build-isolation ./python
    QBL_REQUIRE_GPU=1 pytest python/tests        # on a GPU machine

(Run from the root, not from python/: there `import qbl` would find the source folder python/qbl,
which has no compiled extension.)

Every test needs a CUDA device. Without one the tests are skipped with the reason, unless the
environment variable QBL_REQUIRE_GPU=1 is set: then each test fails, so that a machine whose GPU
or driver is broken cannot pass the suite by skipping it. Likewise a test module whose `import
torch` / `import qbl` fails is skipped (helpers.import_or_skip), or fails to import under
QBL_REQUIRE_GPU=1.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# helpers.py, and examples/pytorch/reference.py: the reference Model / ModelSTE, one copy for the
# examples and the tests.
EXAMPLES = os.path.normpath(os.path.join(HERE, "..", "..", "examples", "pytorch"))
for path in (EXAMPLES, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

REQUIRE_GPU = os.environ.get("QBL_REQUIRE_GPU") == "1"

try:
    import torch
except Exception as e:  # noqa: BLE001 -- any import failure means: no usable torch
    torch = None
    _TORCH_ERROR = f"{type(e).__name__}: {e}"
else:
    _TORCH_ERROR = ""


def cuda_unavailable_reason() -> str:
    """Why the tests cannot run on a GPU here, or '' when they can."""
    if torch is None:
        return f"torch cannot be imported ({_TORCH_ERROR})"
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False"
    return ""


def pytest_report_header(config):
    why = cuda_unavailable_reason()
    lines = [f"qbl tests: QBL_REQUIRE_GPU={'1' if REQUIRE_GPU else 'unset'}"]
    if why:
        lines.append(f"qbl tests: {why}")
    else:
        try:
            name = torch.cuda.get_device_name(0)
        except Exception as e:  # noqa: BLE001 -- a broken device is reported by the tests
            name = f"unusable ({type(e).__name__}: {e})"
        lines.append(f"qbl tests: torch {torch.__version__}, CUDA {torch.version.cuda}, "
                     f"{torch.cuda.device_count()} device(s), device 0: {name}")
    return lines


def pytest_collection_modifyitems(config, items):
    why = cuda_unavailable_reason()
    if not why or REQUIRE_GPU:
        return  # runnable, or _require_gpu below fails each test
    skip = pytest.mark.skip(reason=f"{why} (set QBL_REQUIRE_GPU=1 to fail instead of skipping)")
    for item in items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _require_gpu():
    why = cuda_unavailable_reason()
    if why:
        if REQUIRE_GPU:
            pytest.fail(f"QBL_REQUIRE_GPU=1 but {why}", pytrace=False)
        pytest.skip(why)
    yield


@pytest.fixture(autouse=True)
def _exact_fp32_matmul_and_seed(_require_gpu):
    """Every test starts from torch.manual_seed(0) with PyTorch's default exact float32 matmul
    (no TF32), the precision the eager references assume; settings are restored afterwards. After
    the test the device is synchronized, so that an asynchronous CUDA error is reported by the
    test that caused it."""
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    try:
        yield
        torch.cuda.synchronize()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
