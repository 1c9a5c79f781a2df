import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before
# triton is first imported, which any test module may do.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist runs one worker per core: each takes one thread, since OpenMP threads of two
# processes sharing the cores spin waiting for each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
