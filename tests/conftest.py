"""Shared pytest setup: tests marked `gpu` are skipped unless the CUDA execution provider really works."""
from __future__ import annotations

import os

import pytest

# Emulated kernels built at -O1 (config.emu_opt_level): the tests' tensors are small, so the build is most of
# a kernel's cost, and the suite runs ~15% faster than at the users' -O2. Set in every xdist worker.
os.environ.setdefault("ORTFUSE_EMU_OPT", "1")

# Weights over 256 bytes (64 KiB for users) wait in the weight store while a model is optimized
# (rewriter.weights), so every rewrite the suite runs also runs on stubs. Set in every xdist worker.
from ortfuse.rewriter import weights as _weights  # noqa: E402
from helpers import cuda_ep_usable  # noqa: E402

_weights.STUB_BYTES = 256


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not cuda_ep_usable():
        skip = pytest.mark.skip(reason="needs a working CUDA execution provider")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def row_tiles_priced_by_the_tile_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row-wise GEMM epilogues priced by the tile model alone, as `--profile` plans them (it measures them
    instead of assuming `Target.row_epilogue_floor`). The kernel tests need those regions formed; the floor
    would send their GEMMs to cuBLAS."""
    import dataclasses

    from ortfuse.customops import target

    for cc, t in list(target.TABLE.items()):
        monkeypatch.setitem(target.TABLE, cc, dataclasses.replace(t, row_epilogue_floor=1.0))
