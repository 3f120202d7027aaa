"""Every registered family's contract (ignition.models.family.Family) is complete and consistent,
and its tiny test checkpoint's config builds into tensors that its own maps cover. Cheap checks:
the per-family test files export and compare against transformers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ignition.models import FAMILIES, family_of_gguf, family_of_hf_config
from ignition.models.family import Family
from ignition.models.naming import rename
from ignition.testmodel import CHATS, build_tokenizer

NAMES = sorted(FAMILIES)
MODELS = Path(__file__).resolve().parents[2] / "ignition" / "models"


@pytest.fixture(params=NAMES)
def fam(request) -> Family:
    return FAMILIES[request.param]


def _tiny_config(fam: Family) -> dict:
    specials = CHATS[fam.tiny.chat]["special_tokens"] if fam.tiny.chat else fam.tiny.special_tokens
    return fam.tiny.config(build_tokenizer(specials).get_vocab_size())


def test_family_names_the_hf_configs_it_reads(fam: Family) -> None:
    assert fam.hf_architectures and fam.hf_model_types
    hf = _tiny_config(fam)
    assert family_of_hf_config(hf) == fam.name
    assert set(hf.get("architectures") or ()) <= set(fam.hf_architectures)


def test_chat_flavour_or_own_tokens(fam: Family) -> None:
    """A family's test checkpoint has a chat flavour, or carries its own tokens, roles and template."""
    tiny = fam.tiny
    if tiny.chat is not None:
        assert tiny.chat in CHATS
        assert not tiny.special_tokens and not tiny.token_roles and tiny.chat_template is None
    else:
        assert tiny.special_tokens and tiny.chat_template
        assert set(tiny.token_roles.values()) <= set(tiny.special_tokens)


def test_vision_hooks_come_with_a_reference_and_a_test_checkpoint(fam: Family) -> None:
    assert (fam.vision is None) == (fam.reference.features is None) == (fam.tiny.vision is None)
    if fam.tiny.vision is not None:
        chat = CHATS[fam.tiny.vision.chat]
        assert set(fam.tiny.vision.tokens) <= set(chat["special_tokens"])
        assert fam.tiny.vision.processor


def test_gguf_reader_is_complete(fam: Family) -> None:
    if fam.gguf is None:
        return
    assert fam.gguf.architectures and fam.gguf.weight_map
    assert all(family_of_gguf(arch) == fam.name for arch in fam.gguf.architectures)


def test_tiny_checkpoint_builds_and_its_weights_map_and_fuse(fam: Family) -> None:
    """The test config parses, its tensors all have internal names, and every fused and stacked group
    names tensors the weight map produces."""
    config = fam.config_from_hf(_tiny_config(fam))
    shapes = fam.tiny.hf_shapes(config)
    assert shapes and all(all(d > 0 for d in shape) for shape in shapes.values())
    internal = set()
    for name in shapes:
        if fam.ignored_tensor is not None and fam.ignored_tensor(config, name):
            continue
        mapped = rename(name, fam.weight_map)
        assert mapped is not None, f"{fam.name}: test tensor {name!r} has no internal name"
        internal.add(mapped[0])
    for fused, parts in fam.fused.items():
        assert "{}" in fused and all("{}" in p for p in parts), fused
    layers, kv_heads, head_dim = fam.kv_shape(config)
    assert layers >= 1 and kv_heads >= 1 and head_dim >= 1
    if fam.tiny.init is not None:
        generator = torch.Generator().manual_seed(0)
        for name, shape in shapes.items():
            tensor = fam.tiny.init(name, shape, generator)
            assert tensor is None or tuple(tensor.shape) == shape, name


def test_optional_cache_hooks_describe_this_config(fam: Family) -> None:
    config = fam.config_from_hf(_tiny_config(fam))
    for extra in fam.extra_caches(config) if fam.extra_caches else ():
        name, layers, *_ = extra  # layers may count past the main ones (MiMo's MTP layers' caches)
        assert isinstance(name, str) and layers and all(layer >= 0 for layer in layers)
    for state in fam.state_caches(config) if fam.state_caches else ():
        name, layers, shape, dtype = state
        assert isinstance(name, str) and layers and all(d > 0 for d in shape) and dtype
    pooled = fam.window_pool(config) if fam.window_pool else None
    if pooled is not None:
        window, caches = pooled
        assert window > 0 and caches and list(caches) == sorted(set(caches)) and caches[0] >= 0


def test_step_program_builds(fam: Family) -> None:
    config = fam.config_from_hf(_tiny_config(fam))
    assert isinstance(fam.step_program(config, 2, True, scored=False), torch.nn.Module)


def test_registry_names_are_unique_and_match_the_family_values() -> None:
    assert all(name == fam.name for name, fam in FAMILIES.items())
    archs = [a for fam in FAMILIES.values() for a in fam.hf_architectures]
    assert len(archs) == len(set(archs))


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("reference", sorted(p.stem for p in MODELS.glob("*_reference.py")))
def test_a_reference_does_not_import_its_family_module(reference: str) -> None:
    """X_reference.py is what X.py's Family points at; it reads X's config module, never X back."""
    family_module = f"ignition.models.{reference.removesuffix('_reference')}"
    assert family_module not in _imports(MODELS / f"{reference}.py")


@pytest.mark.parametrize(
    "reader", ["export.py", "testmodel.py", "models/__init__.py", "sources/gguf_source.py", "sources/hf_source.py"]
)
def test_readers_of_families_probe_nothing(reader: str) -> None:
    """The modules that use families read Family fields: no getattr/hasattr probes on a module or a config."""
    tree = ast.parse((MODELS.parent / reader).read_text(encoding="utf-8"))
    probes = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
    ]
    assert probes == []
