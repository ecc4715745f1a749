"""Putting one module in another's place: the emulated formats' rounding modules, torchao's MX Linears, evaluation in
full precision, and unit scaling's and u-μP's modules (which rule applies there depends on where a module sits, which
the replacement function reads from the module's name or identity).

A swapped-in module of a related class keeps the old one's state (`with_state_of`): the same parameter and buffer
tensors (an optimiser, a tie or a checkpoint's keys still find them), submodules, hooks and training mode. Nothing
reassigns an existing object's `__class__`.
"""

from __future__ import annotations

from typing import Callable

from torch import nn


def with_state_of(cls: type, module: nn.Module) -> nn.Module:
    """A new `cls` module holding `module`'s attributes: its parameters, buffers and submodules (the same tensors
    and objects, in copies of their containers), its hooks, its training mode. `cls` must take the same attributes
    (a subclass of the module's class, or the class it subclasses)."""
    new = cls.__new__(cls)
    # nn.Module keeps parameters, buffers, submodules and hooks in dicts and sets: copied, so that the two modules
    # never share a container (the tensors and objects in them are shared)
    new.__dict__.update({key: type(value)(value) if isinstance(value, (dict, set)) else value
                         for key, value in module.__dict__.items()})
    return new


def swap_modules(model: nn.Module, replacement: Callable[[str, nn.Module], nn.Module | None]) -> dict[str, nn.Module]:
    """Put `replacement(name, module)` in the place of every submodule of `model` for which it returns a module
    (`name` as `model.named_modules()` gives it), top-down, without descending into a swapped-in one. Returns
    {name: the module it replaced}, which `restore` puts back."""
    replaced = {}

    def visit(parent: nn.Module, prefix: str) -> None:
        for attribute, child in list(parent.named_children()):
            name = f"{prefix}{attribute}"
            new = replacement(name, child)
            if new is None:
                visit(child, f"{name}.")
            elif new is not child:
                setattr(parent, attribute, new)
                replaced[name] = child

    visit(model, "")
    return replaced


def swapped(model: nn.Module, replacement: Callable[[str, nn.Module], nn.Module | None]) -> nn.Module:
    """`swap_modules` over `model`, the model itself included (named ""): the model to use from now on, which is a
    new object where `replacement` replaced the model itself (a bare Linear)."""
    root = replacement("", model)
    if root is not None:
        return root
    swap_modules(model, replacement)
    return model


def restore(model: nn.Module, replaced: dict[str, nn.Module]) -> None:
    """Put back the modules `swap_modules` replaced."""
    for name, module in replaced.items():
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, module)


def tied_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Every parameter held by more than one module, as its (module name, attribute) owners."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules():
        for attribute, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module_name, attribute))
    return [o for o in owners.values() if len(o) > 1]


def retie(model: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """Make each group of owners `tied_parameters` found share its first owner's parameter again (after a swap or
    a move to another kind of device gave them parameters of their own)."""
    for owners in ties:
        shared = getattr(model.get_submodule(owners[0][0]), owners[0][1])
        for module_name, attribute in owners[1:]:
            setattr(model.get_submodule(module_name), attribute, shared)
