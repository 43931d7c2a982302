"""Test set-up: on a machine without CUDA, Triton kernels run under its interpreter on CPU
tensors (TRITON_INTERPRET must be set before triton compiles anything); GPU-marked tests skip."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_interp = pytest.mark.skip(reason="runs Triton on CPU tensors: needs TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interp" in item.keywords and not INTERPRET:
            item.add_marker(skip_interp)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """Byte-level shards of ~2 MB of the Python standard library, prepared once per test session
    and shared read-only by the training tests."""
    from moefp8.data import prepare

    d = tmp_path_factory.mktemp("data") / "stdlib"
    prepare("stdlib", str(d), max_bytes=2_000_000)
    return str(d)
