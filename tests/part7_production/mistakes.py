"""The known wrong versions of Part 7's exercises, in the notebook's order (fuse_qkv, split_qkv, peft_state_dict,
to_trl_config), and the REGISTRY that names them. Each docstring is what a learner reads when their version fails a
test the same way: what was done wrong, and what to do instead (utils/checker/registry.py)."""

import dataclasses

import torch

from solutions import part7_production as ref
from solutions.part2_lora import LoRA
from solutions.production import knobs
from tests.support import Exercise, Registry, mistake


# --- fuse_qkv: a block's q, k and v adapters as one c_attn LoRA ---------------------------------------------------

@mistake("values")
def fuse_qkv_scale_folded(adapters):
    """Each adapter's scale (alpha / rank) was folded into its block of B, and scale 1 returned. It computes the same
    update, but not the adapter a peft user rebuilds: peft multiplies lora_B(lora_A(x)) by lora_alpha / r, so with the
    course's r and alpha in the config the scale is applied twice, and training in peft takes another step. Keep B
    as it is and return the adapters' scale."""
    A, B, scale = ref.fuse_qkv(adapters)
    column = 0
    for t in (t for t in ("q", "k", "v") if t in adapters):
        rank = adapters[t].A.shape[0]
        B[:, column:column + rank] *= scale
        column += rank
    return A, B, 1.0


@mistake("values")
def fuse_qkv_scales_assumed_equal(adapters):
    """Every target's block of B was left as it is, with the first adapter's scale for all: right when the scales
    agree (make_adapters gives every adapter one alpha and rank), wrong when they differ, since c_attn has one scale.
    Multiply a target's B by its scale / the returned scale."""
    A, B, scale = ref.fuse_qkv(adapters)
    column, d_out = 0, B.shape[0] // 3
    for t in (t for t in ("q", "k", "v") if t in adapters):
        rank, row = adapters[t].A.shape[0], ("q", "k", "v").index(t) * d_out
        B[row:row + d_out, column:column + rank] = adapters[t].B.detach()
        column += rank
    return A, B, scale


@mistake("values")
def fuse_qkv_rows_by_position(adapters):
    """Each adapter's block of B was put in the rows of its position among the adapters given, not of its target:
    with only q and v, v's update landed in k's rows. c_attn's rows are fixed, q then k then v, each n_heads * d_head
    rows: leave a target with no adapter as zero rows."""
    names = [t for t in ("q", "k", "v") if t in adapters]
    d_out, scale = adapters[names[0]].B.shape[0], adapters[names[0]].scale
    A = torch.cat([adapters[t].A.detach() for t in names])
    B = A.new_zeros(3 * d_out, A.shape[0])
    column = 0
    for i, t in enumerate(names):
        rank = adapters[t].A.shape[0]
        B[i * d_out:(i + 1) * d_out, column:column + rank] = adapters[t].B.detach() * (adapters[t].scale / scale)
        column += rank
    return A, B, scale


@mistake("values")
def fuse_qkv_A_in_the_dicts_order(adapters):
    """A stacks the adapters' A in the order the dict gives them, while B's columns follow q, k, v: a target's rows
    of B then multiply another target's A. Stack A in the order q, k, v, as B's columns are."""
    names = [t for t in ("q", "k", "v") if t in adapters]
    _, B, scale = ref.fuse_qkv(adapters)
    return torch.cat([adapters[t].A.detach() for t in adapters if t in names]), B, scale


@mistake("values")
def fuse_qkv_one_shared_A(adapters):
    """The rank was kept at r: the first adapter's A stands for all of them and B stacks their B's. That is right
    only if the adapters share one A, and separately trained q, k and v adapters do not: stack their A's (rank =
    the sum of the ranks) and make B block-structured."""
    names = [t for t in ("q", "k", "v") if t in adapters]
    first = adapters[names[0]]
    d_out = first.B.shape[0]
    B = first.A.new_zeros(3 * d_out, first.A.shape[0])
    for t in names:
        row = ("q", "k", "v").index(t) * d_out
        B[row:row + d_out] = adapters[t].B.detach() * (adapters[t].scale / first.scale)
    return first.A.detach().clone(), B, first.scale


@mistake("values")
def fuse_qkv_B_not_block_diagonal(adapters):
    """Each target's rows of B hold its B in every column block, so its rows also read the other adapters' A: q's
    output gets B_q (A_q + A_k + A_v) x. Put a target's B only in the columns of its own A, zeros elsewhere."""
    names = [t for t in ("q", "k", "v") if t in adapters]
    A, B, scale = ref.fuse_qkv(adapters)
    d_out = adapters[names[0]].B.shape[0]
    column = 0
    for t in names:
        rank = adapters[t].A.shape[0]
        row = ("q", "k", "v").index(t) * d_out
        block = B[row:row + d_out, column:column + rank].clone()
        for other in range(0, A.shape[0], rank):
            B[row:row + d_out, other:other + rank] = block
        column += rank
    return A, B, scale


@mistake("values")
def fuse_qkv_transposed_for_conv1d(adapters):
    """A and B were transposed because GPT-2's Conv1D stores its weight [d_in, d_out]. peft's lora_A and lora_B are
    nn.Linear layers on every module, Conv1D included: lora_A.weight is [rank, d_in], lora_B.weight [d_out, rank]
    (fan_in_fan_out only transposes the update when it is merged into the weight)."""
    A, B, scale = ref.fuse_qkv(adapters)
    return B.T.contiguous(), A.T.contiguous(), scale


@mistake("inputs")
def fuse_qkv_scales_B_in_place(adapters):
    """Each adapter's scale was folded into its own B in place (adapter.B.data *= scale): the adapters the caller
    trains now compute scale² B A, and peft, whose lora_alpha / r applies the scale, gets it twice. Leave the
    adapters alone, and B unscaled: copy it (adapter.B.detach()) into the fused B."""
    scales = {t: adapter.scale for t, adapter in adapters.items()}
    for adapter in adapters.values():
        adapter.B.data.mul_(adapter.scale)
        adapter.scale = 1.0
    try:
        return ref.fuse_qkv(adapters)
    finally:
        for t, adapter in adapters.items():
            adapter.scale = scales[t]


@mistake("gradient")
def fuse_qkv_not_detached(adapters):
    """A still carries the adapters' gradient graph (torch.cat of the parameters, without .detach()): A and B are
    values to write to a file, not part of a training step. Detach them (adapter.A.detach(), adapter.B.detach())."""
    _, B, scale = ref.fuse_qkv(adapters)
    return torch.cat([adapters[t].A for t in ("q", "k", "v") if t in adapters]), B, scale


@mistake("error")
def fuse_qkv_ignores_other_targets(adapters):
    """An adapter on another target (o, mlp_in, ...) was silently left out. c_attn computes q, k and v only: refuse
    any other key with a ValueError that says so."""
    return ref.fuse_qkv({t: a for t, a in adapters.items() if t in ("q", "k", "v")})


# --- split_qkv: a c_attn LoRA as three course adapters --------------------------------------------------------------

def split_with(A, B, scale, rows, rank_slices=None, alpha=None, share=False, dtype=True):
    """split_qkv with a twist: `rows[t]` the rows of B for target t, `rank_slices[t]` a slice of the rank, `alpha`
    the LoRA's alpha (None: scale * rank), `share`: one A Parameter for all three, `dtype`: follow A's dtype."""
    out, shared = {}, None
    for t in ("q", "k", "v"):
        a, b = A, B[rows[t]]
        if rank_slices is not None:
            a, b = A[rank_slices[t]], b[:, rank_slices[t]]
        rank = a.shape[0]
        lora = LoRA(A.shape[1], b.shape[0], rank=rank, alpha=alpha if alpha is not None else scale * rank)
        if dtype:
            lora = lora.to(device=A.device, dtype=A.dtype)
        with torch.no_grad():
            lora.A.copy_(a)
            lora.B.copy_(b)
        if alpha is None:
            lora.scale = scale
        if share:
            shared = shared if shared is not None else torch.nn.Parameter(A)
            lora.A = shared
        out[t] = lora
    return out


def thirds(B):
    """The rows of B that q, k and v write: three contiguous thirds."""
    d = B.shape[0] // 3
    return {t: slice(i * d, (i + 1) * d) for i, t in enumerate(("q", "k", "v"))}


@mistake("values")
def split_qkv_interleaved_rows(A, B, scale):
    """q, k and v were taken as every third row of B (a per-row interleaving, like some fused layouts). GPT-2's
    c_attn writes [q | k | v]: three contiguous blocks of n_heads * d_head rows, q first."""
    return split_with(A, B, scale, {t: slice(i, None, 3) for i, t in enumerate(("q", "k", "v"))})


@mistake("values")
def split_qkv_chunks_the_rank(A, B, scale):
    """The rank was cut in three, q taking the first third of A's rows and of B's columns: that undoes the block
    structure fuse_qkv writes, but a c_attn LoRA that peft trained has one shared A and a dense B, where every
    target reads all of A. Give each adapter the whole A and its rows of B."""
    rank = A.shape[0]
    third = rank // 3
    cuts = {t: slice(i * third, (i + 1) * third) for i, t in enumerate(("q", "k", "v"))}
    return split_with(A, B, scale, thirds(B), rank_slices=cuts)


@mistake("values")
def split_qkv_scale_dropped(A, B, scale):
    """The adapters were built with LoRA's default alpha (16), so their scale is 16 / rank, not the c_attn LoRA's
    `scale`: build each with alpha = scale * rank (and set lora.scale = scale)."""
    return split_with(A, B, scale, thirds(B), alpha=16.0)


@mistake("values")
def split_qkv_shares_A(A, B, scale):
    """The three adapters share one A Parameter (wrapping the caller's A): training q would move k's and v's A, and
    the tensor read from the file. Give each adapter its own copy: lora.A.copy_(A) inside torch.no_grad()."""
    return split_with(A, B, scale, thirds(B), share=True)


@mistake("values")
def split_qkv_float32_always(A, B, scale):
    """The adapters stay float32 (LoRA's default) whatever A's dtype: move each to A's device and dtype
    (lora.to(device=A.device, dtype=A.dtype)) before copying A and B in."""
    return split_with(A, B, scale, thirds(B), dtype=False)


@mistake("inputs")
def split_qkv_folds_the_scale_into_B_in_place(A, B, scale):
    """The scale was folded into the caller's B in place (B.mul_(scale)) and the adapters given scale 1: the file's
    tensors change under the caller. Keep B as it is and give each adapter `scale`."""
    B.mul_(scale)
    return split_with(A, B, 1.0, thirds(B))


@mistake("error")
def split_qkv_no_refusal(A, B, scale):
    """B with a number of rows that is not a multiple of 3 was cut anyway (rows // 3 each, the rest dropped): it is
    not a c_attn LoRA. Raise a ValueError that says what B's rows must be."""
    return split_with(A, B, scale, thirds(B))


# --- peft_state_dict: course adapters as peft's tensors --------------------------------------------------------------

@mistake("values")
def peft_state_dict_without_the_prefix(adapters):
    """The keys lack peft's prefix: PeftModel wraps the Hugging Face model twice (PeftModel.base_model is a
    LoraModel whose .model is yours), so peft's keys start with 'base_model.model.' before the module's name."""
    return {k.removeprefix("base_model.model."): t for k, t in ref.peft_state_dict(adapters).items()}


@mistake("values")
def peft_state_dict_with_the_adapter_name(adapters):
    """The keys keep the adapter's name ('lora_A.default.weight'), as the parameters are named inside a PeftModel;
    peft's files leave it out ('lora_A.weight'), because the name is chosen when the adapter is loaded."""
    return {k.replace(".weight", ".default.weight"): t for k, t in ref.peft_state_dict(adapters).items()}


@mistake("values")
def peft_state_dict_scale_folded(adapters):
    """The scale was folded into the B of o, mlp_in and mlp_out (B * scale): peft multiplies lora_B(lora_A(x)) by
    lora_alpha / r from the config, which carries the course's r and alpha, so the scale would be applied twice (and
    training in peft would take another step). Write each B as it is."""
    tensors = ref.peft_state_dict(adapters)
    for key, adapter in adapters.items():
        layer, target = key[1:].split("_", 1)
        if target not in ("q", "k", "v"):
            name = f"base_model.model.transformer.h.{layer}.{ref.HF_MODULES[target]}.lora_B.weight"
            tensors[name] = adapter.B.detach() * adapter.scale
    return tensors


@mistake("values")
def peft_state_dict_mlp_modules_swapped(adapters):
    """mlp_in and mlp_out went to each other's module: mlp_in is the MLP's first layer, mlp.c_fc (d_model ->
    d_mlp), and mlp_out its second, mlp.c_proj (d_mlp -> d_model)."""
    swap = {"mlp.c_fc": "mlp.c_proj", "mlp.c_proj": "mlp.c_fc"}
    out = {}
    for key, tensor in ref.peft_state_dict(adapters).items():
        module = next((m for m in swap if f".{m}." in key), None)
        out[key.replace(f".{module}.", f".{swap[module]}.") if module else key] = tensor
    return out


@mistake("values")
def peft_state_dict_q_k_v_one_by_one(adapters):
    """q, k and v were each written under attn.c_attn's keys, one after the other, so the last one overwrote the
    others (and wrote its update into q's rows). c_attn computes all three: fuse a block's q, k and v adapters into
    one LoRA with fuse_qkv."""
    tensors = {}
    for key, adapter in adapters.items():
        layer, target = key[1:].split("_", 1)
        name = f"base_model.model.transformer.h.{layer}.{ref.HF_MODULES[target]}"
        B = adapter.B.detach().clone()
        if target in ("q", "k", "v"):
            B = torch.cat([B, torch.zeros_like(B), torch.zeros_like(B)])
        tensors[f"{name}.lora_A.weight"] = adapter.A.detach().clone()
        tensors[f"{name}.lora_B.weight"] = B
    return tensors


@mistake("inputs")
def peft_state_dict_shares_the_adapters_memory(adapters):
    """The A and B of o, mlp_in and mlp_out are the adapters' own tensors, detached but not copied (.detach() and
    .cpu() on a CPU tensor share its memory): the adapters train on after the export, and the state dict changes
    with them. Give each tensor its own memory (.clone())."""
    tensors = ref.peft_state_dict(adapters)
    for key, adapter in adapters.items():
        layer, target = key[1:].split("_", 1)
        if target not in ("q", "k", "v"):
            name = f"base_model.model.transformer.h.{layer}.{ref.HF_MODULES[target]}"
            tensors[f"{name}.lora_A.weight"] = adapter.A.detach().cpu()
            tensors[f"{name}.lora_B.weight"] = adapter.B.detach().cpu()
    return tensors


@mistake("inputs")
def peft_state_dict_scales_in_place(adapters):
    """Each adapter's scale was folded into its own B in place, and its scale set to 1: the caller's adapters are
    changed (a second export would fold the scale in again), and the file's B carry the scale that peft's
    lora_alpha / r applies again. Leave the adapters alone, and write each B as it is."""
    for adapter in adapters.values():
        adapter.B.data.mul_(adapter.scale)
        adapter.scale = 1.0
    return ref.peft_state_dict(adapters)


# --- to_trl_config: our GRPOConfig as trl.GRPOConfig's arguments ----------------------------------------------------

def reference_with(name: str, **changes):
    """A wrong version: the reference, with each key of `changes` computed by changes[key](cfg, world_size)."""
    def wrong(cfg, output_dir, world_size=1):
        out = ref.to_trl_config(cfg, output_dir, world_size)
        return {**out, **{key: value(cfg, world_size) for key, value in changes.items()}}
    wrong.__name__ = wrong.__qualname__ = name
    return wrong


trl_steps_not_scaled = reference_with("trl_steps_not_scaled", max_steps=lambda cfg, w: cfg.steps)
trl_steps_not_scaled.__doc__ = """max_steps = steps: TRL counts optimizer steps, and with num_iterations μ > 1 each
batch of rollouts serves μ of them, so the run would end after steps / μ batches. Use steps × num_iterations."""

trl_batch_in_prompts = reference_with("trl_batch_in_prompts",
                                      per_device_train_batch_size=lambda cfg, w: cfg.n_prompts // w)
trl_batch_in_prompts.__doc__ = """per_device_train_batch_size counted prompts: TRL's batch counts completions
(each prompt appears group_size times in it). Use n_prompts × group_size / world_size."""

trl_ignores_world_size = mistake("argument")(
    reference_with("trl_ignores_world_size",
                   per_device_train_batch_size=lambda cfg, w: cfg.n_prompts * cfg.group_size))
trl_ignores_world_size.__doc__ = """world_size was ignored: per_device_train_batch_size is per process, so on
several processes each step would sample world_size times as many completions. Divide by world_size."""

trl_batch_true_division = mistake("dtype")(
    reference_with("trl_batch_true_division",
                   per_device_train_batch_size=lambda cfg, w: cfg.n_prompts * cfg.group_size / w))
trl_batch_true_division.__doc__ = """per_device_train_batch_size = completions / world_size is a float (128.0):
TRL's batch size is a count of completions, an int (range() and the dataloader refuse a float). Divide with //
(the split is checked to be even first)."""

trl_weights_on_every_task = reference_with("trl_weights_on_every_task",
                                           reward_weights=lambda cfg, w: [1.0, cfg.format_weight])
trl_weights_on_every_task.__doc__ = """reward_weights was [1.0, format_weight] on every task: the "periods" task
has one reward function (the '.' count), and TRL wants one weight per reward function: [1.0] there."""

trl_cpu_unless_cuda = reference_with("trl_cpu_unless_cuda", use_cpu=lambda cfg, w: cfg.device != "cuda")
trl_cpu_unless_cuda.__doc__ = """use_cpu was True unless cfg.device is "cuda": device None means "the default
device" (a GPU when there is one); only "cpu" forces the CPU."""


def trl_without_settings(cfg, output_dir, world_size=1):
    """TRL_SETTINGS were left out: TRL's own defaults then differ from our trainer (a learning rate decayed to 0,
    bfloat16, activation checkpointing, shuffled prompts, ...). Add every setting of TRL_SETTINGS."""
    out = ref.to_trl_config(cfg, output_dir, world_size)
    return {k: v for k, v in out.items() if k not in knobs.TRL_SETTINGS}


@mistake("error")
def trl_no_split_check(cfg, output_dir, world_size=1):
    """An uneven split was not refused: with 128 completions and 3 processes, floor division gives 42 each, 126 a
    step, and TRL's own check then fails far from the cause. Raise a ValueError when world_size does not divide
    n_prompts × group_size."""
    out = ref.to_trl_config(cfg, output_dir, 1)
    return {**out, "per_device_train_batch_size": cfg.n_prompts * cfg.group_size // world_size}


@mistake("inputs")
def trl_scales_cfg_in_place(cfg, output_dir, world_size=1):
    """Changed the caller's config (cfg.steps *= cfg.num_iterations) to compute max_steps: the caller's own run
    would then be num_iterations times longer. Compute the product in a new variable."""
    cfg.steps *= cfg.num_iterations
    out = ref.to_trl_config(dataclasses.replace(cfg, num_iterations=1), output_dir, world_size)
    return {**out, "num_iterations": cfg.num_iterations}


REGISTRY = Registry("part7_production", {
    "fuse_qkv": Exercise(
        wrong=[fuse_qkv_scale_folded, fuse_qkv_scales_assumed_equal, fuse_qkv_rows_by_position,
               fuse_qkv_A_in_the_dicts_order, fuse_qkv_one_shared_A, fuse_qkv_B_not_block_diagonal,
               fuse_qkv_transposed_for_conv1d, fuse_qkv_scales_B_in_place, fuse_qkv_not_detached,
               fuse_qkv_ignores_other_targets],
    ),
    "split_qkv": Exercise(
        wrong=[split_qkv_interleaved_rows, split_qkv_chunks_the_rank, split_qkv_scale_dropped, split_qkv_shares_A,
               split_qkv_float32_always, split_qkv_folds_the_scale_into_B_in_place, split_qkv_no_refusal],
    ),
    "peft_state_dict": Exercise(
        wrong=[peft_state_dict_without_the_prefix, peft_state_dict_with_the_adapter_name,
               peft_state_dict_scale_folded, peft_state_dict_mlp_modules_swapped,
               peft_state_dict_q_k_v_one_by_one, peft_state_dict_scales_in_place,
               peft_state_dict_shares_the_adapters_memory],
    ),
    "to_trl_config": Exercise(
        wrong=[trl_steps_not_scaled, trl_batch_in_prompts, trl_ignores_world_size, trl_weights_on_every_task,
               trl_cpu_unless_cuda, trl_without_settings, trl_no_split_check, trl_scales_cfg_in_place,
               trl_batch_true_division],
        not_applicable={
            "gradient": "it returns settings: no tensor, nothing to differentiate",
            "hooks": "it touches no model",
            "lora": "it takes a config, not a model",
            "seed": "it draws no random numbers (cfg.seed is copied, checked as a value)",
        },
    ),
})
