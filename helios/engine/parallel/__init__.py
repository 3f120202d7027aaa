"""Tensor- and expert-parallel serving over torch.distributed (docs/parallel.md).

`world` joins the ranks (rendezvous, identity check, the process group with its collective deadline)
and carries rank 0's commands; `proxy` is rank 0's executor, which sends each device-touching call to
the other ranks before running it; `worker` is every other rank's loop; `launch` starts the local
worker processes and stops them.
"""
