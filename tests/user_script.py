"""A user's DeepSpeed script for tests/test_user_script.py: a model handed to `mist_ds.initialize` as a DeepSpeed user
hands it to `deepspeed.initialize`, trained with the usual loop (engine(...), engine.backward, engine.step; or
engine.train_batch with --pipeline). The model: an HF causal LM built from a config (--model_config, random
weights, its own loss), or a plain nn.Module from a function (--module pkg.mod:make, logits out, the loop's own
next-token cross entropy). With --training_data the model's data is a dataset handed to mist_ds.initialize (dicts of
input_ids, labels, position_ids, as an HF collator makes them) and the loop steps through the dataloader it returns,
`engine(**batch).loss`, printing each step's loss averaged over the ranks and DeepSpeed's gradient norm (what a
sequence-parallel plan is compared with an sp 1 plan by). With --census OUT it also counts, in the engine, what four
steps did (mist_ds/observe/steps.py) and how often each block ran forward in the counted step (recompute runs a
block's forward again in the backward), and rank 0 writes every rank's counts to OUT; otherwise rank 0 prints each
step's loss.

    mist-deepspeed --autotune-mist run --num_gpus 2 --mist model.seq_len=32 --mist cluster=cpu \
        tests/user_script.py --model_config DIR [--census OUT.json] [--deepspeed --deepspeed_config CFG]
"""
import argparse
import importlib
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import mist_ds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # --module tests.test_user_module:make_gpt


def build_model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    if args.module:
        module, _, function = args.module.partition(":")
        return getattr(importlib.import_module(module), function)()
    attention = {"attn_implementation": args.attn} if args.attn else {}
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_config), **attention)


class TokenSequences(torch.utils.data.Dataset):
    """`count` sequences of random token ids (seed 0), each a dict as an HF data collator makes them: input_ids,
    labels and (unless `positions` is off) position_ids."""

    def __init__(self, vocab: int, seq_len: int, count: int, positions: bool = True) -> None:
        self.tokens = torch.randint(0, vocab, (count, seq_len), generator=torch.Generator().manual_seed(0))
        self.positions = positions

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {"input_ids": self.tokens[i], "labels": self.tokens[i]}
        if self.positions:
            item["position_ids"] = torch.arange(len(self.tokens[i]))
        return item


def micro_batches(vocab: int, b: int, seq_len: int, count: int, seed: int) -> list[torch.Tensor]:
    """`count` micro-batches of token ids (b, seq_len), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (b, seq_len), generator=generator) for _ in range(count)]


def count_block_forwards(model) -> list[int]:
    """Per block (the model's longest ModuleList), the forward calls of its first submodule (recompute included: a
    checkpointed block's own hooks fire once, its submodules' again on the replay)."""
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    counts = [0] * len(blocks)
    for i, block in enumerate(blocks):
        first = next(block.children())
        first.register_forward_pre_hook(lambda module, args, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_config", default=None)
    parser.add_argument("--module", default=None, help="pkg.mod:function building a plain nn.Module")
    parser.add_argument("--own_loss", action="store_true",
                        help="the module computes its loss given targets: logits, loss = engine(tokens, targets)")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--census", default=None)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (without --census)")
    parser.add_argument("--fail_on_rank", type=int, default=None, help="this rank raises in its second step")
    parser.add_argument("--batch", type=int, default=None, help="the loop's own batch size (default: the engine's)")
    parser.add_argument("--pipeline", action="store_true", help="step with engine.train_batch (pp > 1 may be planned)")
    parser.add_argument("--training_data", action="store_true",
                        help="hand a dataset to mist_ds.initialize and step through the dataloader it returns")
    parser.add_argument("--no_position_ids", action="store_true", help="the dataset's samples lack position_ids")
    parser.add_argument("--own_batches", action="store_true",
                        help="the loop draws its own dict batches, sliced by mist_ds.sequence_shards")
    parser.add_argument("--attn", default=None, help="the HF model's attn_implementation (default: transformers')")
    parser.add_argument("--local_rank", type=int, default=-1)
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    model = build_model(args)
    vocab = model.config.vocab_size if args.model_config else model.lm_head.out_features
    forwards = count_block_forwards(model)
    data = TokenSequences(vocab, args.seq_len, 256, not args.no_position_ids) if args.training_data else None
    engine, _, loader, _ = mist_ds.initialize(args=args, model=model, model_parameters=model.parameters(),
                                              training_data=data, pipeline=args.pipeline)
    dp_rank, _ = mist_ds.data_parallel(engine)
    b, accum = args.batch or engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    drawn = iter(loader) if loader is not None else None
    grad_norms = []  # DeepSpeed's own norm of each step's reduced gradient

    def dataset_step() -> float:  # as a DeepSpeed user steps through the dataloader: engine(**batch).loss
        total = 0.0
        for _ in range(accum):
            loss = engine(**{key: value.to(engine.device) for key, value in next(drawn).items()}).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        grad_norms.append(float(engine.get_global_grad_norm()))
        return total / accum

    def own_batches_step(seed: int) -> float:  # a loop drawing its own data: the lines docs/design.md gives
        rank, size = mist_ds.data_parallel(engine)
        draws = engine.train_batch_size() // (b * size)  # G / sp batches of the global b G d (G at sp 1)
        positions = torch.arange(args.seq_len).repeat(b, 1)
        batches = [{"input_ids": tokens, "labels": tokens, "position_ids": positions}
                   for tokens in micro_batches(vocab, b, args.seq_len, draws, 100 * seed + rank)]
        total = 0.0
        for batch in mist_ds.sequence_shards(engine, batches):
            loss = engine(**{key: value.to(engine.device) for key, value in batch.items()}).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        grad_norms.append(float(engine.get_global_grad_norm()))
        return total / accum

    def loss_of(tokens: torch.Tensor) -> torch.Tensor:
        if args.model_config:
            return engine(input_ids=tokens, labels=tokens).loss
        if args.own_loss:  # nanoGPT's loop: `logits, loss = model(X, Y)`
            return engine(tokens, tokens)[1]
        logits = engine(tokens)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    def step(seed: int) -> float:
        if drawn is not None:
            return dataset_step()
        if args.own_batches:
            return own_batches_step(seed)
        batches = micro_batches(vocab, b, args.seq_len, accum, seed + dp_rank)
        if args.pipeline:
            return float(engine.train_batch(iter([(tokens, tokens) for tokens in batches])))
        total = 0.0
        for tokens in batches:
            loss = loss_of(tokens)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        return total / accum

    if args.census is None:
        for seed in range(args.steps):
            if seed == 1 and torch.distributed.get_rank() == args.fail_on_rank:
                raise RuntimeError(f"rank {args.fail_on_rank} fails in its second step, as the test asked")
            loss = step(seed)
            if grad_norms:  # the step's mean over every rank's micro-batches, and DeepSpeed's gradient norm
                mean = torch.tensor(loss, dtype=torch.float64)
                torch.distributed.all_reduce(mean)
                loss = float(mean) / torch.distributed.get_world_size()
            if torch.distributed.get_rank() == 0:
                norm = f" grad_norm {grad_norms[-1]!r}" if grad_norms else ""
                print(f"loss {loss!r}{norm}", flush=True)
        return
    from mist_ds.observe.steps import census_of_steps
    from mist_ds.plan import load_plan
    from mist_ds.script.settings import settings_from_environment

    par = load_plan(settings_from_environment().plan).strategy.parallelism
    counted_step = []

    def observed(seed: int) -> float:
        forwards[:] = [0] * len(forwards)
        loss = step(seed)
        counted_step[:] = list(forwards)
        return loss

    result = census_of_steps(engine, par, observed, args.model_config or args.module)
    result["block_forwards"] = counted_step
    result["grad_norms"] = grad_norms
    results = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(results, result)
    if torch.distributed.get_rank() == 0:
        Path(args.census).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
