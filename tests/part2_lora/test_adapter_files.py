"""save_adapter and load_adapter: a safetensors file with every tensor and the rank and alpha, a round trip, and
the refusals of load_adapter (another rank, alpha, targets or shapes; no metadata; what is not an adapter file)."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from solutions import part2_lora as ref
from tests.part2_lora.common import assert_state_unchanged, attempt, error_text, random_adapters, some_tokens, state_of
from tests.support import aside, assert_close, assert_equal, assert_inputs_unchanged, assert_raises, exercise, expect

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


def open_safetensors(path, what: str):
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})
    except Exception as error:  # noqa: BLE001
        start = Path(path).read_bytes()[:4] if Path(path).is_file() else None
        written_by = (": there is no file at that path" if start is None
                      else ": it is a zip archive, which is what torch.save writes" if start.startswith(b"PK\x03\x04")
                      else ": it is a pickle, which is what torch.save(..., _use_new_zipfile_serialization=False) "
                      "writes" if start.startswith(b"\x80") else "")
        expect(False, what, f"the file is not a safetensors file ({error_text(error)}){written_by}. An adapter file is "
               "written by safetensors.torch.save_file" + ("" if written_by else aside(
                   "Common cause: the file written with torch.save, which writes a pickle.")),
               observed=type(error).__name__)


def number(text, kind):
    try:
        return kind(text)
    except (TypeError, ValueError):
        return None


@exercise("save_adapter")
def test_save_adapter_writes_every_tensor_with_rank_and_alpha(impl, tiny_model, tmp_path):
    adapters = random_adapters(tiny_model, ("q", "o", "mlp_in"), rank=3, alpha=8.0)  # trainable, as after training
    path = tmp_path / "a.safetensors"
    attempt("save_adapter(adapters, path)",
            lambda: assert_inputs_unchanged(impl.save_adapter, adapters, path, what="save_adapter"))
    tensors, meta = open_safetensors(path, "the file save_adapter wrote")
    assert_equal(sorted(tensors), sorted(adapters.state_dict()), "the tensor names in the file",
                 hint="save adapters.state_dict() as it is: its names (\"L0_q.A\", ...) are what load_adapter "
                      "loads into adapters made by make_adapters")
    for name, p in adapters.state_dict().items():
        assert_close(tensors[name], p, f"the tensor {name} in the file", atol=0, rtol=0)
    assert_equal(sorted(k for k in ("rank", "alpha") if k in meta), ["alpha", "rank"], "rank and alpha in the "
                 "file's metadata", finding=f"The file's metadata: {meta!r}.",
                 hint="save_file(..., metadata={'rank': str(rank), 'alpha': str(alpha)})")
    rank, alpha = number(meta.get("rank"), float), number(meta.get("alpha"), float)
    expect(not (rank == 8.0 and alpha == 3.0), "rank and alpha in the file's metadata", "they are swapped: "
           f"{meta!r} for adapters of rank 3 and alpha 8", observed=(rank, alpha))
    assert_equal(rank, 3.0, "the rank in the file's metadata (float(metadata['rank']))",
                 finding=f"The file's metadata: {meta!r}.", hint="the rank is A.shape[0] (A is [rank, d_in])")
    assert_close(torch.tensor(float("nan") if alpha is None else alpha), torch.tensor(8.0),
                 "the alpha in the file's metadata (float(metadata['alpha']))",
                 factors={"1/rank (the scale alpha / rank was stored, not alpha)": 1 / 3}, atol=1e-6)


@exercise("save_adapter")
def test_save_adapter_round_trip(impl, tiny_model, tmp_path):
    adapters = random_adapters(tiny_model, ("q", "o"), rank=4, alpha=6.5, seed=9)  # alpha not a whole number
    path = tmp_path / "a.safetensors"
    attempt("save_adapter(adapters, path) with alpha 6.5", impl.save_adapter, adapters, path)
    fresh = ref.make_adapters(tiny_model, 4, 6.5, ("q", "o"))
    attempt("load_adapter (the reference's) on your file", ref.load_adapter, fresh, path)
    tokens = some_tokens(tiny_model)
    with torch.no_grad():
        assert_close(ref.LoRAModel(tiny_model, fresh)(tokens), ref.LoRAModel(tiny_model, adapters)(tokens),
                     "logits with the adapters saved and loaded again", atol=1e-5)


@exercise("save_adapter")
def test_save_adapter_creates_its_folder(impl, tiny_model, tmp_path):
    adapters = random_adapters(tiny_model, ("q",), rank=2, alpha=4.0)
    path = tmp_path / "runs" / "seed0" / "a.safetensors"  # neither folder exists yet
    def missing_folder(text: str) -> str:
        return ("The folders did not exist when the file was opened: create them first, "
                "Path(path).parent.mkdir(parents=True, exist_ok=True)" if "No such file or directory" in text else "")

    attempt("save_adapter(adapters, path) into folders that do not exist yet", impl.save_adapter, adapters, path,
            causes=missing_folder)
    expect(path.is_file(), "the file save_adapter wrote into folders that did not exist yet", f"no file at {path}",
           observed=path.is_file())


def saved(model, tmp_path, targets=("q", "o"), rank=4, alpha=8.0, seed=10):
    adapters = random_adapters(model, targets, rank=rank, alpha=alpha, seed=seed)
    path = tmp_path / "a.safetensors"
    ref.save_adapter(adapters, path)
    return adapters, path


@exercise("load_adapter")
def test_load_adapter_round_trip(impl, tiny_model, tmp_path):
    adapters, path = saved(tiny_model, tmp_path)
    fresh = ref.make_adapters(tiny_model, 4, 8.0, ("q", "o"))
    out = attempt("load_adapter(adapters, path)", impl.load_adapter, fresh, path)
    expect(out is fresh, "what load_adapter returns", f"expected the adapters it loaded into (the same object), got "
           f"{type(out).__name__ if out is not None else 'None'}: load into `adapters` in place, then return it",
           observed=type(out).__name__ if out is not fresh else "the same adapters")
    for name, p in adapters.state_dict().items():
        assert_close(fresh.state_dict()[name], p, f"{name} after loading", atol=0, rtol=0)


def refusal(impl, adapters, path, what: str, why: str, names: tuple[str, ...] = (), exception=ValueError):
    before = state_of(adapters)
    error = assert_raises(exception, impl.load_adapter, adapters, path, what=what, why=why)
    named = Path(path).name in str(error)
    expect(named, f"the message of {what}", f"name the file ({Path(path).name}), so that the reader knows which one; "
           f"the message was: {str(error)[:200]!r}", observed=named)
    if names:
        said = [n for n in names if n in str(error)]
        expect(bool(said), f"the message of {what}", f"say what does not match ({' or '.join(names)}), and what to "
               f"do instead; the message was: {str(error)[:200]!r}", observed=said)
    assert_state_unchanged(adapters, before, f"the adapters after {what}")


@exercise("load_adapter")
def test_load_adapter_refuses_another_rank_or_alpha(impl, tiny_model, tmp_path):
    _, path = saved(tiny_model, tmp_path)  # rank 4, alpha 8
    refusal(impl, ref.make_adapters(tiny_model, 4, 16.0, ("q", "o")), path,
            "load_adapter of a file saved with alpha 8 into adapters with alpha 16",
            "the same A and B with another alpha / rank compute another model", names=("alpha",))
    refusal(impl, ref.make_adapters(tiny_model, 8, 16.0, ("q", "o")), path,
            "load_adapter of a file saved with rank 4 into adapters with rank 8",
            "the file's tensors do not fit adapters of another rank", names=("rank",))


@exercise("load_adapter")
def test_load_adapter_refuses_other_targets_or_shapes(impl, tiny_model, tmp_path):
    _, path = saved(tiny_model, tmp_path)  # targets q and o
    refusal(impl, ref.make_adapters(tiny_model, 4, 8.0, ("q", "k")), path,
            "load_adapter of a file with adapters on q and o into adapters on q and k",
            "the file's tensors do not fit: their names differ")
    odd = nn.ModuleDict({key: ref.LoRA(64, 64, rank=4, alpha=8.0) for key in ref.make_adapters(tiny_model, 4, 8.0,
                                                                                                 ("q", "o"))})
    refusal(impl, odd, path, "load_adapter into adapters with the same names but other shapes",
            "the file's tensors do not fit: their shapes differ")


@exercise("load_adapter")
def test_load_adapter_refuses_a_file_without_rank_and_alpha(impl, tiny_model, tmp_path):
    from safetensors.torch import save_file

    adapters = random_adapters(tiny_model, ("q", "o"))
    path = tmp_path / "bare.safetensors"
    save_file({k: v.contiguous() for k, v in adapters.state_dict().items()}, str(path))  # no metadata
    refusal(impl, ref.make_adapters(tiny_model, 4, 8.0, ("q", "o")), path,
            "load_adapter of a file with no rank and alpha in its metadata",
            "without them its scale is unknown")
    for kept in ("rank", "alpha"):  # one of the two is not enough
        half = tmp_path / f"only_{kept}.safetensors"
        save_file({k: v.contiguous() for k, v in adapters.state_dict().items()}, str(half),
                  metadata={kept: {"rank": "4", "alpha": "8.0"}[kept]})
        refusal(impl, ref.make_adapters(tiny_model, 4, 8.0, ("q", "o")), half,
                f"load_adapter of a file with only {kept} in its metadata", "without both its scale is unknown")


@exercise("load_adapter")
def test_load_adapter_refuses_what_is_not_an_adapter_file(impl, tiny_model, tmp_path):
    adapters, good = saved(tiny_model, tmp_path)
    fresh = ref.make_adapters(tiny_model, 4, 8.0, ("q", "o"))
    refusal(impl, fresh, tmp_path / "missing.safetensors", "load_adapter of a path where there is no file",
            "nothing is there", exception=FileNotFoundError)
    (tmp_path / "run").mkdir()
    refusal(impl, fresh, tmp_path / "run", "load_adapter of a folder", "a folder is not an adapter file",
            exception=IsADirectoryError)
    data = good.read_bytes()
    noise = bytes(torch.randint(0, 256, (len(data),), generator=torch.Generator().manual_seed(0)).tolist())
    for name, content, what in (("empty", b"", "an empty file"), ("truncated", data[:len(data) // 2],
                                "a file cut to half its length"), ("noise", noise, "a file of random bytes")):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        refusal(impl, fresh, path, f"load_adapter of {what}", "it is not a safetensors file")
    pickled = tmp_path / "pickled.safetensors"
    torch.save(adapters.state_dict(), pickled)
    refusal(impl, fresh, pickled, "load_adapter of a file written by torch.save", "it is a pickle, not a safetensors "
            "file: loading it with torch.load would unpickle it, which can run code")


def test_load_adapter_says_what_is_wrong_with_the_file(tiny_model, tmp_path):
    """The reference's messages (beyond what the exercise asks): the file, what is wrong with it, what to do."""
    adapters, good = saved(tiny_model, tmp_path)
    data = good.read_bytes()
    (tmp_path / "empty.safetensors").write_bytes(b"")
    (tmp_path / "header.safetensors").write_bytes(data[:20])
    (tmp_path / "data.safetensors").write_bytes(data[:-10])
    (tmp_path / "noise.safetensors").write_bytes(bytes(range(7, 200)))
    torch.save(adapters.state_dict(), tmp_path / "pickled.safetensors")  # written, never loaded
    torch.save(adapters.state_dict(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    said = {"missing.safetensors": ("no adapter file at", "save_adapter"), ".": ("is a folder", ".safetensors file"),
            "empty.safetensors": ("empty", "save it again"), "header.safetensors": ("truncated", "copy it again"),
            "data.safetensors": ("truncated", "copy it again"), "noise.safetensors": ("random bytes", "save_adapter"),
            "pickled.safetensors": ("torch.save", "weights_only=True"), "legacy.pt": ("torch.save", "weights_only")}
    for name, words in said.items():
        with pytest.raises((ValueError, OSError)) as raised:
            ref.load_adapter(adapters, tmp_path / name)
        message = str(raised.value)
        assert str(tmp_path / name) in message and all(w in message for w in words), (name, message)
