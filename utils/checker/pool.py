"""The shared model: the embedded tiny model, loaded once per process and shared by every test session in it.

check() starts a fresh pytest session each time; keeping the model here spares it a reload. Its weights are
remembered when it loads, so that `restore()` can undo whatever a learner's code did to it (hooks left on, weights
written, gradients, flags, train mode). Only this module holds the model.
"""

from __future__ import annotations


class _Pool:
    def __init__(self):
        self.model = None
        self.pristine: list | None = None


_pool = _Pool()


def tiny_model():
    """The embedded model on CPU, loaded on first use."""
    if _pool.model is None:
        from utils.models import load_model

        model = load_model("tiny", device="cpu")
        pristine = [(module, table, name, t, t.detach().clone(), t.requires_grad)
                    for module in model.modules() for table in ("_parameters", "_buffers")
                    for name, t in getattr(module, table).items() if t is not None]
        # Both at once: an interrupt while loading must leave no model behind without its saved weights.
        _pool.model, _pool.pristine = model, pristine
    return _pool.model


def is_loaded() -> bool:
    return _pool.model is not None


def forget() -> None:
    """Drop the shared model (the next use loads it again): for tests of the checker that load it themselves."""
    _pool.model = _pool.pristine = None


def restore() -> None:
    """Put the shared model back as it was loaded: no hooks, the original weights, gradients and flags, eval mode, no
    attention pattern kept from the last forward pass."""
    model = _pool.model
    if model is None:
        return
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
        for module, table, name, tensor, saved, requires_grad in _pool.pristine:
            if getattr(module, table).get(name) is not tensor:  # replaced (module.weight = nn.Parameter(...))
                getattr(module, table)[name] = tensor
            if not torch.equal(tensor, saved):
                tensor.copy_(saved)
            if isinstance(tensor, torch.nn.Parameter):
                tensor.requires_grad_(requires_grad)
                tensor.grad = None
    model.eval()
