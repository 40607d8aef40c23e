"""A user's DeepSpeed script for tests/test_user_script.py: an HF causal LM built from a config (random weights), handed
to `mist_ds.initialize` as a DeepSpeed user hands it to `deepspeed.initialize`, trained with the usual loop
(`engine(...).loss`, `engine.backward`, `engine.step`). With --census OUT it also counts, in the engine, what four
steps did (tests/hf_engine_worker.py census_of_steps) and how often each block ran forward in the counted step
(recompute runs a block's forward again in the backward), and rank 0 writes every rank's counts to OUT.

    mist-deepspeed --autotune-mist run --num_gpus 2 --mist model.seq_len=32 --mist cluster=cpu \
        tests/user_hf_script.py --model_config DIR [--census OUT.json] [--deepspeed --deepspeed_config CFG]
"""
import argparse
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import mist_ds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package, for the census helper


def count_block_forwards(model) -> list[int]:
    """Per block, the forward calls of its first submodule (recompute included: HF checkpoints `forward`, so the
    block's own hooks fire once, its submodules' again on the replay)."""
    _, blocks = next((name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList))
    counts = [0] * len(blocks)
    for i, block in enumerate(blocks):
        first = next(block.children())
        first.register_forward_pre_hook(lambda module, args, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def micro_batches(vocab: int, b: int, seq_len: int, count: int, seed: int) -> list[torch.Tensor]:
    """`count` micro-batches of token ids (b, seq_len), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (b, seq_len), generator=generator) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_config", required=True)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--census", default=None)
    parser.add_argument("--pipeline", action="store_true", help="step with engine.train_batch (pp > 1 may be planned)")
    parser.add_argument("--local_rank", type=int, default=-1)
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_config))
    forwards = count_block_forwards(model)
    engine, _, _, _ = mist_ds.initialize(args=args, model=model, model_parameters=model.parameters(),
                                         pipeline=args.pipeline)
    dp_rank, _ = mist_ds.data_parallel(engine)
    b, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    def step(seed: int) -> float:
        batches = micro_batches(model.config.vocab_size, b, args.seq_len, accum, seed + dp_rank)
        if args.pipeline:
            return float(engine.train_batch(iter([(tokens, tokens) for tokens in batches])))
        total = 0.0
        for tokens in batches:
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        return total / accum

    if args.census is None:
        for seed in range(3):
            loss = step(seed)
            if torch.distributed.get_rank() == 0:
                print(f"loss {loss!r}", flush=True)
        return
    from mist_ds.script.settings import settings_from_environment
    from mist_ds.plan import load_plan
    from tests.hf_engine_worker import census_of_steps

    par = load_plan(settings_from_environment().plan).strategy.parallelism
    counted_step = []

    def observed(seed: int) -> float:
        forwards[:] = [0] * len(forwards)
        loss = step(seed)
        counted_step[:] = list(forwards)
        return loss

    result = census_of_steps(engine, par, observed, os.path.basename(args.model_config))
    result["block_forwards"] = counted_step
    results = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(results, result)
    if torch.distributed.get_rank() == 0:
        Path(args.census).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
