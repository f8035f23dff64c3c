"""pytest configuration of the qbl PyTorch package's tests.

Run from the repository root after installing the package:

    pip install --no-build-isolation ./python
    pytest python/tests                          # every device present: the CPU, and CUDA
    QBL_REQUIRE_GPU=1 pytest python/tests        # on a GPU machine: fail where CUDA is unusable

(Run from the root, not from python/: there `import qbl` would find the source folder python/qbl,
which has no compiled extension.)

The tests run on every device they can, as torchvision's operator tests do: a test that takes the
`device` fixture runs once on the CPU and once on CUDA (ids `cpu` and `cuda`); what is CUDA's
alone (graphs, streams, the caching allocator, out-of-memory, the layer cache, parity between the
CPU and CUDA) is marked `cuda`. Without a usable CUDA device the `cuda` tests are skipped with the
reason ("needs CUDA: ..."), unless QBL_REQUIRE_GPU=1 is set: then each fails, so that a machine
whose GPU or driver is broken cannot pass the suite by skipping it. Everything else runs on the CPU
on every machine. The multi-rank tests (test_distributed.py) spawn real processes.
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

import torch  # noqa: E402

REQUIRE_GPU = os.environ.get("QBL_REQUIRE_GPU") == "1"


def cuda_unavailable_reason() -> str:
    """Why the CUDA tests cannot run here, or '' when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False"
    return ""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA device (skipped without one, fails under QBL_REQUIRE_GPU=1)")


def pytest_report_header(config):
    why = cuda_unavailable_reason()
    lines = [f"qbl tests: QBL_REQUIRE_GPU={'1' if REQUIRE_GPU else 'unset'}, torch "
             f"{torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
             f"{torch.get_num_threads()} CPU threads"]
    if why:
        lines.append(f"qbl tests: CPU only -- {why}")
    else:
        try:
            name = torch.cuda.get_device_name(0)
        except Exception as e:  # noqa: BLE001 -- a broken device is reported by the tests
            name = f"unusable ({type(e).__name__}: {e})"
        lines.append(f"qbl tests: CUDA {torch.version.cuda}, {torch.cuda.device_count()} "
                     f"device(s), device 0: {name}")
    return lines


def pytest_collection_modifyitems(config, items):
    why = cuda_unavailable_reason()
    if not why or REQUIRE_GPU:
        return  # runnable, or _require_cuda below fails each CUDA test
    skip = pytest.mark.skip(
        reason=f"needs CUDA: {why} (set QBL_REQUIRE_GPU=1 to fail instead of skipping)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _require_cuda(request):
    if request.node.get_closest_marker("cuda") is not None:
        why = cuda_unavailable_reason()
        if why:
            if REQUIRE_GPU:
                pytest.fail(f"QBL_REQUIRE_GPU=1 but {why}", pytrace=False)
            pytest.skip(f"needs CUDA: {why}")
    yield


#: The devices a test taking `device` runs on: the CPU always, CUDA where there is one.
DEVICE_PARAMS = [pytest.param("cpu", id="cpu"),
                 pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=DEVICE_PARAMS)
def device(request) -> torch.device:
    """The device of the test: torch.device("cpu"), or the current CUDA device."""
    if request.param == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def cuda_device() -> torch.device:
    """The current CUDA device, for tests marked `cuda`."""
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(autouse=True)
def _exact_fp32_matmul_and_seed(_require_cuda):
    """Every test starts from torch.manual_seed(0) with PyTorch's default exact float32 matmul
    (no TF32), the precision the eager references assume; settings are restored afterwards. After
    the test a CUDA device in use is synchronized, so that an asynchronous CUDA error is reported
    by the test that caused it."""
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    try:
        yield
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
