"""The GPU kernels run here on CPU tensors under Triton's interpreter, against the references."""

import os

# Read by triton when a kernel is defined: set before any helios.engine.cuda module is imported.
os.environ["TRITON_INTERPRET"] = "1"
