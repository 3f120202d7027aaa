"""helios' CPU kernels for the flare:: ops (the core's reference kernels are correct but slow).

One module per op family; `registry.register()` installs them all into the dispatcher. What
several families share lives in `memo` (a value computed once per step) and `plan` (the paged
attention layout of a step). Each module imports what it uses directly, so no order matters.
"""
