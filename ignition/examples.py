"""The example inputs and caches that the step programs are traced (torch.export) and compiled
(AOTInductor) with, and their dynamic shapes: sizes chosen so that no named dim specializes."""

from __future__ import annotations

import torch

from helios.core import manifest as mf
from helios.core.program import allocate_kv


def cache_and_input_shapes(kv: mf.KvLayout, inputs: tuple[mf.TensorSpec, ...]) -> tuple:
    """Dynamic shapes of the cache list (pages, then state slots) and of each program input (named dims)."""
    dims: dict[str, object] = {}
    Dim = torch.export.Dim
    for name in ("T", "B", "M", "R", "K", "P", "S", "I"):
        dims[name] = Dim(name, min=1)
    dims["B+1"] = dims["B"] + 1
    shapes: list[object] = [[{0: dims["P"]}] * kv.num_caches + [{0: dims["S"]}] * len(kv.state_shapes())]
    for spec in inputs:
        shapes.append({i: dims[d] for i, d in enumerate(spec.shape) if isinstance(d, str)})
    return tuple(shapes)


def example_inputs(
    inputs: tuple[mf.TensorSpec, ...], vocab: int, page_tokens: int, extra: dict[str, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Two sequences (3 + 2 tokens) over 4 pages; sizes >= 2 so no dim specializes. `extra`:
    examples of inputs only a family's own programs take (5 rows where a dim is T)."""
    examples = (extra or {}) | {
        "token_ids": torch.tensor([1, 2, 3, 4, 5]) % vocab,
        "positions": torch.tensor([0, 1, 2, 0, 1]),
        "slot_mapping": torch.tensor([0, 1, 2, 2 * page_tokens, 2 * page_tokens + 1]),
        "block_tables": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        "seq_lens": torch.tensor([3, 2], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 3, 5], dtype=torch.int32),
        "logits_indices": torch.tensor([2, 4]),
        "state_slots": torch.tensor([2, 0]),  # of EXAMPLE_SLOTS
        "window_slot_mapping": torch.tensor([0, 1, 2, 2 * page_tokens, 2 * page_tokens + 1]),
        "window_block_tables": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        "attention_until": torch.tensor([0, 2, 2, 0, 1]),  # rows 1-2: an image's tokens see each other
        "logprob_token_ids": torch.tensor([[0, 1, 2], [3, 4, 5]]) % vocab,
        "target_ids": torch.tensor([2, 3, -1, 5, -1]) % vocab,
    }
    return [examples[spec.name] for spec in inputs]


EXAMPLE_SLOTS = 3  # state slots of the tracing example (not 2: B is 2, and the dims must stay apart)


def example_caches(kv: mf.KvLayout, page_tokens: int) -> list[torch.Tensor]:
    return allocate_kv(kv, 4, page_tokens, num_slots=EXAMPLE_SLOTS)
