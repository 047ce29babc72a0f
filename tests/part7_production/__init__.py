"""Tests of Part 7's exercises (the bridge to production), one module per topic. The exercise tests run against
`impl` (see utils/harness.py) and compare with the reference; what needs peft, accelerate or TRL is skipped, with the
reason, without them (pip install -r requirements-bench.txt).

    test_fuse_qkv.py         the exercise fuse_qkv: q, k and v adapters as one LoRA on GPT-2's fused c_attn
    test_split_qkv.py        the exercise split_qkv: a c_attn LoRA as three course adapters
    test_peft_state_dict.py  the exercise peft_state_dict: course adapters as the tensors of a peft adapter file
    test_peft_export.py      the provided export_peft_adapter (and the script), against peft's own models, on GPT-2
                             and on the Llama-style model (its q_proj, ..., down_proj)
    test_peft_import.py      the provided import_peft_adapter: folders peft wrote read back, and its refusals (both
                             architectures)
    test_peft_round_trip.py  export -> import -> export writes the same files; a LoraConfig rebuilt from the
                             course's r and alpha computes our logits and takes our gradient step (both)
    test_trl_config.py       the knob table and the exercise to_trl_config, against the reference (no TRL needed)
    test_lora_config.py      to_lora_config (GPT-2's and the Llama-style model's modules) and the knob table's peft
                             names, against the installed peft
    test_trl_script.py       the TRL run's pieces that need no TRL: its prompts, its accuracy, its flags, the
                             accelerate configs
    test_against_trl.py      against the installed TRL (the whole module is skipped without it)
    test_meta.py             the tests of these tests (tests/meta.py)
    mistakes.py              the known wrong versions of each exercise, and the REGISTRY that names them
    common.py                what several of these modules share
    test_data_parallel.py    data parallelism under `accelerate`, measured here
    test_deep_models.py      peft_state_dict on a model with 12 blocks: two-digit layer keys
    test_generated.py        each exercise on inputs drawn from its contract (tests/generated.py)
"""

from tests.part7_production.mistakes import REGISTRY  # noqa: F401
