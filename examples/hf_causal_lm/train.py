"""Train any Hugging Face causal LM with the plan mist_ds makes for it: a DeepSpeed script whose one changed line is
`mist_ds.initialize` (in place of `deepspeed.initialize`).

    # plan for 2 ranks, then train (CPU ranks: DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 first; on GPUs drop them):
    mist-deepspeed --autotune-mist run --num_gpus 2 --mist model.seq_len=128 --mist cluster=cpu \
        --mist train.global_batch_size=8 train.py --model_config path/to/config.json --steps 20
    # plan only (plan files and cmd.txt in outputs/...), measuring the best 3 plans first:
    mist-deepspeed --autotune-mist tune --num_gpus 2 --mist model.seq_len=128 --mist cluster=cpu \
        --mist train.global_batch_size=8 --mist tuner.verify_top_n=3 train.py --model_config path/to/config.json
    # your own batch, optimizer and precision: a DeepSpeed config, as usual (its train_batch_size the global batch;
    # the plan sets micro-batch and accumulation, ZeRO, offload, AutoTP):
    mist-deepspeed --autotune-mist run --num_gpus 2 --mist model.seq_len=128 --mist cluster=cpu \
        train.py --model_config path/to/config.json --deepspeed --deepspeed_config my_ds_config.json

--model_config: a config.json (or a folder holding one); the weights are random (from_config). Data: random
token ids, as a stand-in for your dataset, each sample a dict as an HF data collator makes one (input_ids, labels,
position_ids), so that a plan with sequence parallelism (sp > 1: DeepSpeed's Ulysses) runs it too.
"""
import argparse

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import mist_ds


class RandomTokens(torch.utils.data.Dataset):
    """`count` sequences of `seq_len` token ids below `vocab` (a fixed seed: every rank sees the same data), with
    their labels and positions."""

    def __init__(self, vocab: int, seq_len: int, count: int) -> None:
        self.tokens = torch.randint(0, vocab, (count, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[i]
        return {"input_ids": tokens, "labels": tokens, "position_ids": torch.arange(len(tokens))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_config", required=True, help="config.json (or its folder) of an HF causal LM")
    parser.add_argument("--seq_len", type=int, default=128, help="tokens per sequence (plan with the same)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--local_rank", type=int, default=-1)
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_config))
    data = RandomTokens(model.config.vocab_size, args.seq_len, count=4096)
    engine, _, loader, _ = mist_ds.initialize(args=args, model=model, model_parameters=model.parameters(),
                                              training_data=data)
    batches, printed = iter(loader), 0
    while engine.global_steps < args.steps:
        loss = engine(**{key: value.to(engine.device) for key, value in next(batches).items()}).loss
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0 and engine.global_steps > printed:  # an optimizer step was taken
            printed = engine.global_steps
            print(f"step {printed} loss {loss.item():.4f}", flush=True)

if __name__ == "__main__":
    main()
