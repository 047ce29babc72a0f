"""The policy_shift experiment's exercises: token_log_ratios, lora_on_blocks, answer_attention, on the bare model
and on LoRA models with a random B; the experiment in its smoke setting."""

import pytest
import torch
from torch import Tensor

from solutions import part6_lab as ref
from solutions.part2_lora import LoRAModel, make_adapters
from tests.support import (aside, assert_close, assert_equal, assert_hooks_clean, assert_inputs_unchanged,
                           assert_raises, calling, each_refusal, exercise, expect, function_checks_only,
                           lora_model_with_random_B)
from utils.sampling import Samples, completion_mask_from_ids, tokenize_prompts


EVERY_TARGET = ("q", "k", "v", "o")  # the LoRA of most tests: in every block, on every attention weight


def _samples(model) -> Samples:
    """Four left-padded prompts (additions and text) with completions of every kind: EOS early, EOS first, EOS last,
    no EOS; after a first EOS, padding (EOS again), on which the models still give log-probs."""
    tok = model.tokenizer
    eos = tok.eos_token_id
    prompts = ["12+34=", "This is", "7+5=", "95+48="]
    ids, attn = tokenize_prompts(tok, prompts, "cpu")
    g = torch.Generator().manual_seed(6)
    completion = torch.randint(1, 11, (4, 5), generator=g)  # digits mostly, so that the answers look like answers
    completion[0, 2], completion[1, 0], completion[2, 4] = eos, eos, eos
    cmask = completion_mask_from_ids(completion, eos)
    completion = torch.where(cmask, completion, eos)
    return Samples(ids=torch.cat([ids, completion], 1), attention_mask=torch.cat([attn, cmask.long()], 1),
                   completion_mask=cmask, prompt_len=ids.shape[1], prompts=prompts, texts=[""] * 4, eos_id=eos)


# --- token_log_ratios --------------------------------------------------------------------------------------------

LOG_RATIO_HINT = ("log pi - log pi_ref per completion token: the LoRA model's completion log-probs minus those of its "
                  "base module called directly (Part 0's completion_logprobs gives both, shifted and masked), 0 after "
                  "each completion's first EOS.")


@exercise("token_log_ratios")
def test_token_log_ratios_are_policy_minus_reference(impl, tiny_model):
    samples = _samples(tiny_model)
    for seed in (0, 1):
        lora_model = lora_model_with_random_B(tiny_model, seed, targets=EVERY_TARGET)
        what = f"token_log_ratios(LoRA model with random B (seed {seed}), samples)"
        got = calling(impl.token_log_ratios, lora_model, samples, what=what)
        assert_close(got, ref.token_log_ratios(lora_model, samples), what, hint=LOG_RATIO_HINT, atol=1e-4)


@exercise("token_log_ratios")
def test_token_log_ratios_are_zero_where_policy_is_reference(impl, tiny_model):
    """With B = 0 (a fresh LoRA) the policy computes the reference's function: every log-ratio is 0."""
    samples = _samples(tiny_model)
    lora_model = LoRAModel(tiny_model, make_adapters(tiny_model, 4, 8.0, ("q", "v")))
    got = calling(impl.token_log_ratios, lora_model, samples, what="token_log_ratios with B = 0")
    assert_close(got, torch.zeros(samples.completion_mask.shape), "token_log_ratios(LoRA model with B = 0, samples)",
                 hint="a fresh LoRA (B = 0) adds nothing: policy and reference agree, so log pi - log pi_ref is 0",
                 atol=1e-5)


@exercise("token_log_ratios")
def test_token_log_ratios_carry_no_gradient_and_leave_everything_alone(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, 2, targets=EVERY_TARGET)
    samples = _samples(tiny_model)
    out = assert_inputs_unchanged(impl.token_log_ratios, lora_model, samples, what="token_log_ratios")
    carries = isinstance(out, Tensor) and out.requires_grad
    expect(not carries, "the gradient of token_log_ratios", "the log-ratios carry a gradient: they are for looking at, "
           "so compute them under torch.no_grad() (a graph through two forward passes costs memory for nothing)",
           observed=carries)
    assert_hooks_clean(lora_model, lambda: impl.token_log_ratios(lora_model, samples), "token_log_ratios")


@exercise("token_log_ratios")
def test_token_log_ratios_refuse_a_bare_model(impl, tiny_model):
    assert_raises(ValueError, impl.token_log_ratios, tiny_model, _samples(tiny_model),
                  what="token_log_ratios(a bare model, samples)", why="a bare model has no .base: compared with itself "
                  "every log-ratio is 0, a silent wrong answer")


# --- lora_on_blocks ----------------------------------------------------------------------------------------------

BLOCKS_HINT = ("keep the adapters whose key 'L{layer}_{target}' names a layer in `blocks`, and only those, in a new "
               "nn.ModuleDict, and wrap them with the same base: LoRAModel(lora_model.base, kept)")


def _logits(model, samples):
    with torch.no_grad():
        return model(samples.ids, attention_mask=samples.attention_mask)


@exercise("lora_on_blocks")
def test_lora_on_blocks_computes_the_lora_of_those_blocks(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, 3, targets=EVERY_TARGET)
    on_the_mlp = lora_model_with_random_B(tiny_model, 4, targets=("mlp_in", "mlp_out"))  # keys "L0_mlp_in", ...
    samples = _samples(tiny_model)
    for blocks, lora_model in [(b, lora_model) for b in ([], [0], [2], [1, 3], [3, 0, 2], [0, 1, 2, 3])] + [
            ([1, 2], on_the_mlp)]:
        targets = "the MLP's" if lora_model is on_the_mlp else "every attention weight's"
        what = f"lora_on_blocks(lora_model, {blocks}) with adapters on {targets}"
        out = calling(impl.lora_on_blocks, lora_model, list(blocks), what=what)
        keys = sorted(out.adapters) if isinstance(out, LoRAModel) else type(out).__name__
        assert_equal(keys, sorted(ref.lora_on_blocks(lora_model, list(blocks)).adapters),
                     f"the adapters' keys of {what}", hint=BLOCKS_HINT)
        assert_close(_logits(out, samples), _logits(ref.lora_on_blocks(lora_model, list(blocks)), samples),
                     f"the logits of {what}", hint=BLOCKS_HINT, atol=1e-4, check_grad=False)


@exercise("lora_on_blocks")
def test_lora_on_blocks_shares_the_base_and_the_adapters(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, 4, targets=EVERY_TARGET)
    out = calling(impl.lora_on_blocks, lora_model, [1, 2], what="lora_on_blocks(lora_model, [1, 2])")
    is_lora = isinstance(out, LoRAModel)
    same_base = is_lora and out.base is lora_model.base
    copied = [k for k in out.adapters if k not in lora_model.adapters or out.adapters[k] is not lora_model.adapters[k]
              ] if is_lora else []
    found = ("" if same_base and not copied else f"; got a {type(out).__name__}" if not is_lora
             else "; its base is another module" + (f", and its adapters {copied[:4]} are other modules" if copied
                                                   else "") if not same_base
             else f"; its adapters {copied[:4]} are other modules than lora_model's")
    # observed: each thing the message says (base, adapters), so that a copy of the adapters alone and a copy of the
    # whole model are two failures, not one
    expect(same_base and not copied, "what lora_on_blocks(lora_model, [1, 2]) is made of", "expected a LoRAModel on "
           f"the same base module holding the same adapter modules (not copies){found}. A copy of the model doubles "
           "its memory, and an ablation must look at the trained adapters themselves",
           observed=(is_lora, same_base, copied))


@exercise("lora_on_blocks")
def test_lora_on_blocks_leaves_the_lora_model_alone(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, 5, targets=EVERY_TARGET)
    samples = _samples(tiny_model)
    before = _logits(lora_model, samples)
    assert_inputs_unchanged(impl.lora_on_blocks, lora_model, [0, 3], what="lora_on_blocks(lora_model, [0, 3])")
    assert_close(_logits(lora_model, samples), before, "lora_model's own logits after lora_on_blocks(lora_model, "
                 "[0, 3])", hint="the ablation must not change the trained policy: build a new ModuleDict of the kept "
                 "adapters; never delete, zero or move the others", check_grad=False)


@exercise("lora_on_blocks")
def test_lora_on_blocks_refuses_a_block_the_model_lacks(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, 6, targets=EVERY_TARGET)
    with each_refusal():
        for blocks in ([4], [-1], [0, 7]):
            assert_raises(ValueError, impl.lora_on_blocks, lora_model, blocks,
                          what=f"lora_on_blocks(lora_model, {blocks})",
                          why="the tiny model has blocks 0 to 3: another number would silently select nothing")
        with function_checks_only():  # the function's own refusal, not the annotation's (list[int])
            assert_raises(ValueError, impl.lora_on_blocks, lora_model, [1.5],
                          what="lora_on_blocks(lora_model, [1.5])",
                          why="a block's number is a whole number: 1.5 would silently select nothing")
        assert_raises(ValueError, impl.lora_on_blocks, lora_model, [True], what="lora_on_blocks(lora_model, [True])",
                      why="True is 1 to Python (a bool is an int), but a flag is no block's number")


# --- answer_attention --------------------------------------------------------------------------------------------

ATTENTION_HINT = ("out[layer, b, head, j] is blocks.{layer}.attn.hook_pattern[b, head, prompt_len - 1 + j, :] (query "
                  "rows, key columns), read in one forward pass with the attention mask, and 0 for the rows j after "
                  "the completion's first EOS")


@exercise("answer_attention")
def test_answer_attention_of_the_bare_model_and_of_the_policy(impl, tiny_model):
    samples = _samples(tiny_model)
    lora_model = lora_model_with_random_B(tiny_model, 7, targets=("q", "k"))
    for label, model in (("the bare model", tiny_model), ("a LoRA model (random B on q, k)", lora_model)):
        what = f"answer_attention({label}, samples)"
        got = calling(impl.answer_attention, model, samples, what=what)
        assert_close(got, ref.answer_attention(model, samples), what, hint=ATTENTION_HINT, atol=1e-5)


@exercise("answer_attention")
def test_answer_attention_rows_are_distributions_over_earlier_keys(impl, tiny_model):
    """Each real row sums to 1 over the keys and puts nothing on a later position (the attention is causal)."""
    samples = _samples(tiny_model)
    got = calling(impl.answer_attention, tiny_model, samples, what="answer_attention(model, samples)")
    shape = (4, 4, 4, samples.completion_mask.shape[1], samples.ids.shape[1])
    observed = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
    expect(observed == shape, "the shape of answer_attention(model, samples)", f"expected [layer, batch, head, gen, "
           f"seq] = {shape}, got {observed}", observed=observed)
    rows = got.sum(-1)
    real = samples.completion_mask[None, :, None, :].expand_as(rows)
    assert_close(rows, real.float(), "each row's sum over the key positions (1 for an answer position, 0 after EOS)",
                 hint="the softmax runs over the keys, the last axis of hook_pattern: a row is one query's "
                 "distribution; rows after the completion's first EOS are 0", check_grad=False)
    query = samples.prompt_len - 1 + torch.arange(shape[3])
    later = torch.arange(shape[4])[None, :] > query[:, None]  # [gen, seq]: keys after the query
    on_later = got[..., later].abs().max().item()
    expect(on_later == 0.0, "the attention paid to later positions", f"up to {on_later:.3g} of a row goes to key "
           "positions after its query, which a causal model never reads" + aside(
               "Common causes: the query and key axes swapped, or rows taken from the wrong positions."),
           observed=round(on_later, 4))


@exercise("answer_attention")
def test_answer_attention_hooks_inputs_and_gradient(impl, tiny_model):
    samples = _samples(tiny_model)
    lora_model = lora_model_with_random_B(tiny_model, 8, targets=("q",))
    for label, model in (("the bare model", tiny_model), ("a LoRA model", lora_model)):
        out = assert_inputs_unchanged(impl.answer_attention, model, samples, what=f"answer_attention({label})")
        assert_hooks_clean(model, lambda model=model: impl.answer_attention(model, samples),
                           f"answer_attention({label})")
    carries = isinstance(out, Tensor) and out.requires_grad
    expect(not carries, "the gradient of answer_attention", "the patterns carry a gradient: they are for looking at, "
           "so compute them under torch.no_grad() and keep them detached", observed=carries)


# --- the experiment, in its smoke setting ------------------------------------------------------------------------

@pytest.mark.slow
def test_policy_shift_experiment_in_its_smoke_setting():
    from solutions.part6_lab import policy_shift

    result = policy_shift.run(seeds=[0], smoke=True)
    figures = policy_shift.summarize(result)
    ablation = figures["layer_ablation"]
    expect({"all", "none", "without", "only"} <= set(ablation), "the keys of layer_ablation",
           f"expected all, none, without and only, got {sorted(ablation)}", observed=sorted(ablation))
    assert_equal([len(ablation["without"]), len(ablation["only"])], [4, 4], "one 'without' and one 'only' per block")
    shares = figures["policy_shift"]["attention_shares_before"]
    assert_close(torch.tensor(sum(shares.values())), torch.tensor(1.0), "the attention shares before RL, summed over "
                 "the key categories", atol=2e-3)
    import matplotlib.pyplot as plt

    plt.close(policy_shift.plot(result))
