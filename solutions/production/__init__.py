"""Part 7's runs with production tools (TRL, peft, accelerate): scripts, configs and the knob mapping.

    knobs.py               every field of our GRPOConfig -> its trl.GRPOConfig (or peft.LoraConfig) name, or why none
    trl_grpo.py            the main job with TRL's GRPOTrainer + peft, next to ours: held-out accuracy of both
    accelerate_configs/    `accelerate launch --config_file ...`: one CPU process; DDP on several GPUs; DeepSpeed
                           ZeRO-3; FSDP2 (only the first is run here; the others are stated, not measured)

    python -m solutions.production.trl_grpo --seed 0 --json      # needs pip install -r requirements-bench.txt
    accelerate launch --config_file solutions/production/accelerate_configs/cpu_1proc.yaml \\
        -m solutions.production.trl_grpo --trl-only --steps 5
"""
