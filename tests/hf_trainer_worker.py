"""Rank side of tests/test_hf_trainer_run.py: a Hugging Face model built from its config (random weights, no
download) trained by Hugging Face Trainer with the two files `mist-ds tune tuner.target=hf-trainer` wrote, exactly as
a user's Trainer script takes them; the rank reports what the engine Trainer built runs (micro-batch, accumulation,
ZeRO stage, AutoTP degree, optimizer steps) and how many decoder blocks ran their forward again in the backward."""
from __future__ import annotations

import json
from pathlib import Path

import torch

SEED = 0
STEPS = 3


def hf_trainer_worker(rank: int, world_size: int, payload: dict) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from mist_ds.runtime import join_process_group

    join_process_group()  # gloo without DeepSpeed's JIT-built shared-memory op; Trainer joins the group it finds
    plan = Path(payload["plan_dir"])
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(payload["hf_config"]))
    blocks = model.model.layers
    forwards = [0] * len(blocks)

    def counted(index: int, forward):
        def counting(*args, **kwargs):
            forwards[index] += 1
            return forward(*args, **kwargs)
        return counting

    # A recomputed block's forward runs again in the backward. transformers 5.25 checkpoints the block's `forward`
    # (modeling_layers.GradientCheckpointingLayer), and torch's non-reentrant recompute runs no forward hooks: the
    # block's MLP's own forward is counted instead, on the instance (the engine's hooks still run around it).
    for i, block in enumerate(blocks):
        block.mlp.forward = counted(i, block.mlp.forward)
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, model.config.vocab_size, (payload["samples"], payload["seq_len"]), generator=generator)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(output_dir=payload["out_dir"], deepspeed=str(plan / "ds_config.json"),
                             **json.loads((plan / "trainer_args.json").read_text()),
                             max_steps=STEPS, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                             seed=SEED)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    engine = trainer.model_wrapped
    micro_batches = STEPS * engine.gradient_accumulation_steps()
    autotp = engine.autotp_size() or 1  # DeepSpeed's 0: AutoTP off, one rank per model copy
    return {"engine": type(engine).__name__, "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
            "grad_accum": engine.gradient_accumulation_steps(), "zero_stage": engine.zero_optimization_stage(),
            "autotp_size": autotp, "world_size": torch.distributed.get_world_size(),
            "global_steps": engine.global_steps,
            "recomputed_blocks": sum(count > micro_batches for count in forwards),
            "forwards": forwards, "micro_batches": micro_batches,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
