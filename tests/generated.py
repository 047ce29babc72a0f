"""Inputs drawn from each exercise's contract, compared with the reference: the checks that a fixed list of inputs
cannot make.

The value tests call an exercise at a few fixed sizes, in float32, with moderate values; the battery (battery.py)
adds the classes of mistakes a signature shows. Mistakes that no fixed input shows live at the contract's edges, and
this module draws inputs there, with hypothesis, for every exercise whose arguments it can make from their
annotations (battery.call_of):

    sizes       every named dimension of the annotations from 1 up (`.squeeze()` on a batch of one row, a group
                of one, a completion of one token)
    magnitudes  logits 1000 apart (a softmax whose smallest probabilities underflow to 0 in float32), log-probs
                far below 0, ratios on the clip bounds, rewards all equal, masks empty, full or ragged
    dtypes      float32, float64 and bfloat16 (where the reference runs in it): the result must keep the inputs'
                dtype and device wherever the reference's does; values are compared in float32 and float64, and in
                bfloat16 (8 bits of mantissa) only where the learner's are NaN and the reference's are not
    domain      every class of value a setting's contract names (each member of a `one_of`, None, 0, the bounds)
                and values outside it: where the reference refuses an input, the learner's version must refuse it
                with the same exception; where the reference returns, so must the learner's

Each exercise's test draws a fixed, bounded set of examples (derandomized: the same examples on every run, no
example database written anywhere), and on a difference hypothesis shrinks it to the smallest input that shows it,
which the message describes in words ("with batch = 1; float64 inputs: ..."). Only the shrunk example's
observations are kept for the mistake's fingerprint (observe.py).

Then, for an exercise that runs the model (drawn 10 times, not 100), every class of every setting for certain: the
first example's draws (hypothesis's simplest: the defaults and the smallest sizes) are replayed once for each other
value that each setting's draw offered, that value in place of the drawn one (`_edges`).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import dis
import inspect
import math
import os
import re
import textwrap
import typing

import torch
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis.control import current_build_context
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure, Unsatisfiable, UnsatisfiedAssumption
from torch import Tensor

from tests.battery import VALUES, _reference_of, _shape, _tensor_type
from utils.checker import observe as observing
from utils.checker.compare import CheckFailure, add_finding, aside, bare_failures, refusal_left_out, show
from utils.checker.departure import dtype_where, raised_at
from utils.checker.properties import aliases, assert_inputs_unchanged, assert_no_aliases, assert_outputs_match

# Examples drawn per exercise: about 0.2-1 s per exercise on the tiny tensors drawn here; a tenth of them with the
# embedded model (a forward pass or more each). RLHF_DRAWN_EXAMPLES changes the number only for the checker's own tests
# (tests/checker/conftest.py), which test what check() does with a run, not how far the draws reach; never a learner's.
EXAMPLES = int(os.environ.get("RLHF_DRAWN_EXAMPLES", "100"))
EXAMPLES_WITH_MODEL = max(1, EXAMPLES // 10)

# Sizes a named dimension takes, smallest first (hypothesis shrinks towards the first); `batch` also takes sizes
# that groups of 2 and 3 divide.
SIZES = {"batch": (1, 2, 3, 4, 6), "vocab": (1, 2, 3, 11), "seq": (1, 2, 3, 7)}
OTHER_SIZES = (1, 2, 3, 5)

# Exercises whose arguments could be drawn but are not, and why.
NOT_DRAWN = {"two_token_logprobs": "without first_tokens it runs the model on every token of the vocabulary (about 1 s "
                                   "a call here); its value tests take both paths"}

# The devices tensors are drawn on: the GPU too where there is one (no test skips for want of one: it is drawn or not).
DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, print_blob=False,
                    report_multiple_bugs=False, phases=(Phase.explicit, Phase.generate, Phase.shrink),
                    suppress_health_check=list(HealthCheck))


# --- what an exercise's arguments are -----------------------------------------------------------------------------

def _choices(rule) -> tuple | None:
    """The members of a `one_of` rule ("one of 'k1', 'k2', 'k3'"), or None for another rule."""
    text = getattr(rule, "text", "")
    match = re.fullmatch(r"(?:None or )?one of (.+)", text)
    if not match:
        return None
    try:
        return tuple(ast.literal_eval(f"({match.group(1)},)"))
    except (ValueError, SyntaxError):
        return None


def _log_prob_like(name: str) -> bool:
    return "logp" in name or "logprob" in name or name in ("first", "second", "ref_first", "ref_second")


def compared_constants(function) -> dict[str, list]:
    """{parameter: the constants the function's own source compares it with} (`scale == "group"`, `kind in ("k1",
    "k2")`, `n > 0`): the values at which the reference takes another branch, read from the reference itself."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    except (OSError, TypeError, SyntaxError):
        return {}
    namespace = getattr(inspect.unwrap(function), "__globals__", {})
    found: dict[str, list] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = [s.id if isinstance(s, ast.Name) else s.attr for s in sides if isinstance(s, (ast.Name, ast.Attribute))]
        for side in sides:
            values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if isinstance(side, ast.Name) and isinstance(namespace.get(side.id), (tuple, list, frozenset, set)):
                values = [ast.Constant(v) for v in namespace[side.id]]  # a named constant: LORA_SYNCS
            for v in values:
                if isinstance(v, ast.Constant) and v.value is not None and not isinstance(v.value, bool):
                    for n in names:
                        if v.value not in found.setdefault(n, []):
                            found[n].append(v.value)
    return found


class Spec:
    """How to draw the arguments of one exercise: each parameter's annotation, default and rule, and the constants
    its reference branches on."""

    def __init__(self, reference, name: str):
        self.reference, self.name = reference, name
        self.signature = inspect.signature(reference, eval_str=True)
        self.rules = getattr(reference, "contract", {}) or {}
        self.params = list(self.signature.parameters.values())
        self.branches = compared_constants(reference)
        self.dims: list[str] = []
        for p in self.params:
            kind = _tensor_type(p.annotation)
            for dim in (kind.dim_str.split() if kind is not None else ()):
                dim = dim.lstrip("*")
                if not dim.isdigit() and dim not in self.dims:
                    self.dims.append(dim)
        self.kinds = {p.name: _kind_of(p, self.rules.get(p.name)) for p in self.params}
        self.has_floats = any(_tensor_type(p.annotation) is not None
                              and "float32" in set(_tensor_type(p.annotation).dtypes) for p in self.params) or bool(
            {"loras", "module_adapters"} & set(self.kinds.values()))  # adapters' parameters are floats too
        self.keys = _string_constants(reference)


def _string_constants(function) -> list[str]:
    """The strings of the module-level tuples and lists of strings the function's own body names (QKV = ("q", "k",
    "v")): the keys a dict argument of it may hold."""
    try:
        code = inspect.unwrap(function).__code__
    except AttributeError:
        return []
    namespace = inspect.unwrap(function).__globals__
    found: list[str] = []
    for name in code.co_names:
        value = namespace.get(name)
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, str) for v in value):
            found += [v for v in value if v not in found]
    return found


def _settings_class(annotation) -> bool:
    """A dataclass of settings: every field a number, a string or a flag (not Samples, which holds tensors)."""
    return dataclasses.is_dataclass(annotation) and all(
        f.type in (bool, str, int, float, "bool", "str", "int", "float")
        for f in dataclasses.fields(annotation) if f.init)


def _kind_of(p: inspect.Parameter, rule) -> str | None:
    """How a parameter is drawn: "tensor", "config" (a dataclass: each field drawn), "model" (the embedded model),
    "head" (a Linear on its residual stream), "strings", "value" (a number, string or flag), or None: not drawn."""
    if _tensor_type(p.annotation) is not None:
        return "tensor"
    if _settings_class(p.annotation):
        return "config"
    if p.name == "model" and p.annotation is inspect.Parameter.empty:
        return "model"
    if p.name == "lora_model":
        return "lora_model"
    if p.name == "old_adapters":
        return "adapters"
    if typing.get_origin(p.annotation) is dict and getattr(typing.get_args(p.annotation)[-1], "__name__", "") == "LoRA":
        return "loras"  # {key: LoRA}: adapters made here, in the drawn dtype
    if p.name == "adapters" and p.annotation is torch.nn.ModuleDict:
        return "module_adapters"  # make_adapters' ModuleDict of the embedded model, in the drawn dtype
    if getattr(p.annotation, "__name__", None) == "Samples":
        return "samples"
    if p.annotation is torch.nn.Linear:
        return "head"
    if p.default is inspect.Parameter.empty and isinstance(VALUES.get(p.name), list):
        return "strings"
    if p.default is not inspect.Parameter.empty or p.name in VALUES or p.name == "group_size" or _choices(rule):
        return "value" if p.name != "generator" else "generator"
    return None


def drawable(part: str) -> list[str]:
    """The exercises of `part` whose every argument can be drawn, and whose result can be compared item by item."""
    from utils.checker.layout import exercise_names

    names = []
    for name in exercise_names(part):
        reference = _reference_of(part, name)
        if inspect.isclass(reference):
            continue
        spec = Spec(reference, name)
        ret = spec.signature.return_annotation
        if ret in (inspect.Parameter.empty, None, "None") or any(w in str(ret) for w in ("Callable", "Module", "LoRA")):
            continue
        if {"model", "module_adapters"} <= set(spec.kinds.values()):
            continue  # adapters made on the shared model, with the model: what it does to the model is for its tests
        if all(spec.kinds.values()) and name not in NOT_DRAWN:
            names.append(name)
    return names


class Case:
    """One drawn input: the arguments, and the words that describe what is unusual about it."""

    def __init__(self, astray: str | None = None):
        self.arguments: dict[str, object] = {}
        self.words: list[str] = []
        self.astray = astray  # the one setting that may take a value outside its domain in this case (None: none)

    def describe(self) -> str:
        return "; ".join(self.words) if self.words else "the usual sizes"


def _mask(data, shape: tuple[int, ...], g: torch.Generator, name: str, case: Case) -> Tensor:
    mode = data.draw(st.sampled_from(("ended", "full", "empty", "one row empty", "random", "one True")),
                     label=f"{name} mask")
    if mode == "full":
        mask = torch.ones(shape, dtype=torch.bool)
    elif mode == "one True":  # a single counted token in the whole mask: a count that is exactly 1
        mask = torch.zeros(shape, dtype=torch.bool)
        if mask.numel():
            mask.view(-1)[int(torch.randint(0, mask.numel(), (), generator=g))] = True
    elif mode == "empty":
        mask = torch.zeros(shape, dtype=torch.bool)
    elif mode == "random":
        mask = torch.rand(shape, generator=g) < 0.5
    else:  # True up to each row's first EOS, at a random length (0 to the whole row)
        lengths = torch.randint(0, shape[-1] + 1, shape[:-1], generator=g)
        mask = torch.arange(shape[-1]) < lengths[..., None]
        if mode == "one row empty" and shape[0] > 0:
            mask[0] = False
    if mode != "ended":
        said = {"full": "True everywhere", "empty": "all False",
                "one True": "True at one position only"}.get(mode, mode)
        case.words.append(f"`{name}` {said}")
    return mask


def _floats(data, name: str, shape: tuple[int, ...], g: torch.Generator, case: Case, drawn: dict) -> Tensor:
    """A float tensor for the argument `name`, in float64 (cast to the drawn dtype later): its range from its name,
    its magnitude drawn up to the edges the contract allows."""
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if _log_prob_like(name):
        main = drawn.get("log-probs")
        if main is not None and main.shape == shape:
            relation = data.draw(st.sampled_from(("independent", "equal", "on a clip bound", "close")),
                                 label=f"{name} relation")
            if relation == "equal":
                case.words.append(f"`{name}` equal to `{drawn['log-probs name']}`")
                return main.clone()
            if relation == "on a clip bound":  # ratio exp(main - this) at 1 ± 0.2, give or take 1e-6
                sign = torch.where(torch.rand(shape, generator=g) < 0.5, 1.0, -1.0).double()
                case.words.append(f"`{drawn['log-probs name']}` - `{name}` on log(1 ± 0.2)")
                return main - torch.log1p(sign * 0.2) + 1e-6 * x
            if relation == "close":
                return main + 0.05 * x
        scale = data.draw(st.sampled_from((1.0, 30.0, 300.0)), label=f"{name} scale")
        value = -(torch.rand(shape, generator=g, dtype=torch.float64) * 2 + 0.05) * scale
        if scale > 1 and value.numel():
            case.words.append(f"`{name}` down to {value.min().item():.0f}")
        if main is None:
            drawn["log-probs"], drawn["log-probs name"] = value, name
        return value
    if "ratio" in name or "weights" in name:
        mode = data.draw(st.sampled_from(("spread", "on the clip bounds", "extreme")), label=f"{name} mode")
        if mode == "on the clip bounds":
            case.words.append(f"`{name}` on 1 ± 0.2")
            return 1 + 0.2 * torch.sign(x) + 1e-6 * torch.randn(shape, generator=g, dtype=torch.float64)
        if mode == "extreme":
            case.words.append(f"`{name}` from e^-20 to e^20")
            return torch.exp(20 * torch.tanh(x))
        return torch.exp(0.3 * x)
    if name == "probs":  # a distribution over the batch's completions
        return torch.softmax(2 * x.reshape(-1), 0).reshape(shape)
    if "reward" in name:
        mode = data.draw(st.sampled_from(("spread", "all equal", "0 or 1", "large", "one NaN", "one inf")),
                         label=f"{name} mode")
        if mode in ("one NaN", "one inf"):  # an unscorable or unbounded reward: kept out, or refused
            case.words.append(f"`{name}` with a {mode[4:]} first")
            return torch.cat([torch.tensor([math.nan if mode == "one NaN" else math.inf]).double(), x.flatten()[1:]]
                             ).reshape(shape)
        if mode == "all equal":
            case.words.append(f"every `{name}` equal")
            return torch.full(shape, 0.7, dtype=torch.float64)
        if mode == "0 or 1":
            case.words.append(f"`{name}` 0 or 1")
            return (x > 0).double()
        if mode == "large":
            case.words.append(f"`{name}` scaled by 1e4")
            return 1e4 * x
        return x
    if "advantage" in name:
        if data.draw(st.booleans(), label=f"{name} zero"):
            case.words.append(f"`{name}` all 0")
            return torch.zeros(shape, dtype=torch.float64)
        return x
    if "logits" in name or "scores" in name:
        scale = data.draw(st.sampled_from((2.0, 30.0, 1000.0)), label=f"{name} scale")
        value = scale * x
        if scale > 2 and value.numel():  # said as measured on the drawn values
            largest = f"`{name}` up to {value.abs().max().item():.0f} in magnitude"
            underflow = "logits" in name and bool((value.float().softmax(-1) == 0).any())
            case.words.append(largest + (" (some probabilities underflow to 0 in float32)" if underflow else ""))
        return value
    scale = data.draw(st.sampled_from((1.0, 1000.0)), label=f"{name} scale")
    if scale > 1:
        case.words.append(f"`{name}` scaled by {scale:g}")
    return scale * x


def _tensor(data, name: str, kind, shape, g, case: Case, drawn: dict, sizes: dict[str, int]) -> Tensor:
    dtypes = set(kind.dtypes)
    if dtypes <= {"bool", "bool_"}:
        if "mask" in name:
            return _mask(data, shape, g, name, case)
        return torch.rand(shape, generator=g) < 0.5
    if "float32" not in dtypes:  # whole numbers: token ids, or an attention mask (1 on real tokens, left padding)
        if "mask" in name:  # 1 on real tokens: prompts padded on the left, completions on the right
            mode = data.draw(st.sampled_from(("left", "both sides", "one row all padding")), label=f"{name} mask")
            left = torch.randint(0, shape[-1], shape[:-1], generator=g)
            right = torch.randint(0, shape[-1], shape[:-1], generator=g) if mode != "left" else shape[-1]
            positions = torch.arange(shape[-1])
            last = torch.maximum(left, torch.as_tensor(right))
            mask = (positions >= left[..., None]) & (positions <= last[..., None])
            if mode == "one row all padding":
                mask[0] = False
            if mode != "left":
                said = f"padded on {mode}" if mode == "both sides" else f"{mode} in row 0"
                case.words.append(f"`{name}` {said}")
            return mask.long()
        return torch.randint(0, sizes.get("vocab", 11), shape, generator=g)
    return _floats(data, name, shape, g, case, drawn)


def _number(data, pname: str, p: inspect.Parameter, rule, case: Case, branches: list):
    """A value for a number, string or flag, from every class its contract, default and the reference's branches
    name: the default, the members of a `one_of`, the strings the reference compares it with, None, 0 and the
    edges, and values outside the contract (which the reference refuses)."""
    default = p.default
    choices = _choices(rule)
    strings = [b for b in branches if isinstance(b, str)]
    if choices is None and (isinstance(default, str) or strings):
        choices = tuple(dict.fromkeys(([default] if isinstance(default, str) else []) + strings))
    if choices is not None:
        takes_none = default is None or "None" in str(p.annotation)
        options = list(choices) + ["not one of them"] + ([None] if takes_none else [])
        if default in choices:
            options.remove(default)
            options.insert(0, default)
        value = data.draw(st.sampled_from(options), label=pname)
    elif isinstance(default, bool):
        value = data.draw(st.sampled_from((default, not default)), label=pname)
    elif pname in ("group_size",):
        value = None  # drawn with the sizes (a divisor of batch, or not)
    elif default is inspect.Parameter.empty and pname in VALUES and not isinstance(VALUES[pname], (int, float)):
        return VALUES[pname]
    else:
        base = default if default is not inspect.Parameter.empty else VALUES.get(pname)
        options = [base]
        if base is None:  # None, or a number: 0 too, which `x or default` would take for None
            options += [0 if "int" in str(p.annotation) else 0.0, 0.05, 0.2, 1, 3]
        elif isinstance(base, bool) or not isinstance(base, (int, float)):
            return base
        elif isinstance(base, int):
            options += [0, 1, 2, base + 3] + ([-1] if case.astray == pname else [])
        else:
            options += [0.0, 1.0, 0.5 * base, 3.0 * base, 1e-8] + ([-0.5] if case.astray == pname else [])
        value = data.draw(st.sampled_from(options), label=pname)
    same = isinstance(value, float) and isinstance(default, float) and math.isclose(value, default)
    if value != default and not same:
        case.words.append(f"{pname}={value!r}")
    return value


# --- drawing a case -----------------------------------------------------------------------------------------------

def _draw_case(data, spec: Spec, dtypes: tuple[torch.dtype, ...]) -> Case:
    # at most one setting strays outside its domain per case: the others' combinations, the paths to each refusal
    # among them, are then drawn far more often than if every setting could stray at once
    settings_ = [p.name for p in spec.params if spec.kinds[p.name] == "value"]
    case = Case(data.draw(st.sampled_from([None, *settings_]), label="astray"))
    sizes = {dim: data.draw(st.sampled_from(SIZES.get(dim, OTHER_SIZES)), label=dim) for dim in spec.dims}
    star = tuple(data.draw(st.lists(st.sampled_from(OTHER_SIZES), min_size=0, max_size=2), label="*shape")) \
        if "shape" in sizes or "rest" in sizes else ()
    ones = [dim for dim in spec.dims if sizes.get(dim) == 1 and dim not in ("shape", "rest")]
    if ones:
        case.words.append(", ".join(f"{dim} = 1" for dim in ones))
    if star:
        case.words.append(f"*shape = {list(star)}")
    dtype = data.draw(st.sampled_from(dtypes), label="dtype") if spec.has_floats else torch.float32
    if dtype != torch.float32:
        case.words.append(f"{str(dtype).replace('torch.', '')} inputs")
    uses_model = bool({"model", "lora_model", "samples"} & set(spec.kinds.values()))
    device = data.draw(st.sampled_from(DEVICES), label="device") if not uses_model else "cpu"
    if device != "cpu":
        case.words.append(f"inputs on {device}")
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    g = torch.Generator().manual_seed(seed)
    drawn: dict = {}
    seq = sizes.get("seq")
    for p in spec.params:
        pname, rule = p.name, spec.rules.get(p.name)
        kind = _tensor_type(p.annotation)
        if kind is not None:
            optional = p.default is not inspect.Parameter.empty or type(None) in getattr(p.annotation, "__args__", ())
            if optional and data.draw(st.booleans(), label=f"{pname} is None"):
                case.arguments[pname] = None
                case.words.append(f"{pname}=None")
                continue
            shape = _shape(kind.dim_str, sizes, star)
            tensor = _tensor(data, pname, kind, shape, g, case, drawn, sizes)
            case.arguments[pname] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).to(device)
        elif spec.kinds[pname] == "config":
            case.arguments[pname] = _config(data, p.annotation, spec.branches, case)
        elif spec.kinds[pname] == "model":
            case.arguments[pname] = _model()
        elif spec.kinds[pname] == "lora_model":  # or the bare model, which a LoRA model is not
            bare = data.draw(st.sampled_from((False, True)), label=f"{pname} bare")
            case.arguments[pname] = _model() if bare else _lora_model()
            if bare:
                case.words.append(f"the bare model as `{pname}`")
        elif spec.kinds[pname] == "adapters":
            from tests.support import adapters_with_random_B

            case.arguments[pname] = adapters_with_random_B(_model(), seed=1, seed_A=1)
        elif spec.kinds[pname] == "loras":
            case.arguments[pname] = _loras(data, spec.keys, g, case, dtype)
        elif spec.kinds[pname] == "module_adapters":
            case.arguments[pname] = _module_adapters(data, seed, case, dtype)
        elif spec.kinds[pname] == "samples":
            case.arguments[pname] = _samples(data, g, case)
        elif spec.kinds[pname] == "head":
            model = _model()
            head = torch.nn.Linear(model.cfg.d_model, 1)
            with torch.no_grad():
                head.weight.copy_(torch.randn(head.weight.shape, generator=g) * model.cfg.d_model ** -0.5)
                head.bias.fill_(0.1)
            case.arguments[pname] = head
        elif pname == "group_size":
            batch = sizes.get("batch", 4)
            divisors = [d for d in range(1, batch + 1) if batch % d == 0]
            value = data.draw(st.sampled_from(divisors[1:] + divisors[:1] + [batch + 1]), label=pname)
            case.arguments[pname] = value
            case.words.append(f"group_size={value}")
        elif pname in ("prefix_len", "prompt_len") and seq is not None:
            value = data.draw(st.sampled_from(sorted({min(2, seq), 1, seq - 1, seq, 0, seq + 1})), label=pname)
            case.arguments[pname] = value
            case.words.append(f"{pname}={value}")
        elif pname == "generator":
            case.arguments[pname] = torch.Generator().manual_seed(seed)
        elif p.default is inspect.Parameter.empty and pname in VALUES and isinstance(VALUES[pname], list):
            case.arguments[pname] = _strings(data, pname, sizes, case)
        else:
            case.arguments[pname] = _number(data, pname, p, rule, case, spec.branches.get(pname, []))
    return case


def _loras(data, keys: list[str], g: torch.Generator, case: Case, dtype: torch.dtype) -> dict:
    """{key: LoRA}: a nonempty subset of `keys` (in their order, each with its own rank and alpha), or, as a branch of
    the input domain, one key outside them too; d_in and d_out those of a small block, B drawn (not LoRA's 0)."""
    from solutions.part2_lora import LoRA

    keys = keys or ["a", "b"]
    chosen = [k for k in keys if data.draw(st.booleans(), label=f"key {k}")] or keys[:1]
    if data.draw(st.integers(0, 4), label="a key outside") == 0:
        chosen.append("o" if "o" not in keys else "extra")
        case.words.append(f"the keys {chosen}")
    adapters = {}
    for key in chosen:
        rank = data.draw(st.sampled_from((2, 1, 3)), label=f"rank of {key}")
        alpha = data.draw(st.sampled_from((4.0, 1.0, 6.0)), label=f"alpha of {key}")
        if rank == 1:
            case.words.append(f"rank 1 for {key}")
        lora = LoRA(8, 12, rank, alpha)
        with torch.no_grad():
            lora.A.copy_(torch.randn(lora.A.shape, generator=g))
            lora.B.copy_(torch.randn(lora.B.shape, generator=g))
        adapters[key] = lora.to(dtype)
    return adapters


def _module_adapters(data, seed: int, case: Case, dtype: torch.dtype):
    """make_adapters' ModuleDict on the embedded model (some of its targets, a drawn rank), with B drawn."""
    from tests.support import adapters_with_random_B

    targets = data.draw(st.sampled_from((("q", "v"), ("o",), ("q", "k", "v", "o"))), label="targets")
    rank = data.draw(st.sampled_from((2, 1)), label="rank")
    if rank == 1:
        case.words.append("adapters of rank 1")
    return adapters_with_random_B(_model(), seed=seed, seed_A=seed, rank=rank, targets=targets).to(dtype)


def _model():
    from utils.checker.pool import tiny_model

    return tiny_model("tiny")


def _lora_model():
    """A LoRA model on the embedded model whose adapters have a random B (a policy that differs from its reference)."""
    global _LORA
    if _LORA is None or _LORA.base is not _model():
        from tests.support import lora_model_with_random_B

        _LORA = lora_model_with_random_B(_model(), seed=0, seed_A=0)
    return _LORA


_LORA = None


def _samples(data, g: torch.Generator, case: Case):
    """Samples as `sample` makes them: prompts left-padded, completions cut at their first EOS (or truncated), at
    every size from one row, one prompt token and one completion token up."""
    from utils.sampling import Samples, completion_mask_from_ids

    model = _model()
    eos = model.tokenizer.eos_token_id
    batch = data.draw(st.sampled_from((1, 2, 4)), label="batch")
    prompt_len = data.draw(st.sampled_from((1, 2, 4)), label="prompt length")
    gen = data.draw(st.sampled_from((1, 2, 5)), label="gen")
    ending = data.draw(st.sampled_from(("EOS somewhere", "no EOS (truncated)", "EOS first")), label="EOS")
    words = [f"{k} = 1" for k, v in (("batch", batch), ("prompt length", prompt_len), ("gen", gen)) if v == 1]
    case.words += words + ([f"completions with {ending}"] if ending != "EOS somewhere" else [])
    pads = torch.randint(0, prompt_len, (batch,), generator=g)  # each prompt keeps at least one real token
    prompt_attn = (torch.arange(prompt_len) >= pads[:, None]).long()
    prompt = torch.where(prompt_attn.bool(), torch.randint(0, eos, (batch, prompt_len), generator=g), eos)
    completion = torch.randint(0, eos, (batch, gen), generator=g)
    if ending == "EOS first":
        completion[:, 0] = eos
    elif ending == "EOS somewhere":
        at = torch.randint(0, gen, (batch,), generator=g)
        completion[torch.arange(batch), at] = eos
        completion = torch.where(torch.arange(gen) > at[:, None], eos, completion)
    cmask = completion_mask_from_ids(completion, eos)
    return Samples(ids=torch.cat([prompt, completion], 1), attention_mask=torch.cat([prompt_attn, cmask.long()], 1),
                   completion_mask=cmask, prompt_len=prompt_len, prompts=[""] * batch, texts=[""] * batch, eos_id=eos)


def _config(data, cls, branches: dict[str, list], case: Case):
    """A config whose every field is drawn from its default, the constants the reference compares it with, and the
    edges of its type; a config that refuses its own fields (its __post_init__) is not drawn."""
    fields = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        seen = branches.get(f.name, [])
        if isinstance(default, bool) or f.type in (bool, "bool"):
            options = [bool(default), not default]
        elif isinstance(default, str) or f.type in (str, "str"):
            options = list(dict.fromkeys([default, *[b for b in seen if isinstance(b, str)], "not one of them"]))
        elif isinstance(default, (int, float)) or f.type in (int, float, "int", "float"):
            whole = isinstance(default, int) or f.type in (int, "int")
            base = default if default is not None else (1 if whole else 0.1)
            options = list(dict.fromkeys([base, *[b for b in seen if isinstance(b, (int, float))],
                                          *((0, 1, 2, -1) if whole else (0.0, 0.5, 1.0, 1.5, -0.5))]))
        else:
            continue  # a field of another type keeps its default
        value = data.draw(st.sampled_from(options), label=f.name)
        fields[f.name] = value
        if value != default:
            case.words.append(f"{f.name}={value!r}")
    try:
        return cls(**fields)
    except (ValueError, TypeError):
        reject()


# Strings of every form the string exercises meet: answers, other numbers, words, nothing.
FORMS = ("12", " 46", "46 ", "-3", "007", "4.0", "1e2", "", " ", "abc", "The cat. Is happy.", "good good.",
         "a sad, bad day", "12+34=46", "46.", "٤٦", "46\n47", "x46")
PROMPTS = ("12+34=", "1+1=", "7+8=", "0+0=", "99+99=", "Hello", "", "12+34", "3 + 4 =")
# ... and "a+b=" prompts with at most one thing changed, so that each variation is tried on an otherwise valid
# prompt: whitespace before or after it, a sign, an operand that is no whole number, another operator, spaces around
# "+", "=" moved, doubled or missing, something after it. Operands 12 and 34 make 46, one of the FORMS.
OPERANDS = ("12", "34", "0", "007", "99")
PROMPT_FORMS = ("{a}+{b}=", " {a}+{b}=", "\n{a}+{b}=", "{a}+{b}= ", "{a}+{b}=\n", "{a}+{b}=X", "{a}+{b}=?",
                "-{a}+{b}=", "{a}+-{b}=", "{a}+1.5=", "{a}+x=", "{a} + {b}=", "{a}-{b}=", "{a}*{b}=", "{a}+{b} =",
                "{a}+{b}", "{a}+{b}==")
PROMPT = st.one_of(st.sampled_from(PROMPTS),
                   st.builds(str.format, st.sampled_from(PROMPT_FORMS), a=st.sampled_from(OPERANDS),
                             b=st.sampled_from(OPERANDS)))


def _strings(data, pname: str, sizes: dict[str, int], case: Case) -> list[str]:
    """A list of strings; lists of one case have one length (the batch's), but that one list may be one longer."""
    if "strings" not in sizes:
        sizes["strings"] = sizes.get("batch", data.draw(st.sampled_from((1, 2, 4)), label="strings"))
    n = sizes["strings"] + data.draw(st.sampled_from((0, 0, 0, 1)), label=f"{pname} longer")
    one = PROMPT if "prompt" in pname else st.sampled_from(FORMS)
    values = data.draw(st.lists(one, min_size=n, max_size=n), label=pname)
    case.words.append(f"{pname}={values!r}")
    return values


# --- every value of every setting, once -----------------------------------------------------------------------

class _Recorded:
    """hypothesis's `data`, keeping each draw: (its label, its value, the values a sampled_from offered)."""

    def __init__(self, data):
        self.data, self.draws = data, []

    def draw(self, strategy, label=None):
        value = self.data.draw(strategy, label=label)
        self.draws.append((label, value, tuple(getattr(strategy, "elements", ()))))
        return value


class _Unreplayable(Exception):
    """The changed value leads the case along another path of draws than the recorded one's."""


class _Replayed:
    """The draws of a recorded case again, in order, with the draw labelled `label` given `value` instead."""

    def __init__(self, draws: list, label: str, value: object):
        self.draws, self.label, self.value = list(draws), label, value

    def draw(self, strategy, label=None):
        if not self.draws or self.draws[0][0] != label:
            raise _Unreplayable
        _, recorded, _ = self.draws.pop(0)
        return self.value if label == self.label else recorded


def _edges(draws: list, spec) -> list[tuple[str, object]]:
    """(setting, value) for each value a setting's draw offered other than the one drawn: the classes of its contract
    that the drawn examples may have missed."""
    settings_ = {p.name for p in spec.params}
    return [(label, option) for label, value, offered in draws if label in settings_
            for option in offered if not (option is value or option == value and type(option) is type(value))]


# --- the comparison ---------------------------------------------------------------------------------------------

def _copies(arguments: dict[str, object]) -> dict[str, object]:
    """The arguments for one call: tensors cloned, and a generator in its state now (each call draws the same)."""
    def copy(v):
        if isinstance(v, Tensor):
            return v.clone()
        if isinstance(v, torch.Generator):
            return torch.Generator(v.device).set_state(v.get_state())
        return v
    return {k: copy(v) for k, v in arguments.items()}


def _bind(reference, arguments: dict[str, object]):
    bound = inspect.signature(reference).bind(**arguments)
    return bound.args, bound.kwargs


def _tolerances(case: Case, want: object) -> dict[str, float]:
    """Tolerances for the case's dtype, scaled by the largest finite magnitude among its inputs and the result: a
    right answer written another way rounds differently, by a few units of the dtype's precision in the largest
    term it handles (logits 3000 apart in float32 are each known only to 2e-4)."""
    dtype = _dtype_of(case)
    largest = 1.0
    for t in _tensors(want) + _tensors(list(case.arguments.values())):
        if t.is_floating_point() and t.numel():
            finite = t[torch.isfinite(t)]
            if finite.numel():
                largest = max(largest, finite.abs().max().item())
    eps = torch.finfo(dtype).eps
    return {"atol": max(64 * eps * largest, 1e-12 if dtype == torch.float64 else 1e-5),
            "rtol": 1e-7 if dtype == torch.float64 else 1e-4}


def _tensors(value: object) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _dtype_of(case: Case) -> torch.dtype:
    for v in case.arguments.values():
        if isinstance(v, Tensor) and v.is_floating_point():
            return v.dtype
        modules = v.values() if isinstance(v, (dict, torch.nn.ModuleDict)) else [v]
        for module in modules:  # adapters drawn in the case's dtype
            if isinstance(module, torch.nn.Module) and module is not _model():
                floats = [p for p in module.parameters() if p.is_floating_point()]
                if floats:
                    return floats[0].dtype
    return torch.float32


def _compare(fn, reference, case: Case, name: str) -> None:
    what = f"with {case.describe()}, {name}(...)"
    given = _copies(case.arguments)
    try:
        args, kwargs = _bind(reference, given)
        torch.manual_seed(0)  # before each call: one drawn input, one result, even from code that draws at random
        want = reference(*args, **kwargs)
    except ValueError as refused:  # a documented refusal: the learner's version must refuse too
        args, kwargs = _bind(reference, _copies(case.arguments))
        try:
            torch.manual_seed(0)
            got = fn(*args, **kwargs)
        except ValueError:
            observing.observe(what, "ValueError")
            return
        except NotImplementedError:
            raise
        except Exception as other:  # noqa: BLE001 - the learner's code may raise anything
            observing.observe(what, type(other).__name__)
            if isinstance(other, CheckFailure):  # a check of the checker's own (a contract) refused it first
                raise CheckFailure(f"{what}: expected a ValueError (the reference refuses this input: "
                                   f"{str(refused)[:160]}); instead, {str(other)[:200]}") from None
            raise CheckFailure(f"{what}: expected a ValueError (the reference refuses this input: "
                               f"{str(refused)[:160]}), but it raised {type(other).__name__}: {str(other)[:200]}"
                               f"{raised_at(fn, other)}") from None
        observing.observe(what, ("returned", got))  # what it returned is part of the failure (properties.py)
        raise refusal_left_out(f"{what}: should raise a ValueError (the reference refuses this input: "
                           f"{str(refused)[:160]}), but it returned {show(got)}") from None
    except Exception:  # noqa: BLE001 - outside what the reference computes (bfloat16 unsupported, ...): not drawn
        reject()
    # a sampler's values are compared only where it is greedy (temperature 0, or top_k 1); every other drawn exercise
    # is deterministic (the references' own runs here would turn out flaky otherwise)
    random = case.arguments.get("temperature", 0) != 0 and case.arguments.get("top_k") != 1
    args, kwargs = _bind(reference, _copies(case.arguments))
    raised = None
    try:
        torch.manual_seed(0)
        got = assert_inputs_unchanged(fn, *args, what=what, may_alias=True, **kwargs)
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as error:  # noqa: BLE001
        raised = f"{type(error).__name__}: {_first_lines(str(error))}{raised_at(fn, error)}"
        observing.observe(what, type(error).__name__)
    if raised is not None:  # raised here, out of the handler: no context chained, which hypothesis would compare
        raise CheckFailure(f"{what}: raised {raised}, where the reference returns {show(want)}")
    _assert_same_kind(got, want, what, case)  # first: a float32 result for float64 inputs differs in value too
    if random:
        pass
    elif _dtype_of(case) == torch.bfloat16:  # 8 bits of mantissa: values are checked in float32 and float64
        _assert_no_new_nan(got, want, what)
    else:
        assert_outputs_match(got, want, what, **_tolerances(case, want))
    if not aliases(want, given):
        assert_no_aliases(got, dict(zip(inspect.signature(reference).parameters, args)) | kwargs, what)


def _first_lines(text: str, limit: int = 240) -> str:
    """An error's text up to `limit` characters, in whole lines (the first line whatever its length)."""
    lines = text.strip().splitlines() or [""]
    kept = [lines[0][:limit]]
    for line in lines[1:]:
        if sum(map(len, kept)) + len(line) > limit:
            break
        kept.append(line)
    return "\n".join(kept)


def _assert_no_new_nan(got: object, want: object, what: str) -> None:
    """In bfloat16, where rounding differs by more than any tolerance worth having: no NaN where the reference has
    none (the values themselves are compared in float32 and float64)."""
    for g, w in zip(_tensors(got), _tensors(want)):
        if g.shape == w.shape and g.is_floating_point() and w.is_floating_point():
            new = g.isnan() & ~w.isnan()
            observing.observe(f"{what} (NaN)", new.nonzero().tolist())
            if new.any():
                where = "" if new.numel() == 1 else (f" at {int(new.sum())} of {new.numel()} positions "
                                                     f"({new.nonzero()[0].tolist()} first)")  # one number: none
                raise CheckFailure(f"{what}: NaN{where} where the reference's value is not NaN")


def _assert_same_kind(got: object, want: object, what: str, case: Case) -> None:
    """Each returned tensor has the reference's dtype and device, which follow the inputs' where the reference's do
    (shapes are compared with the values, which say how they differ)."""
    pairs = list(zip(_tensors(got), _tensors(want)))
    for i, (g, w) in enumerate(pairs):
        label = what if len(pairs) == 1 else f"{what}[{i}]"
        observing.observe(f"{label} (dtype, device)", (str(g.dtype), g.device.type))
        if g.dtype != w.dtype or g.device != w.device:
            def kind(t):
                return str(t.dtype).replace("torch.", "") + (f" on {t.device}" if g.device != w.device else "")
            inputs = str(_dtype_of(case)).replace("torch.", "")
            line = dtype_where(g, w) if g.device == w.device else None
            raise CheckFailure(f"{label}: your result is {kind(g)}, the reference's {kind(w)} (from {inputs} inputs)."
                               + (f" {line}" if line else "")
                               + aside("Common causes: a tensor made without the inputs' dtype and device "
                                       "(torch.zeros(n) where torch.zeros_like(x) or x.new_zeros(n) keeps them), or a "
                                       "cast the reference does not make (.float(), mask.float(), torch.tensor(a "
                                       "list))."))


@contextlib.contextmanager
def _no_local_constants():
    """Hypothesis (6.170, the locked version) mixes the constants it finds in the source of the modules loaded from
    outside site-packages (the course, the learner's notebook) into what it draws, and caches them in a .hypothesis/
    folder where the process started. Off for these draws: the same examples in every process, whatever else is loaded
    (check() in a notebook, the meta-test in pytest), and nothing written in the learner's folder."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # a layout without them: nothing to turn off
        yield
        return
    original = getattr(providers, "_get_local_constants", None)
    if original is None:
        yield
        return
    empty = providers.Constants()
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = original


def uses_model(part: str, name: str) -> bool:
    """Whether the exercise's drawn arguments include the embedded model (a forward pass or more per example)."""
    return bool({"model", "lora_model"} & set(Spec(_reference_of(part, name), name).kinds.values()))


def on_generated_inputs(impl, part: str, name: str, examples: int | None = None) -> None:
    """The learner's `name` against the reference's on inputs drawn from its contract (see the module's docstring)."""
    reference = _reference_of(part, name)
    fn = getattr(impl, name)
    spec = Spec(reference, name)
    if not all(spec.kinds.values()):
        raise RuntimeError(f"test set-up: {name}'s arguments cannot be drawn (tests/generated.py, _kind_of)")
    log = observing._log
    start = len(log) if log is not None else 0
    state: dict[str, object] = {"stub": None, "first": None}
    with_model = uses_model(part, name)

    @settings(SETTINGS, max_examples=examples or (EXAMPLES_WITH_MODEL if with_model else EXAMPLES),
              phases=SETTINGS.phases if _DRAWS["shrink"] else (Phase.explicit, Phase.generate))
    @given(st.data())
    def example(data):
        if log is not None:
            del log[start:]  # only the last example's observations: the shrunk one, when a difference is found
        recorded = _Recorded(data) if with_model and state["first"] is None else None  # the first example's draws
        case = _draw_case(recorded or data, spec, FLOAT_DTYPES)  # drawn every time: hypothesis replays the same draws
        if recorded is not None:
            state["first"] = recorded.draws
        if state["stub"] is not None:
            return
        try:
            # the message of a failing example is worked out in full only for the one hypothesis shows (its final
            # replay of the smallest): the search and shrinking throw theirs away
            with contextlib.nullcontext() if current_build_context().is_final else bare_failures():
                _compare(fn, reference, case, name)
        except NotImplementedError as stub:  # not written yet: said once, with no example to shrink
            state["stub"] = stub

    try:
        with _no_local_constants():
            example()
    except Exception as failure:
        if isinstance(failure, Unsatisfiable):
            raise RuntimeError(f"test set-up: no drawn input of {name} is one the reference computes") from None
        if hasattr(failure, "__notes__"):  # hypothesis's "Falsifying example: ..." (the message says it in words)
            del failure.__notes__
        if isinstance(failure, FlakyFailure) and len(failure.exceptions) == 1:  # failed once, passed when replayed
            inner = failure.exceptions[0]
            if isinstance(inner, CheckFailure):
                flaky = CheckFailure(add_finding(str(inner), "Run again on the same input, your code passed: the same "
                                                 "call does not give the same result every time."))
                flaky.refusal_left_out = inner.refusal_left_out
                raise flaky from None
            raise inner from None
        raise
    if state["stub"] is not None:
        raise state["stub"]
    for label, value in _edges(state["first"] or [], spec):  # recorded only for an exercise that runs the model
        try:
            case = _draw_case(_Replayed(state["first"], label, value), spec, FLOAT_DTYPES)
        except _Unreplayable:
            continue
        if log is not None:
            del log[start:]  # the observations of the case that fails, as for a drawn one
        try:
            _compare(fn, reference, case, name)
        except UnsatisfiedAssumption:  # outside what the reference computes: not a case, as when drawn
            continue


# The meta-test's runs of the registered wrong versions draw at most this many inputs per exercise: a wrong version
# that they do not catch and name is run again with all of them (tests/meta.py)
WRONG_VERSION_EXAMPLES = 10
_DRAWS: dict = {"model": True, "examples": None, "shrink": True}


@contextlib.contextmanager
def drawing_for_wrong_versions(examples: int | None = WRONG_VERSION_EXAMPLES):
    """Inside this block (the meta-test's runs of the registered wrong versions), the drawn-input tests of the
    exercises that run the embedded model skip themselves, and the others draw at most `examples` inputs (None: as
    many as a learner's check does). A forward pass per example and per shrinking step (about 0.3 s each here) would
    cost minutes, and the generation of 100 examples for each wrong version that the draws do not catch a third of
    the meta-test's time. The other tests catch and name the wrong versions of the model's exercises, and the meta-test
    runs every wrong version of an exercise again with all the draws when the fewer do not catch and name one; check()
    runs these tests in full for a learner, and replays a wrong version on them.

    Nor is a difference shrunk to the smallest input that shows it (a quarter of a tensor exercise's meta-test, py-spy
    on ppo_loss, 2026-11-30): the meta-test asks whether each wrong version is caught and named by its own runs, and
    whether the message keeps the rules of its form, which hold for any input that shows the difference. A learner's
    check() shrinks, and so do the replays that compare the learner's run with a wrong version's."""
    before = dict(_DRAWS)
    _DRAWS.update(model=False, examples=examples, shrink=False)
    try:
        yield
    finally:
        _DRAWS.update(before)


def generated_tests_of(part: str) -> dict[str, object]:
    """{test name: test} for a part's test_generated.py, each marked with `@exercise(...)` so that check() runs it with
    the exercise's other tests: one on drawn inputs for each exercise whose arguments can be drawn, and one on the
    signature's defaults for each exercise the battery (battery.py, which compares them too) does not call."""
    import pytest

    from tests.battery import covered
    from utils.checker.layout import exercise_names
    from utils.checker.properties import assert_defaults_match

    def on_inputs(name: str):
        with_model = uses_model(part, name)

        @pytest.mark.exercise(name)
        def test(impl):
            if not _DRAWS["model"] and with_model:
                pytest.skip("the drawn inputs with the embedded model are not run for the registered wrong versions")
            on_generated_inputs(impl, part, name, examples=_DRAWS["examples"])

        test.__name__ = test.__qualname__ = f"test_{name}_on_generated_inputs"
        test.__doc__ = f"{name} against the reference on inputs drawn from its contract (tests/generated.py)."
        return test

    def defaults(name: str):
        @pytest.mark.exercise(name)
        def test(impl):
            if _not_written(getattr(impl, name)):
                raise NotImplementedError(f"{name} is not written yet")
            assert_defaults_match(getattr(impl, name), _reference_of(part, name), name)

        test.__name__ = test.__qualname__ = f"test_{name}_keeps_the_documented_defaults"
        test.__doc__ = f"{name}'s defaults are the reference's (the course calls it without them)."
        return test

    tests = {f"test_{name}_on_generated_inputs": on_inputs(name) for name in drawable(part)}
    checked = set(covered(part)) | _defaults_checked_in(part)
    for name in exercise_names(part):
        if name not in checked and any(p.default is not inspect.Parameter.empty for p in _parameters(part, name)):
            tests[f"test_{name}_keeps_the_documented_defaults"] = defaults(name)
    return tests


def _not_written(obj) -> bool:
    """Whether a function (or a class's __init__) only raises NotImplementedError, as the notebook's stubs do: its
    signature, the stub's own, says nothing of the learner's work. Read from its bytecode (a notebook's cells have no
    source file)."""
    target = getattr(obj, "__init__", None) if inspect.isclass(obj) else obj
    code = getattr(inspect.unwrap(target), "__code__", None)
    if code is None or "NotImplementedError" not in code.co_names:
        return False
    plain = {"RESUME", "NOP", "CACHE", "PUSH_NULL", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_CONST", "PRECALL", "CALL",
             "CALL_FUNCTION", "RAISE_VARARGS", "RETURN_VALUE", "RETURN_CONST", "BUILD_STRING", "FORMAT_VALUE"}
    return all(i.opname in plain for i in dis.get_instructions(code))


def _defaults_checked_in(part: str) -> set[str]:
    """The exercises whose defaults a test of the part compares itself (`assert_defaults_match(impl.NAME, ...)`)."""
    from utils.checker.layout import tests_of

    found = set()
    for path in tests_of(part).glob("test_*.py"):
        found |= set(re.findall(r"assert_defaults_match\(impl\.(\w+)", path.read_text()))
    return found


def _parameters(part: str, name: str) -> list[inspect.Parameter]:
    reference = _reference_of(part, name)
    functions = [getattr(reference, n) for n in ("__init__", "forward") if n in vars(reference)] \
        if inspect.isclass(reference) else [reference]
    return [p for fn in functions for p in inspect.signature(fn).parameters.values()]
