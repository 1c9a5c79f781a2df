import os
from collections import Counter

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before
# triton is first imported, which any test module may do.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist runs one worker per core: each takes one thread, since OpenMP threads of two
# processes sharing the cores spin waiting for each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# A decode step's quantization compiles once per shape and spec (kvpass.cpu_steps): hundreds of
# shapes here would each pay seconds. tests/test_cpu_steps.py turns it on and checks it against
# the eager reference this suite checks everything else against.
from kvpass import cpu_steps, packed  # noqa: E402

cpu_steps.enabled = False


@pytest.fixture(autouse=True)
def _fallback_warned_afresh(monkeypatch):
    # The dequantizing fallback warns once a process for each op it runs: a test that checks no such
    # warning came must not pass because an earlier test in its worker had it.
    monkeypatch.setattr(packed, "fallback_ops", Counter())


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    # A test's unseeded draws (torch.randn without a generator) must not hang on which tests ran
    # before it in its worker: pytest-xdist hands tests out as workers free up, and an fp32 test's
    # random offset once decided whether it failed (docs/design.md, the rotation). As PyTorch's own
    # TestCase does, every test starts from one seed.
    torch.manual_seed(0)
