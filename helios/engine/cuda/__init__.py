"""helios' GPU kernels for the flare:: ops, written in Triton.

One module per op family, each with a `register(library)` that puts its kernels in the
dispatcher's CUDA slot (`registry.register()` installs them all, once per process, when the
engine runs on a CUDA device). Every kernel is capturable: sequence lengths, page tables and
plans arrive as device tensors and nothing reads a tensor's value on the host during a step.

The kernels are checked on CPU: under Triton's interpreter (`TRITON_INTERPRET=1`) they run on
CPU tensors, and tests/cuda compares each one with the core's pure-torch reference
(helios.core.ops) on random pages. Triton is imported only here, so a CPU server never needs it.
"""
