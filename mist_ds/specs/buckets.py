"""Communication buffers mist_ds plans: the sizes the emitter writes into ds_config.json and the cost
model counts, so the memory a plan predicts is the memory the engine allocates. Elements throughout.
"""
from __future__ import annotations

from dataclasses import dataclass

from mist_ds.specs.model import ModelSpec

# DeepSpeed's default reduce_bucket_size (deepspeed/runtime/zero/config.py), elements: what an
# engine whose config leaves the bucket unset allocates.
DEFAULT_REDUCE_BUCKET_ELEMENTS = 500_000_000
# The reduce bucket mist_ds plans, prices and emits (BucketSizes below: emit/ds_config.py writes it,
# cost/memory.py counts it), elements.
# DeepSpeed allocates the whole bucket whatever the model's size (stage_1_and_2.py setup_buckets:
# torch.empty(reduce_bucket_size); stage3.py keeps it for good), so its default holds 1 GB per GPU in
# bf16 (2 GB with a pipeline's ZeRO-1) that a small stage never fills. 5e7 (100 MB in bf16) is the
# smallest value DeepSpeed's own autotuner tries (deepspeed/autotuning/constants.py,
# DEFAULT_TUNING_SPACE_ZERO_{1,2,3}: reduce_bucket_size [5e7, 5e8, 1e9]).
PLANNED_REDUCE_BUCKET_ELEMENTS = 50_000_000


@dataclass(frozen=True)
class BucketSizes:
    """Communication buffers the engine allocates, in elements, as the cost model counts them.

    The ZeRO-3 fields set to None are left at DeepSpeed's defaults (nothing emitted).
    """

    reduce_bucket_elements: int = PLANNED_REDUCE_BUCKET_ELEMENTS
    """ZeRO 1-3 gradient reduce bucket (`reduce_bucket_size`): DeepSpeed allocates it whole, and
    memory.py counts b bytes per element (PLANNED_REDUCE_BUCKET_ELEMENTS, not DeepSpeed's 5e8)."""
    stage3_prefetch_bucket_elements: int | None = None
    """ZeRO-3: parameters all-gathered ahead of use (`stage3_prefetch_bucket_size`)."""
    stage3_max_live_elements: int | None = None
    """ZeRO-3: gathered parameters beyond which prefetching stops (`stage3_max_live_parameters`)."""
    stage3_max_reuse_distance_elements: int | None = None
    """ZeRO-3: a layer used again within this many elements stays gathered (`stage3_max_reuse_distance`)."""
    stage3_persistence_threshold_elements: int = 0
    """ZeRO-3: parameters this small stay whole on every rank (`stage3_param_persistence_threshold`);
    0 = none, as memory.py counts (persistent_params = 0)."""


def bucket_sizes(model: ModelSpec | None, tp: int,
                 reduce_bucket_elements: int = PLANNED_REDUCE_BUCKET_ELEMENTS) -> BucketSizes:
    """The buckets the cost model assumes for `model` split over `tp` tensor-parallel ranks.

    cost/stage_memory.py counts two gathered blocks under ZeRO-3 (the running one and the prefetched next), so
    the prefetch bucket is one block's parameters on a TP rank, the live limit two, and a block reused
    within one block's worth of parameters stays gathered (DeepSpeed's 1e9-element default could keep
    several blocks, ~2 GB in bf16, that the plan never counted). Without a model these stay at
    DeepSpeed's defaults, which the cost model does not count. `reduce_bucket_elements`: the runtime's
    reduce bucket (specs.executor_rules.reduce_bucket_elements_of).
    """
    if model is None:
        return BucketSizes(reduce_bucket_elements=reduce_bucket_elements)
    block_elements = model.block_params(tp)
    return BucketSizes(reduce_bucket_elements=reduce_bucket_elements, stage3_prefetch_bucket_elements=block_elements,
                       stage3_max_live_elements=2 * block_elements,
                       stage3_max_reuse_distance_elements=block_elements)
