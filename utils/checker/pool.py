"""The shared models: the embedded tiny models (and any other model the tests build once, such as tests/support.py's
deep one), each made once per process and shared by every test session in it.

check() starts a fresh pytest session each time; keeping the model here spares it a reload. Its weights are
remembered when it is made, so that `restore()` can undo whatever a learner's code did to it (hooks left on, weights
written, gradients, flags, train mode). Only this module holds the models, by name: what is remembered about a model
(trace.reference_trace) is keyed by that name, never by `id()`, which a model made later could reuse.
"""

from __future__ import annotations

from collections.abc import Callable


class _Pool:
    def __init__(self):
        self.models: dict[str, object] = {}     # by load_model's name: "tiny", "tiny-llama"
        self.pristine: dict[str, list] = {}


_pool = _Pool()


def tiny_model(name: str = "tiny"):
    """An embedded model on CPU ("tiny": GPT-2-style, "tiny-llama": Llama-style), loaded on first use."""

    def load():
        from utils.models import load_model

        return load_model(name, device="cpu")

    return shared(name, load)


def shared(name: str, make: Callable[[], object]):
    """The model called `name`, made by `make()` the first time it is asked for, and put back as it was made at every
    restore()."""
    if name not in _pool.models:
        model = make()
        pristine = [(module, table, key, t, t.detach().clone(), t.requires_grad)
                    for module in model.modules() for table in ("_parameters", "_buffers")
                    for key, t in getattr(module, table).items() if t is not None]
        # The weights first: an interrupt while loading must leave no model behind without its saved weights.
        _pool.pristine[name] = pristine
        _pool.models[name] = model
    return _pool.models[name]


def name_of(model) -> str | None:
    """The name the pool holds `model` under, or None if it is not one of the shared models."""
    return next((name for name, held in _pool.models.items() if held is model), None)


def forget() -> None:
    """Drop the shared models (the next use loads them again): for tests of the checker that load it themselves."""
    _pool.models, _pool.pristine = {}, {}


def restore(name: str | None = None) -> None:
    """Put every shared model (or only the one called `name`) back as it was made: no hooks, the original weights,
    gradients and flags, eval mode, no attention pattern kept from the last forward pass."""
    for held, model in list(_pool.models.items()):
        if name is None or held == name:
            _restore(model, _pool.pristine[held])


def _restore(model, pristine: list) -> None:
    import torch

    # An interrupt can land inside TransformerLens's HookPoint.clear_context, between `del self.ctx` and
    # `self.ctx = {}`: that hook point has no ctx, and every later reset_hooks() would raise AttributeError
    for hook_point in model.hook_dict.values():
        if "ctx" not in vars(hook_point):
            hook_point.ctx = {}
    model.reset_hooks()
    for module in model.modules():  # the bridge's attention keeps its last pattern, with the graph of a pass with
        if isinstance(vars(module).get("_pattern"), torch.Tensor):  # autograd: no test may inherit it (it cannot be
            module._pattern = None                                   # deep-copied, and it holds that graph alive)
    with torch.no_grad():
        for module, table, name, tensor, saved, requires_grad in pristine:
            if getattr(module, table).get(name) is not tensor:  # replaced (module.weight = nn.Parameter(...))
                getattr(module, table)[name] = tensor
            if not torch.equal(tensor, saved):
                tensor.copy_(saved)
            if isinstance(tensor, torch.nn.Parameter):
                tensor.requires_grad_(requires_grad)
                tensor.grad = None
    # eval() walks every module (twice on the bridge, whose source model sits outside its tree) and costs half of a
    # restore; most tests leave the model in eval mode, which a scan of the flags tells for a twentieth of that
    trees = [model, getattr(model, "original_model", None)]
    if any(m.training for tree in trees if isinstance(tree, torch.nn.Module) for m in tree.modules()):
        model.eval()
