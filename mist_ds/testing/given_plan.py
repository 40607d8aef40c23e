"""A plan of one given strategy, as `--plan P` takes it (plan.json and ds_config.json beside it, as `mist-ds tune`
writes them), for the runs that check a strategy chosen by hand (tests, the soak benchmark). Its search is the one
point given."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.emit import ds_config
from mist_ds.files import write_json_atomic
from mist_ds.plan import Plan, model_source_of


def write_given_plan(overrides: Sequence[str], out: Path) -> dict[str, Any]:
    """Write the plan files of the strategy `overrides` give into `out`; {specs, prediction (dict), config (the
    ds_config written)}."""
    specs = compose(list(overrides))
    prediction = predict(specs).to_dict()
    search = {"space": "given", "runtime": specs.strategy.runtime, "seconds": 0.0, "points_priced": 1,
              "points_pruned": 0, "candidates_evaluated": 1, "objective_s": None, "gap": 0.0, "solver": None,
              "max_gap": 0.0}
    plan = Plan(user_overrides=list(overrides), strategy=specs.strategy, prediction=prediction, search=search,
                model_source=model_source_of(specs.model))
    config = ds_config(specs.strategy, specs.train, specs.model, host_bytes_per_rank=prediction["host_bytes_per_rank"])
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "ds_config.json", config)
    write_json_atomic(out / "plan.json", plan.to_dict())
    return {"specs": specs, "prediction": prediction, "config": config}


def script_census_mismatches(planned: dict[str, Any], results: list[dict], name: str) -> list[str]:
    """What a pp = 1 plan's ranks counted in the user's loop (mist_ds/observe/steps.py census_of_steps, plus
    `block_forwards`: each block's forward calls in the counted step) against its prediction: the step census, the
    recomputed blocks (the last c run forward twice per micro-batch, the others once) and the model states. Empty
    when all hold."""
    from mist_ds.testing.model_states import assert_model_states_are_predicted
    from mist_ds.testing.step_census import step_census_mismatches

    from mist_ds.specs.groups import group_name, group_roles

    specs, prediction = planned["specs"], planned["prediction"]
    stage, micro_batches = specs.strategy.stages[0], specs.strategy.parallelism.grad_accum
    gathers = f"all_gather/{group_name(group_roles(specs.strategy.parallelism, 0), 'data')}"  # `sequence` at d = 1
    found = []
    for result in results:
        where = f"{name} rank {result['what_ran']['rank']}"
        counted = result["census"]
        found += [f"{where}: {m}" for m in step_census_mismatches(
            counted["flops"], counted["comm_bytes"], prediction["flops_per_rank"][0],
            prediction["comm_bytes_per_rank"][0], stage.zero_stage == 3, gathers)]
        forwards = result["block_forwards"]
        expected = [micro_batches * (2 if i >= len(forwards) - stage.ckpt_layers else 1) for i in range(len(forwards))]
        if forwards != expected:
            found.append(f"{where}: block forwards {forwards}, the plan recomputes the last {stage.ckpt_layers}: "
                         f"{expected}")
    try:  # model states field by field, up to the residual formulas the project states (model_states.py)
        assert_model_states_are_predicted(specs, planned["config"], prediction, results, name)
    except AssertionError as error:
        found.append(str(error).splitlines()[0][:300])
    return found
