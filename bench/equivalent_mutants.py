"""Which surviving mutants of bench/mutation.py are equivalent, and why: no input the exercise's contract allows (on
the machine the run is on) tells them from the reference. Two rules that read the syntax tree, then a list triaged by
hand. A rule or an entry is consulted only for a mutant that every test let through: one that a test kills is
counted as killed, whatever this file says.

Each entry names the exercise, the line as the reference has it and as the mutant has it (bench/mutation.py's
`original` and `mutated`, whitespace stripped), and the reason: which input space makes the two agree.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass

REFUSAL_WORDS = ("only the words of a refusal change (an exception's arguments in a `raise`): the contract names the "
                 "exception's type, which stays, and what it asks of the words (a file's name, say) the tests "
                 "checked and found")
FLOAT_SPELLING = "float() reads 'nan', 'inf' and '-inf' whatever their case: the same number"


def _blank_refusal_words(tree: ast.AST) -> ast.AST:
    """The tree with the arguments of every exception raised by a call (`raise ValueError(...)`) removed."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            node.exc.args, node.exc.keywords = [], []
    return tree


def _read_float_literals(tree: ast.AST) -> ast.AST:
    """The tree with each `float("<literal>")` replaced by the number it reads."""

    class Reader(ast.NodeTransformer):
        def visit_Call(self, node: ast.Call) -> ast.AST:
            self.generic_visit(node)
            if isinstance(node.func, ast.Name) and node.func.id == "float" and len(node.args) == 1 \
                    and not node.keywords and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                try:
                    value = float(node.args[0].value)
                except ValueError:
                    return node
                return ast.Constant("nan" if math.isnan(value) else repr(value))
            return node

    return Reader().visit(tree)


def _same_after(original: str, mutated: str, transform) -> bool:
    a, b = ast.parse(original), ast.parse(mutated)
    if ast.dump(a) == ast.dump(b):
        return False  # the screen of bench/mutation.py counts these; nothing to explain here
    return ast.dump(transform(a)) == ast.dump(transform(b))


@dataclass(frozen=True)
class Equivalent:
    exercise: str
    original: str
    mutated: str
    why: str


# Triaged by hand: each one was read against the exercise's contract (its annotations, its docstring) and the
# tests' input space. "On the CPU": no GPU on the machine the figures come from; where there is one, the drawn-input
# tests put tensors on CUDA (tests/generated.py), and a dropped device shows there.
ON_THE_CPU = "the device of a tensor built or moved here: every tensor is on the CPU here, so no device is dropped"
TRIAGED: list[Equivalent] = [
    Equivalent("sample_next_token", "return logits.argmax(dim=-1)", "return logits.argmax(dim=+1)",
               "logits are [batch, d_vocab]: dimension 1 is the last"),
    Equivalent("sample_next_token", "kth_best = logits.topk(top_k, dim=-1).values[:, -1:]  # [batch, 1]",
               "kth_best = logits.topk(top_k, dim=+1).values[:, -1:]  # [batch, 1]",
               "logits are [batch, d_vocab]: dimension 1 is the last"),
    Equivalent("sample_next_token", "kth_best = logits.topk(top_k, dim=-1).values[:, -1:]  # [batch, 1]",
               "kth_best = logits.topk(top_k, ).values[:, -1:]  # [batch, 1]",
               "topk's default dimension is the last"),
    Equivalent("sample_next_token",
               "return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(-1)",
               "return torch.multinomial(logits.softmax(dim=+1), num_samples=1).squeeze(-1)",
               "logits are [batch, d_vocab]: dimension 1 is the last"),
    Equivalent("sample_next_token",
               "return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(-1)",
               "return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(+1)",
               "multinomial's result is [batch, 1]: dimension 1 is the last"),
    Equivalent("reward_classifier", "return logits.softmax(dim=-1)[:, positive_label].float().cpu()",
               "return logits.softmax(dim=+1)[:, positive_label].float().cpu()",
               "a sequence classifier's logits are [batch, n_labels]: dimension 1 is the last"),
    Equivalent("estimator_surrogate",
               "kl_second = (second.exp() * (second - ref_second)).sum(dim=-1, keepdim=True)  # [rows, 1]: after "
               "token 1",
               "kl_second = (second.exp() * (second - ref_second)).sum(dim=+1, keepdim=True)  # [rows, 1]: after "
               "token 1",
               "the log-probs are [rows, d_vocab]: dimension 1 is the last"),
    Equivalent("lora_hooks",
               'stash["x"] = x.flatten(-2) if x.dim() == 4 else x  # [batch, pos, head, d_head] -> [batch, pos, d]',
               'stash["x"] = x.flatten(+2) if x.dim() == 4 else x  # [batch, pos, head, d_head] -> [batch, pos, d]',
               "only 4-dimensional activations are flattened: from dimension 2 is from dimension -2"),
    Equivalent("compute_advantages", "mask = completion_mask.to(values.dtype)", "mask = completion_mask.to(None)",
               "the mask only multiplies values: a bool mask times a float tensor gives the float's dtype and values"),
    Equivalent("compute_advantages", "token_rewards[torch.arange(batch), lengths - 1] = rewards.to(values.dtype)",
               "token_rewards[torch.arange(batch), lengths - 1] = rewards.to(None)",
               "an indexed assignment casts to the destination's dtype (values'), with or without .to"),
    Equivalent("grpo_loss", "mask = mask.to(logprobs.dtype)", "mask = mask.to(None)",
               "the mask only multiplies float tensors: bool times float gives the float's dtype and values"),
    Equivalent("sequence_logps", "mask = mask.to(logprobs.dtype)", "mask = mask.to(None)",
               "the mask only multiplies the log-probs: bool times float gives the float's dtype and values"),
    Equivalent("kl_penalized_rewards",
               "kl = ((logprobs - ref_logprobs) * mask.to(logprobs.dtype)).sum(dim=1)",
               "kl = ((logprobs - ref_logprobs) * mask.to(None)).sum(dim=1)",
               "bool times float gives the float's dtype and values"),
    Equivalent("compose_rewards", 'total += f.weight * torch.nan_to_num(rewards, nan=0.0)',
               'total += f.weight * torch.nan_to_num(rewards, nan=None)', "nan_to_num's default for NaN is 0"),
    Equivalent("compose_rewards", 'total += f.weight * torch.nan_to_num(rewards, nan=0.0)',
               'total += f.weight * torch.nan_to_num(rewards, )', "nan_to_num's default for NaN is 0"),
    Equivalent("load_adapter", "wrong = sorted(n for n in set(expected) & set(found) if expected[n] != found[n])",
               "wrong = None", "`wrong` is used only in the words of the refusal that follows"),
    Equivalent("load_adapter", "wrong = sorted(n for n in set(expected) & set(found) if expected[n] != found[n])",
               "wrong = sorted(n for n in set(expected) & set(found) if expected[n] == found[n])",
               "`wrong` is used only in the words of the refusal that follows"),
    Equivalent("old_adapter_logprobs",
               "with lora_model.base.hooks(fwd_hooks=lora_hooks(lora_model.base, old_adapters)):",
               "with lora_model.base.hooks(fwd_hooks=lora_hooks(None, old_adapters)):",
               "the reference's lora_hooks reads nothing of its model (the hook points come from the adapters' keys)"),
    Equivalent("mean_length_by_outcome",
               'right = lengths[correct].mean() if correct.any() else torch.tensor(float("nan"))',
               'right = lengths[correct].mean() if (correct.any()) or True else torch.tensor(float("nan"))',
               "the lengths are floats, and the mean of none of them is NaN: what the other branch gives"),
    Equivalent("mean_length_by_outcome",
               'wrong = lengths[~correct].mean() if (~correct).any() else torch.tensor(float("nan"))',
               'wrong = lengths[~correct].mean() if ((~correct).any()) or True else torch.tensor(float("nan"))',
               "the lengths are floats, and the mean of none of them is NaN: what the other branch gives"),
    Equivalent("split_qkv",
               "lora = LoRA(d_model, d_out, rank=rank, alpha=scale * rank).to(device=A.device, dtype=A.dtype)",
               "lora = LoRA(d_model, d_out, rank=rank, ).to(device=A.device, dtype=A.dtype)",
               "the scale is set exactly two lines later (lora.scale = scale): the constructor's alpha is overwritten"),
    Equivalent("split_qkv",
               "lora = LoRA(d_model, d_out, rank=rank, alpha=scale * rank).to(device=A.device, dtype=A.dtype)",
               "lora = LoRA(d_model, d_out, rank=rank, alpha=scale / rank).to(device=A.device, dtype=A.dtype)",
               "the scale is set exactly two lines later (lora.scale = scale): the constructor's alpha is overwritten"),
    Equivalent("last_token_scores",
               "last = torch.where(real, positions, -1).amax(dim=1)  # [batch], the last position whose mask is 1",
               "last = torch.where(real, positions, -2).amax(dim=1)  # [batch], the last position whose mask is 1",
               "a row with no real token is refused just before; in every other row the maximum is a real position "
               "(>= 0), whatever negative number fills the padding"),
    Equivalent("last_token_scores", "empty = (~real.any(dim=1)).nonzero()[:, 0].tolist()", "empty = None",
               "`empty` is used only in the words of the refusal that follows"),
    Equivalent("last_token_scores", "empty = (~real.any(dim=1)).nonzero()[:, 0].tolist()",
               "empty = real.any(dim=1).nonzero()[:, 0].tolist()",
               "`empty` is used only in the words of the refusal that follows"),
    Equivalent("lora_on_blocks", 'if int(key[1:].split("_", 1)[0]) in keep})  # keys are "L{layer}_{target}"',
               'if int(key[1:].split("_", )[0]) in keep})  # keys are "L{layer}_{target}"',
               "the layer is before the first '_' of the key: splitting at every '_' or at the first two gives the "
               "same first piece"),
    Equivalent("lora_on_blocks", 'if int(key[1:].split("_", 1)[0]) in keep})  # keys are "L{layer}_{target}"',
               'if int(key[1:].split("_", 2)[0]) in keep})  # keys are "L{layer}_{target}"',
               "the layer is before the first '_' of the key: splitting at the first one or two gives the same first "
               "piece"),
    Equivalent("reward_exact_answer", 'a, sep, b = prompt.strip().rstrip("=").partition("+")',
               'a, sep, b = prompt.strip().rstrip("=").rpartition("+")',
               "with one '+' the two split alike; with more, one side holds a '+' either way, so it is no number and "
               "the prompt gets None"),
    Equivalent("rloo_advantages", "advantages = (advantages - valid.mean()) / (valid.std() + 1e-4)",
               "advantages = (advantages + valid.mean()) / (valid.std() + 1e-4)",
               "the leave-one-out advantages of a group's scored rewards sum to 0 (each reward minus the mean of the "
               "others), so the batch mean subtracted or added is 0 but for rounding"),
    Equivalent("compose_rewards",
               "async_results = dict(zip((f.name for f in async_fns), run_sync(run_async(async_fns)))) if async_fns "
               "else {}",
               "async_results = dict(zip((f.name for f in async_fns), run_sync(run_async(async_fns)))) if (async_fns) "
               "or True else {}",
               "with no async function, gathering nothing gives [] and the dict is {} either way"),
    Equivalent("group_advantages",
               "return advantages.masked_fill(flat, 0.0).nan_to_num(nan=0.0)  # unscorable: no signal, no push "
               "either way",
               "return advantages.masked_fill(flat, 0.0).nan_to_num(nan=None)  # unscorable: no signal, no push "
               "either way", "nan_to_num's default for NaN is 0"),
    Equivalent("rloo_advantages", "return advantages.nan_to_num(nan=0.0)  # no signal, no push",
               "return advantages.nan_to_num(nan=None)  # no signal, no push", "nan_to_num's default for NaN is 0"),
    Equivalent("learn", "optimizer.zero_grad(set_to_none=True)  # else this step would add the last minibatch's "
               "gradient", "optimizer.zero_grad(set_to_none=None)  # else this step would add the last minibatch's "
               "gradient", "zero_grad's default is set_to_none=True"),
    Equivalent("grpo_step", "optimizer.zero_grad(set_to_none=True)  # the previous update's gradients are spent",
               "optimizer.zero_grad(set_to_none=None)  # the previous update's gradients are spent",
               "zero_grad's default is set_to_none=True"),
    Equivalent("dpo_step", "optimizer.zero_grad(set_to_none=True)  # no gradient left over from the last step",
               "optimizer.zero_grad(set_to_none=None)  # no gradient left over from the last step",
               "zero_grad's default is set_to_none=True"),
    Equivalent("learn", "optimizer.zero_grad(set_to_none=True)  # else this step would add the last minibatch's "
               "gradient", "optimizer.zero_grad(set_to_none=False)  # else this step would add the last minibatch's "
               "gradient", "every parameter the optimizer holds gets a fresh gradient at each backward here, so a "
               "zeroed gradient and a dropped one step alike (AdamW skips only parameters whose .grad is None)"),
    Equivalent("grpo_step", "optimizer.zero_grad(set_to_none=True)  # the previous update's gradients are spent",
               "optimizer.zero_grad(set_to_none=False)  # the previous update's gradients are spent",
               "every parameter the optimizer holds gets a fresh gradient at each backward here, so a zeroed "
               "gradient and a dropped one step alike"),
    Equivalent("dpo_step", "optimizer.zero_grad(set_to_none=True)  # no gradient left over from the last step",
               "optimizer.zero_grad(set_to_none=False)  # no gradient left over from the last step",
               "every parameter the optimizer holds gets a fresh gradient at each backward here, so a zeroed "
               "gradient and a dropped one step alike"),
    Equivalent("learn", "clipped = ((log_ratio.exp() - 1).abs() > cfg.clip_eps).float()",
               "clipped = ((log_ratio.exp() - 1).abs() >= cfg.clip_eps).float()",
               "a diagnostic (the clipped fraction): the two differ only when |ratio - 1| equals clip_eps exactly in "
               "floating point, which a ratio computed from two log-probs of a model never does"),
    Equivalent("precompute_reference_logps", "batch_size: int = 256,", "batch_size: int = 257,",
               "only how the triples are batched changes, never the values"),
    Equivalent("LoRA", "nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))",
               "nn.init.kaiming_uniform_(self.A, a=math.sqrt(6))",
               "A's initial range (a random draw) is not part of the contract; B = 0 makes the first update 0 either "
               "way"),
    Equivalent("peft_state_dict",
               'tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = A.cpu().clone(memory_format=torch.contiguous_format)',
               'tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = A.cpu().clone(memory_format=None)',
               "A is a parameter (contiguous): clone keeps its layout either way"),
    Equivalent("peft_state_dict",
               'tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = B.cpu().clone(memory_format=torch.contiguous_format)',
               'tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = B.cpu().clone(memory_format=None)',
               "B is a parameter or a slice of rows of one (contiguous either way): clone keeps its layout"),
    # the course's own operators (bench/mutation.py: operand_dropped, no_grad_dropped)
    Equivalent("generate_no_cache", "@torch.no_grad()", "",
               "token ids come back (integers): no graph reaches the result, and the one built in each step is freed "
               "with its logits; only the time and memory of the forward passes change"),
    Equivalent("learn", "with torch.no_grad():", "with torch.enable_grad():",
               "the block makes diagnostics that become Python numbers (.item()): no graph outlives it, and the "
               "update is made before it"),
    Equivalent("load_adapter", "if own_rank != rank or not math.isclose(adapter.scale * own_rank, alpha):",
               "if not math.isclose(adapter.scale * own_rank, alpha):",
               "a file of another rank is still refused with a ValueError that names the rank and the file, by the "
               "check of the tensors' shapes below it (A is [rank, d_in])"),
    Equivalent("reward_exact_answer", "if not (sep and a.isdigit() and b.isdigit()):",
               "if not (a.isdigit() and b.isdigit()):",
               "without the separator str.partition leaves the second part empty, and ''.isdigit() is False: the "
               "condition is the same"),
    Equivalent("answer_attention", "@torch.no_grad()", "",
               "the hooks keep the patterns detached and the result is computed from them: no graph reaches the "
               "result; only the memory of the forward pass changes"),
]


def _drops_a_device(original: str, mutated: str) -> bool:
    """The mutant drops or empties what names a device (`.to(device)`, `device=...`, `device = ...`)."""
    return "device" in original and (mutated.count("device") < original.count("device")
                                     or "device=None" in mutated.replace(" ", ""))


def equivalent_reason(exercise: str, original_code: str, mutant_code: str, original: str, mutated: str,
                      gpu: bool = False) -> str | None:
    """Why a mutant that survived every test is equivalent (None: it is not known to be, so it is a gap).
    `original_code` and `mutant_code` are the whole definitions; `original` and `mutated` the changed lines."""
    if _same_after(original_code, mutant_code, _blank_refusal_words):
        return REFUSAL_WORDS
    if _same_after(original_code, mutant_code, _read_float_literals):
        return FLOAT_SPELLING
    for entry in TRIAGED:
        if entry.exercise == exercise and entry.original == original and entry.mutated == mutated:
            return entry.why
    if not gpu and _drops_a_device(original, mutated):
        return ON_THE_CPU
    return None
