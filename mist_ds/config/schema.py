"""Hydra structured-config schemas: one dataclass per config group, a doc line per field.

Values live in YAML under `conf/` (shipped as `mist_ds.conf`); each YAML extends its schema through
its defaults list, so a mistyped key or a wrong type fails at load. Units: datasheet units in the
names (GiB, GB/s = 1e9 bytes/s, TFLOP/s); `mist_ds.config.convert` turns them into SI specs once.

Polymorphic strategy fields (a scalar for every stage, or a list with one value per stage; or the
words full / none) are typed `Any` because OmegaConf has no unions; `mist_ds.specs.strategy` checks
them and names the field on error; so is `cluster.other_runnable_threads` (a number or the word now, checked by
`mist_ds.config.convert`). They are the only `Any` fields (tests/test_conventions.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


@dataclass
class ModelConfig:
    name: Optional[str] = None  # zoo name, e.g. gpt3-1.3b; free text for your own model; null (hf) = its folder or id
    family: str = MISSING  # gpt | llama | falcon: the zoo's reference layers; hf: a Hugging Face config;
    #                        module: your nn.Module
    hidden_size: Optional[int] = None  # model width h (zoo: required; hf: from its config)
    num_layers: Optional[int] = None  # transformer blocks L (zoo: required; hf: from its config)
    num_heads: Optional[int] = None  # query heads a (zoo: required; hf: from its config; module: from its blocks,
    #                                  else required)
    num_kv_heads: Optional[int] = None  # KV heads for grouped / multi-query attention; null = num_heads
    ffn_hidden_size: Optional[int] = None  # MLP width; null = 4h (gpt, falcon) or 8h/3 rounded up to 256 (llama)
    vocab_size: Optional[int] = None  # embedding rows V (zoo: required; pad to 128 x tp as Megatron-LM does)
    seq_len: int = MISSING  # tokens per sequence s; also the size of gpt's learned position table
    tie_embeddings: Optional[bool] = None  # LM head shares the token-embedding weight (zoo: required; hf: its config)
    flash_attention: bool = True  # fused attention (saves q, k, v, out, logsumexp) instead of explicit softmax
    dropout: float = 0.0  # dropout probability after attention probs, attention out and MLP out
    name_or_path: Optional[str] = None  # hf: a folder holding config.json, a config.json, or a model id in the HF cache
    attn_implementation: str = "sdpa"  # hf: the attention your model runs: sdpa | eager | flash_attention_2
    hf: Dict[str, Any] = field(default_factory=dict)  # hf: fields of its config to change,
    #                                                   e.g. +model.hf.num_hidden_layers=4
    frozen: List[str] = field(default_factory=list)  # hf: parameters your script freezes (fnmatch on names),
    #                                                  e.g. ['model.layers.*.self_attn.*']
    _target_: Optional[str] = None  # module: import path of a function returning your nn.Module
    #                                 (called on the meta device)
    kwargs: Dict[str, Any] = field(default_factory=dict)  # module: keyword arguments of model._target_,
    #                                                       e.g. +model.kwargs.n_layer=4
    blocks_attr: Optional[str] = None  # module: path of the blocks' nn.ModuleList, e.g. transformer.h;
    #                                    null = the longest of one class
    loss: Optional[str] = None  # module: import path of loss(logits (b, s, V), labels (b, s));
    #                             null = next-token cross entropy


@dataclass
class GpuConfig:
    name: str = MISSING  # e.g. A100-SXM4-80GB
    memory_gib: float = MISSING  # HBM capacity, GiB (2^30 bytes) as vendors state it
    peak_tflops: Dict[str, float] = MISSING  # dense peak per dtype (bf16, fp16, fp32), TFLOP/s; never 2:4 sparse
    hbm_gbps: float = MISSING  # HBM bandwidth, GB/s
    reserve_gib: float = 1.0  # held back for CUDA context, NCCL buffers, fragmentation, GiB
    gemm_efficiency: float = 0.8  # fraction of dense peak large GEMMs reach (calibrated: see the cluster file)
    gemm_half_gflop: float = 1.0  # GEMM size (GFLOP) at which half of gemm_efficiency is reached
    gemm_curve_exponent: float = 1.0  # sharpness of the efficiency knee (1: x / (x + half); larger: steeper)
    attention_efficiency: float = 0.5  # fraction of dense peak fused attention kernels reach
    memory_efficiency: float = 0.7  # fraction of HBM bandwidth element-wise ops reach
    kernel_overhead_us: float = 4.0  # fixed time per GPU kernel (launch, minimum duration), microseconds
    host_dispatch_us: float = 0.0  # host time to issue one kernel (framework + launch); 0 = the GPU never waits
    eager_op_us: float = 0.0  # fixed time of one eager tensor op outside autograd (dispatcher and the Python
    #                           calling it), microseconds: what the optimizer step pays per op beyond its bytes;
    #                           0 = priced as a GPU kernel (the larger of kernel_overhead_us and host_dispatch_us)
    zero3_fetch_us: float = 0.0  # ZeRO-3: host time of one submodule's parameter fetch and release per pass, beyond
    #                              its all-gather, microseconds; 0 = not measured (mist-ds profile measures it)
    zero3_hook_us: float = 0.0  # ZeRO-3: host time of its hooks on one module call per pass, microseconds; 0 = none
    zero12_tensor_us: float = 0.0  # ZeRO-1/2: host time of one trained tensor's gradient reduction (hook, bucket
    #                                copy, epilogue), beyond the all-reduce, microseconds; 0 = not measured
    zero12_per_mib_us: float = 0.0  # ZeRO-1/2: the same per MiB of gradient reduced, microseconds; 0 = not measured
    per_precision: Dict[str, Dict[str, float]] = field(default_factory=dict)  # per train.precision, fields above
    #                                            replaced for it, e.g. {fp32: {gemm_efficiency: 0.9}}; {} = none


@dataclass
class InterferenceConfig:
    fallback: float = 1.0  # slowdown of every channel of a concurrent set missing from `factors` (1 = none)
    factors: Dict[str, Dict[str, float]] = field(default_factory=dict)  # {C+G2G: {C: 1.29, G2G: 1.04}, ...}


@dataclass
class ClusterConfig:
    name: str = MISSING  # zoo name, e.g. a100-80g
    nodes: int = 1  # machines
    gpus_per_node: int = MISSING  # GPUs used per machine
    gpu: GpuConfig = field(default_factory=GpuConfig)
    intra_node_gbps: float = MISSING  # GPU-GPU bandwidth inside a node, per GPU, one direction, GB/s
    inter_node_gbps: float = 0.0  # network bandwidth per node, one direction, GB/s (Gb/s / 8); 0 for one node
    pcie_gbps: float = MISSING  # host link per GPU, one direction, GB/s, measured with all GPUs copying at once
    cpu_memory_gib: float = MISSING  # host memory per node, GiB
    cpu_adam_gparams_per_s: float = MISSING  # host optimizer (CPU Adam) speed per node, 1e9 params/s
    collective_latency_us: float = 10.0  # per p2p message and gloo ring step (GPUs: NCCL's own), microseconds
    nccl_version: str = "2.30.7"  # the NCCL release whose tuning constants (src/graph/tuning.cc) price GPU
    #                               collectives: 2.30.7 | 2.8.4
    interference: InterferenceConfig = field(default_factory=InterferenceConfig)
    profile_db: Optional[str] = None  # SQLite file of measured op times (mist-ds profile); null = roofline only
    constants: str = "file"  # file | machine: machine = the figures a quick mist-ds profile measured on this
    #                          machine (the CLI measures them the first time; cached, profile refreshes them)
    price_per_gpu_hour: Optional[float] = None  # USD per GPU-hour; null = unknown
    cores: Optional[int] = None  # CPU ranks: the cores a node's ranks share with other jobs; null = GPUs
    other_runnable_threads: Any = 0.0  # CPU ranks: other jobs' threads ready to run, priced for; or now (sampled)
    measured_other_runnable_threads: float = 0.0  # CPU ranks: the same as the figures were measured (0: a core's own)


@dataclass
class TrainConfig:
    global_batch_size: int = MISSING  # sequences per optimizer step = micro_batch x grad_accum x dp
    precision: str = "bf16"  # bf16 | fp16 | fp32 (bf16/fp16 keep fp32 master weights and Adam states)
    optimizer: str = "adamw"  # adamw
    grad_clip: float = 1.0  # global gradient-norm clip; 0 = off


@dataclass
class OffloadConfig:
    weights: Any = 0.0  # fraction of weights kept on the host: one value or one per stage
    grads: Any = 0.0  # fraction of gradients kept on the host: one value or one per stage
    optimizer: Any = 0.0  # fraction of optimizer states (fp32 master, Adam m, v) on the host
    activations: Any = 0.0  # fraction of saved activations swapped to the host


@dataclass
class StrategyConfig:
    runtime: str = "deepspeed"  # deepspeed | mist | mist-paper | megatron: the executor, who runs the strategy
    tp: int = 1  # tensor-parallel degree t
    pp: int = 1  # pipeline stages S
    dp: Optional[int] = None  # data-parallel degree d; null = GPUs / (tp x pp x sp)
    sp: int = 1  # sequence-parallel degree q (DeepSpeed Ulysses): each sequence split over q ranks; 1 = none
    micro_batch_size: int = 1  # sequences per micro-batch per data-parallel rank, b
    grad_accum: Optional[int] = None  # micro-batches per step G; null = global_batch / (b x dp)
    layers_per_stage: Optional[List[int]] = None  # blocks per stage; null = as even as possible
    ckpt_layers: Any = "none"  # recomputed blocks per stage (the last ones): full | none | count | list
    zero_stage: Any = 0  # ZeRO stage 0-3: one value or one per stage
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    schedule: str = "1f1b"  # 1f1b | mist (1F1B's order) | interleaved (Megatron's) | zb-h1 | dualpipev (DeepSpeed's
    #                        DualPipeV: 2 pp chunks, two per rank in a V; priced on executor deepspeed, not run)
    virtual_stages: int = 1  # model chunks per stage for the interleaved schedule (1 otherwise)
    allow_cross_node_tp: bool = False  # permit tp > gpus_per_node (TP traffic over the network)


@dataclass
class TunerConfig:
    space: str = "mist"  # mist | megatron | deepspeed | aceso | uniform: which strategy space to search
    runtime: Optional[str] = None  # executor the plan must run on; null = the best executor mist_ds can run
    micro_batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4])  # candidate b
    max_tp: int = 8  # largest tensor-parallel degree tried
    tp: Optional[List[int]] = None  # allowed tensor-parallel degrees, e.g. [1, 2]; null = any up to max_tp
    pp: Optional[List[int]] = None  # allowed pipeline degrees S, e.g. [2]; null = any
    sp: Optional[List[int]] = None  # allowed sequence-parallel degrees q, e.g. [1, 4]; null = 1, and from
    # 16384 tokens on also every degree DeepSpeed Ulysses allows within a node
    workers: int = 1  # worker processes for the outer loop; the plan does not depend on it
    compare_baselines: bool = True  # also tune the megatron, deepspeed and aceso spaces and compare
    milp_time_limit_s: float = 60.0  # CBC time limit per MILP, seconds; the gap is reported if it binds
    layer_slack: int = 2  # a stage holds L/S - slack .. L/S + slack layers (Mist's range)
    weights_offload_ratios: List[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])  # tried wo
    grads_offload_ratios: List[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])  # tried go
    optimizer_offload_ratios: List[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])  # tried oo
    activations_offload_ratios: List[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])  # tried ao
    quiet: bool = False  # no progress bar and no baseline chatter
    partition_solver: str = "auto"  # auto | dp | milp: stage split solver; auto: DP, MILP where shared host can bind
    host_memory: str = "per-gpu"  # per-gpu: a GPU's offloads within its node share | per-node: a node's ranks share it
    grid: str = "default"  # default: the *_offload_ratios lists | mist: Mist's grids (wo, go 6 values; oo, ao 8)
    top_n: int = 3  # runner-up plans in plan.json and summary.md: the best of the next-best layouts; 0 = none
    rerank_top_n: int = 4  # the best N points by the closed form, re-ranked by the event simulation (what predict
    #                        prints): the plan is the fastest of them; 1 = the closed form's best, no re-ranking
    verify_top_n: int = 0  # your script: run the best N plans of distinct layouts briefly, keep the measured fastest
    verify_num_steps: int = 3  # verify: optimizer steps timed per candidate, after the untimed warm-up steps
    verify_num_warmup_steps: int = 2  # verify: untimed optimizer steps first (allocation; ZeRO-3 traces 2 steps)
    verify_timeout_s: float = 600.0  # verify: a candidate launch running longer is stopped and recorded as a hang
    schedules: List[str] = field(default_factory=lambda: ["1f1b"])  # pipeline orders searched per plan, 1f1b among
    #                        them: e.g. [1f1b,zb-h1] also tries zb-h1 where it composes (executor mist, no
    #                        activation offload), its deferred W's in the memory
    pipeline_script: bool = False  # your script steps with engine.train_batch: an hf model may be planned at pp > 1
    write_top_n: bool = False  # your script: also write cmd.txt and ds_config.json of each runner-up (plan/candidates)
    target: str = "deepspeed"  # what trains the plan: deepspeed (ds_config.json: mist_ds's launcher or your
    #                            DeepSpeed script) | hf-trainer (Hugging Face Trainer: pp 1, recompute of every n-th
    #                            block, trainer_args.json beside ds_config.json)


@dataclass
class MeasureConfig:
    num_warmup_steps: int = 2  # steps run before the timed ones (mist-ds measure)
    num_steps: int = 3  # timed steps; the iteration time is their median
    table: Optional[str] = None  # a JSON-lines accuracy table the measurement is appended to (and its .md); null = none


@dataclass
class ProfileConfig:
    quick: bool = False  # mist-ds profile: one round on a small grid (a few minutes on CPU); false: 3 rounds, full grid
    name: Optional[str] = None  # name of the cluster config it writes; null = <cluster.name>-profiled
    out_dir: Optional[str] = None  # folder of profile.db, cluster/<name>.yaml, profile.json; null = Hydra's run dir


@dataclass
class MistDsConfig:
    model: ModelConfig = MISSING
    cluster: ClusterConfig = MISSING
    train: TrainConfig = MISSING
    strategy: StrategyConfig = MISSING
    tuner: TunerConfig = MISSING
    json: bool = False  # machine-readable output: the result as JSON on stdout instead of text
    plan: Optional[str] = None  # a plan.json from `mist-ds tune` that predict prices and explain explains;
    #                             null = `strategy`
    cases: Optional[str] = None  # (predict-many) a text file: one case of overrides a line, priced together
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
