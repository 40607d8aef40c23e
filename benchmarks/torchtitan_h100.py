"""torchtitan's Llama 3.1 8B FSDP runs on 8 and 128 H100 against mist_ds's ZeRO-3 prediction; the 70B-on-768-H100
case (issue 29) tuned.

    .venv/bin/python -m benchmarks.torchtitan_h100 > benchmarks/results/torchtitan_h100.md

Rows: benchmarks/reference/torchtitan_llama3_h100.csv, the bf16 rows without torch.compile or Float8 of
pytorch/torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bf): "FSDP" of Table 1 (8 GPUs) and
Table 3 (128 GPUs), every such row of the file (its 70B and 405B rows all use torch.compile and Float8). Named
before any error was looked at, as the priced strategy: executor `deepspeed`, ZeRO-3 over dp = GPUs (FSDP shards
parameters, gradients and optimizer states as ZeRO-3 does), t 1, pp 1, b 2 (the local batch), G 1, bf16,
sequence 8192 (torchtitan's llama3_8b.toml), recompute 16 of 32 blocks: torchtitan's selective checkpointing
('op') recomputes every second matmul and the element-wise ops between, about half of a block's forward, and
mist_ds recomputes whole blocks. Cluster h100-80g as the zoo has it (989 TFLOP/s dense bf16, NVLink 360 GB/s,
400 GB/s network per node: 400 Gb/s per GPU as the file states), with the file's memory (96 GB HBM2e) and
HBM bandwidth (2.4 TB/s).

What differs from what torchtitan ran: FSDP2 gathers each transformer block in one all-gather and
reduce-scatters it in one call (fully_shard per block; ZeRO-3 gathers each submodule and reduces in
reduce_bucket_size buckets), reduces gradients in fp32 by default (ZeRO-3 in bf16), prefetches one block ahead;
its H100s ran at a 500 W power limit, below the SXM part's 700 W whose peak mist_ds uses (the file's own
footnote: the true peak lies between SXM and NVL). The 8B rows are compute-bound, so the power limit bears
on them directly.

The 70B case: `tune` of llama3-70b (sequence 8192) on 96 h100-80g nodes, global batch 1536, runtime deepspeed,
space mist; its plan and MFU. Published runs of that shape reach about 42% (Megatron-Core, TP and PP, overlap
on) and 38% (FSDP, Llama 3 70B), as issue 29 states.
"""
from __future__ import annotations

from benchmarks.common import mape, plan_text, predict_specs, reference_rows, results_header, specs_for

from mist_ds.config import compose
from mist_ds.tuner import tune_specs

COMMAND = ".venv/bin/python -m benchmarks.torchtitan_h100 > benchmarks/results/torchtitan_h100.md"
DATA = ("validation: rows chosen and the priced strategy stated (this docstring) before the errors were seen; no "
        "constant fitted on them; the H100's GEMM efficiency is carried from the A100 fit and the published MAMF "
        "(h100-80g.yaml), its other constants are the zoo's estimates")
REFERENCE = "torchtitan_llama3_h100"
GB, GIB = 1e9, 2**30
FILE_GPU = {"memory_bytes": 96e9, "hbm_bytes_per_s": 2.4e12}  # the file's H100: 96 GB HBM2e at 2.4 TB/s
MODEL = ("model=llama3-8b", "cluster=h100-80g", "train.precision=bf16")
RECOMPUTED_BLOCKS = 16  # of 32: selective 'op' checkpointing recomputes about half of each block's forward
SEQUENCE = 8192
BIG_NODES, BIG_GLOBAL_BATCH = 96, 1536
PUBLISHED_MFU = (("Megatron-Core, TP and PP, overlap on", 0.42), ("FSDP, Llama 3 70B", 0.38))  # as issue 29 states
BIG_CASE = ("model=llama3-70b", "cluster=h100-80g", "train.precision=bf16", f"cluster.nodes={BIG_NODES}",
            f"train.global_batch_size={BIG_GLOBAL_BATCH}", "tuner.runtime=deepspeed")


def row_specs(row: dict, recompute=RECOMPUTED_BLOCKS):
    gpus = int(row["gpus"])
    return specs_for(MODEL, nodes=int(row["nodes"]), gpus_per_node=gpus // int(row["nodes"]),
                     global_batch=int(row["global_batch"]), gpu_changes=FILE_GPU, runtime="deepspeed", dp=gpus,
                     tp=1, pp=1, micro_batch_size=int(row["local_batch"]), grad_accum=1, zero_stage=3,
                     ckpt_layers=recompute)


def main() -> None:
    rows = reference_rows(REFERENCE)
    print(results_header("torchtitan Llama 3.1 8B FSDP on H100 (bf16) and the 70B-on-768-H100 plan", COMMAND, DATA))
    print("Rows: every bf16 row without torch.compile or Float8 of torchtitan's "
          "benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bf); strategy and what differs: the module "
          "docstring of benchmarks/torchtitan_h100.py.\n")
    print("| table | GPUs | nodes | measured TPS/GPU | predicted TPS/GPU | error | MFU predicted | "
          "no recompute | all 32 recomputed | measured GiB | predicted peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    predicted, measured = [], []
    for row in rows:
        gpus = int(row["gpus"])
        p = predict_specs(row_specs(row))
        bracket = [predict_specs(row_specs(row, c)).tokens_per_s / gpus for c in (0, 32)]
        tps = p.tokens_per_s / gpus
        predicted.append(tps)
        measured.append(float(row["tps_per_gpu"]))
        print(f"| {row['table']} | {gpus} | {row['nodes']} | {measured[-1]:,.0f} | {tps:,.0f} | "
              f"{tps / measured[-1] - 1:+.1%} | {p.mfu:.1%} | {bracket[0]:,.0f} | {bracket[1]:,.0f} | "
              f"{float(row['memory_gib']):.1f} | {max(p.peak_memory_bytes) / GIB:.1f} |")
    print(f"\nMAPE of TPS/GPU over the {len(rows)} rows: {mape(predicted, measured):.1%} (one of them, 128 GPUs on 16 "
          f"nodes, is multi-node). Fewer than 6 strategies of one model: no Spearman.\n")

    result = tune_specs(compose(list(BIG_CASE)), progress=False, baselines=False)
    plan = result.prediction
    print(f"## The 70B-on-768-H100 case\n\n`mist-ds tune model=llama3-70b cluster=h100-80g cluster.nodes={BIG_NODES} "
          f"train.global_batch_size={BIG_GLOBAL_BATCH}` (sequence {SEQUENCE}, bf16, runtime deepspeed):\n")
    print("| plan | iteration s | MFU | HFU |")
    print("|---|---|---|---|")
    print(f"| {plan_text(result.search.best)} | "
          f"{plan.iteration_time_s:.3f} | {plan.mfu:.1%} | {plan.hfu:.1%} |")
    best_name, best_mfu = max(PUBLISHED_MFU, key=lambda pair: pair[1])
    published = "; ".join(f"{name} {mfu:.0%}" for name, mfu in PUBLISHED_MFU)
    verdict = "at or below" if plan.mfu <= best_mfu else f"{(plan.mfu - best_mfu) * 100:.1f} MFU points above"
    print(f"\nPublished runs of that shape: {published}. The tuned plan's predicted MFU is {verdict} the best "
          f"({best_name}).")


if __name__ == "__main__":
    main()
