"""What several of Part 3's test modules share: a LoRA model whose adapters change the model, NaN (an unscorable
completion's reward), the loss settings that the grpo_loss tests and the TRL comparison go through, and what an
exception raised by an async reward function usually means."""

import itertools


from tests import support

NAN = float("nan")

SETTINGS = [dict(loss_type=lt, beta=beta, epsilon_high=eh, use_bias_correction_kl=bc)
            for lt, beta, eh, bc in itertools.product(["grpo", "bnpo", "dapo", "dr_grpo"], [0.0, 0.04], [None, 0.28],
                                                      [False, True]) if not (beta == 0 and bc)]


def lora_model_with_random_B(model, seed=0):
    """A LoRAModel whose adapters change the model (B drawn at random, not 0), on all four attention targets."""
    return support.lora_model_with_random_B(model, seed, targets=("q", "k", "v", "o"), reseed=True)


def async_reward_cause(text: str) -> str:
    """What an exception's text usually means when a reward function is async (for tests.support.calling's
    explain=): compose_rewards runs the reward functions, in its own test and inside grpo_step."""
    if "coroutine" in text:
        return ("A reward function defined with `async def` returns a coroutine, not its rewards: the rewards "
                "exist only once it is awaited (asyncio.gather over the async functions, run with run_sync)")
    if "running event loop" in text:
        return ("asyncio.run refuses to start inside a running event loop, which is where every Jupyter cell "
                "runs: run the coroutine with run_sync (from utils.concurrency), which works in both places")
    return ""
