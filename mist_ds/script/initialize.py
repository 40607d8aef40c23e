"""`mist_ds.initialize`: DeepSpeed's `deepspeed.initialize` with the plan mist_ds made for the model the script hands
it (docs/design.md, Your own script).

    engine, optimizer, dataloader, lr_scheduler = mist_ds.initialize(args=args, model=model,
                                                                      model_parameters=model.parameters())

It takes deepspeed.initialize's arguments (and returns its four values) plus `pipeline` (True when the loop steps
with engine.train_batch, so that pp > 1 may be planned) and `loss` (a plain nn.Module's loss function, priced). The
script is started by `mist-deepspeed --autotune-mist {tune,run} ... my_train.py ...`, which launches it once per
phase (mist_ds/script/settings.py): in the plan phase rank 0 plans the model handed here and every rank exits; in
the verify and run phases the plan's config, merged with the user's (mist_ds/script/user_config.py), goes to
DeepSpeed's engine with the plan's recompute applied to the model. pp = 1 returns DeepSpeed's own engine: ZeRO and
offload from the config, tensor parallelism by DeepSpeed's AutoTP (which shards the model), the dataloader split by
data-parallel rank (DeepSpeed's, over `training_data`). A plan with sequence parallelism (sp > 1) installs DeepSpeed's
Ulysses for HF models on the model and its adapter around that dataloader, `.loss` the whole sequence's
(mist_ds/script/sequence.py).

A mistake in what the script hands over, or a plan for another model, is one line on stderr and exit 2 on every
rank; a model nothing fits, exit 3.
"""
from __future__ import annotations

import atexit
import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from mist_ds.config.override_text import override_value
from mist_ds.script.apply import apply_batch_check, apply_recompute
from mist_ds.script.planning import (hf_model_overrides, is_hf_model, pipeline_overrides, pipelines_held_because,
                                     plan_model, sequence_overrides)
from mist_ds.script.sequence import (apply_sequence_parallel, check_sequence_parallel_data, sequence_parallel_loader,
                                     sequence_parallel_rank)
from mist_ds.script.settings import SETTINGS_ENV, ScriptSettings, settings_from_environment
from mist_ds.script.teardown import Teardown
from mist_ds.script.user_config import (GLOBAL_BATCH_FIELD, UserConfig, batch_origin, check_parameter_dtypes,
                                        check_priced_as_given, merged_config, planner_overrides, read_user_config,
                                        user_precision)
from mist_ds.specs.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_NO_PLAN_FITS, ConfigError

log = logging.getLogger(__name__)
PLAN_PHASE_TIMEOUT_S = 6 * 3600.0
"""How long the plan phase's other ranks wait for rank 0's outcome (seconds)."""
DEFAULT_PORT = 29500
"""deepspeed.initialize's distributed_port default (TORCH_DISTRIBUTED_DEFAULT_PORT)."""


def show_messages() -> None:
    """What mist_ds.initialize says (the plan's changes to the script's config, pipelines held, recompute) on rank
    0's stderr: a script configures no logging for mist_ds, and these must not go unseen."""
    from deepspeed import comm as dist

    logger = logging.getLogger("mist_ds.script")
    if dist.get_rank() == 0 and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("mist_ds: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)

class ScriptExit(SystemExit):
    """Every rank leaves the script with one code (after the process group is gone)."""


def _leave(code: int, message: str | None = None, together: bool = True) -> None:
    """Print `message`, end this rank with `code`. `together` (an outcome every rank agreed on): after a barrier and
    with the process group destroyed; otherwise at once, as a failing rank must (the others may be inside a
    collective it will never join; DeepSpeed's launcher ends them when this rank exits non-zero)."""
    from deepspeed import comm as dist

    if message:
        print(f"mist_ds.initialize: {message}", file=sys.stderr, flush=True)
    if together and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    raise ScriptExit(code)


def _agree(outcome: tuple[int, str | None] | None) -> tuple[int, str | None]:
    """Rank 0's outcome (exit code, message), on every rank."""
    from deepspeed import comm as dist

    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_runs_in_script(strategy, field: str, source: str) -> None:
    """A pp = 1 plan runs on the engine deepspeed.initialize builds from the config alone: its executor must run as
    priced there (ExecutorCapabilities.runs_on_stock_engine); pipeline plans run on mist_ds's runtime, which builds
    every executor's features."""
    from mist_ds.specs.executors import capabilities_of

    caps = capabilities_of(strategy.runtime)
    if strategy.parallelism.pp == 1 and not caps.runs_on_stock_engine:
        raise ConfigError(field, strategy.runtime, f"{source}: executor {caps.name}'s pp = 1 features need mist_ds's "
                                                   "own engine, and your script gets DeepSpeed's: tune with "
                                                   "tuner.runtime=deepspeed (or leave it out)")


def _discard_plan(plan_dir: Path) -> None:
    """A plan phase refused for bad input leaves no plan folder: no plan.json the launcher would train, and none of
    what planning wrote before the refusal (the handed model's config, plan files of a plan refused afterwards)."""
    import shutil

    shutil.rmtree(plan_dir, ignore_errors=True)


def _plan_phase(settings: ScriptSettings, model: Any, loss: Callable | None, user: UserConfig,
                deepspeed_args: dict[str, Any], pipeline: bool) -> None:
    """Rank 0 plans and writes the plan files; every rank exits with its outcome."""
    from deepspeed import comm as dist

    from mist_ds.tuner import NoPlanFits

    outcome: tuple[int, str | None] | None = None
    if dist.get_rank() == 0:
        try:
            hf = is_hf_model(model)
            model_part = hf_model_overrides(model, settings.plan_dir / type(model).__name__) if hf else []
            client_optimizer, client_scheduler = deepspeed_args["optimizer"], deepspeed_args["lr_scheduler"]
            overrides = [*model_part, *settings.overrides,
                         *planner_overrides(user, client_optimizer, dist.get_world_size(), settings.overrides)]
            if override_value(overrides, GLOBAL_BATCH_FIELD) is None:
                log.warning("no global batch given (no train_batch_size in a DeepSpeed config, no --mist %s): "
                            "planning for the planner's default; give yours with --mist %s=N", GLOBAL_BATCH_FIELD,
                            GLOBAL_BATCH_FIELD)
            overrides += pipeline_overrides(overrides, pipeline,
                                            pipelines_held_because(hf, client_optimizer, client_scheduler))
            overrides += sequence_overrides(overrides, deepspeed_args["training_data"])
            planned = plan_model(overrides, None if hf else model, loss, settings.plan_dir, user, handed=model)
            from mist_ds.plan import load_plan

            for path in (planned.plan_json, *planned.candidates):
                check_runs_in_script(load_plan(path).strategy, "tuner.runtime", str(path))
            outcome = (0, None)
        except ConfigError as error:
            _discard_plan(settings.plan_dir)
            outcome = (EXIT_BAD_INPUT, f"error: {error}"
                                       f"{batch_origin(error, user, settings.overrides, dist.get_world_size())}")
        except NoPlanFits as reason:
            outcome = (EXIT_NO_PLAN_FITS, f"no plan fits: {reason}")
        except Exception as error:  # noqa: BLE001 (the other ranks wait for an outcome: never leave them waiting)
            traceback.print_exc()
            outcome = (EXIT_INTERNAL, f"planning failed ({type(error).__name__}: {error}); the traceback is above")
    code, message = _agree(outcome)
    _leave(code, message if dist.get_rank() == 0 else None)


def _handed_model_spec(plan, model: Any, loss: Callable | None, scratch: Path):
    """The ModelSpec of the model handed over, composed with the plan's own settings (rank 0 writes the config of a
    transformers model into `scratch`)."""
    from mist_ds.config import compose

    hf = is_hf_model(model)
    if hf:
        overrides = [*plan.user_overrides, *hf_model_overrides(model, scratch)]
    else:  # the module handed over is the model: not what a plan tuned from a `model._target_` would build
        overrides = [o for o in plan.user_overrides if o.lstrip("+").split("=")[0].split(".")[:2] not in
                     (["model", "_target_"], ["model", "kwargs"])]
    return compose(overrides, with_strategy=False, module=None if hf else model, loss=loss).model


RUNTIME_ONLY_FIELDS = frozenset({"dtype", "torch_dtype", "use_cache", "architectures", "_name_or_path",
                                 "transformers_version", "output_attentions", "output_hidden_states", "return_dict"})
"""Fields of an HF config that change nothing the plan prices (the dtype a script loads in: the plan's precision is
train.precision; the cache, unused in training; bookkeeping save_pretrained writes)."""


def _hf_fields_that_differ(plan, spec) -> list[str]:
    """The priced fields of the planned HF model that the handed model changes: its config's (RUNTIME_ONLY_FIELDS
    aside), and the attention implementation (eager keeps the s x s scores the plan did not price; save_pretrained
    does not write it, so the config's hash cannot show it). The planned config read where the plan says it was (its
    own folder for a plan made in the script)."""
    from mist_ds.config import compose

    planned_hf = compose(plan.user_overrides, with_strategy=False).model.hf
    planned, here = json.loads(planned_hf.config_json), json.loads(spec.hf.config_json)
    differ = [f"config.{key}" for key in sorted(set(planned) | set(here))
              if key not in RUNTIME_ONLY_FIELDS and planned.get(key) != here.get(key)]
    if planned_hf.attn_implementation != spec.hf.attn_implementation:
        differ.append(f"attention ({planned_hf.attn_implementation} planned, {spec.hf.attn_implementation} here)")
    return differ


def check_plan_is_for(plan, plan_json: Path, model: Any, loss: Callable | None, scratch: Path) -> Any:
    """The handed model's spec, once it is the model the plan was tuned for (ConfigError naming what differs): the
    same class (and for an HF model the same config fields that are priced, attention and frozen parameters; a module
    the same structure hash)."""
    from mist_ds.plan import model_source_of

    spec = _handed_model_spec(plan, model, loss, scratch)
    planned, here = plan.model_source, model_source_of(spec)
    keys = {"hf": ("architecture", "frozen"), "module": ("class", "module_sha256")}
    differ = [k for k in keys.get(here["kind"], ()) if planned.get(k) != here.get(k)]
    if planned.get("kind") != here["kind"]:
        differ = ["kind"]
    elif here["kind"] == "hf":
        differ += _hf_fields_that_differ(plan, spec)
    if differ:
        raise ConfigError("plan", str(plan_json), f"{_model_change_text(planned, here, differ)}: plan this model "
                                                  "again (mist-deepspeed --autotune-mist run without --plan; a "
                                                  "cmd.txt trains the model it was planned for)",
                          rule="plan.model-source")
    return spec


def _model_change_text(planned: dict[str, Any], here: dict[str, Any], differ: list[str]) -> str:
    """What differs between the planned model and the handed one, in words (a module's hash covers its code,
    structure, settings and loss; an hf model's fields come described)."""
    def said(key: str) -> str:
        if key == "module_sha256":
            return "its code, structure, settings or loss (module_sha256)"
        if key in here or key in planned:
            return f"{key} ({planned.get(key)} planned, {here.get(key)} here)"
        return key

    name = planned.get("class") or planned.get("architecture") or planned.get("kind")
    return f"the plan is for {name}, and the model the script hands over differs in {', '.join(map(said, differ))}"


def _initialize_deepspeed(deepspeed_args: dict[str, Any], model: Any, config: dict[str, Any]):
    """deepspeed.initialize with the merged config. The script's args keep its own deepspeed_config afterwards, but not
    during the call: DeepSpeed refuses it beside config= (and writes args.local_rank, which the script's object
    must get, so args is not copied)."""
    import deepspeed

    args = deepspeed_args["args"]
    saved = getattr(args, "deepspeed_config", None) if args is not None else None
    if saved is not None:
        args.deepspeed_config = None
    try:
        return deepspeed.initialize(**deepspeed_args, model=model, config=config)
    finally:
        if saved is not None:
            args.deepspeed_config = saved


def _train_phase(settings: ScriptSettings, model: Any, loss: Callable | None, user: UserConfig,
                 deepspeed_args: dict[str, Any], pipeline: bool):
    from deepspeed import comm as dist

    from mist_ds.plan import load_plan
    from mist_ds.script.verify import StepTimer, inject_fault

    plan_json = Path(settings.plan)
    plan = load_plan(plan_json)
    plan_config = json.loads((plan_json.parent / "ds_config.json").read_text())
    scratch = Path(settings.run_dir) / "scratch" / f"rank{dist.get_rank()}"
    spec = check_plan_is_for(plan, plan_json, model, loss, scratch)
    strategy = plan.strategy
    check_runs_in_script(strategy, "plan", str(plan_json))
    check_priced_as_given(user, plan_config, deepspeed_args["optimizer"], str(plan_json), dist.get_world_size(),
                          plan.strategy.parallelism.global_batch_size)
    if strategy.parallelism.pp > 1 and not pipeline:
        raise ConfigError("plan", str(plan_json), f"a pipeline plan (pp {strategy.parallelism.pp}) for a loop that "
                                                  "steps with engine(...), backward and step: pass pipeline=True to "
                                                  "mist_ds.initialize and step with engine.train_batch, or re-plan "
                                                  "without --plan")
    config, replaced = merged_config(user, plan_config, deepspeed_args["optimizer"] is not None)
    # as the engine will cast (or keep) them: a --plan priced for fp32 beside a bf16 model is refused here
    check_parameter_dtypes(model, user_precision(UserConfig(config, str(plan_json))), user)
    if replaced and dist.get_rank() == 0:
        log.warning("the plan sets %s in your DeepSpeed config (%s)", "; ".join(replaced), user.source)
    if settings.phase == "verify":
        inject_fault(plan_json.parent.name)
    if strategy.parallelism.pp > 1:
        return _pipeline(settings, plan_json, model, spec, config, deepspeed_args)
    blocks = spec.read_model.blocks_attr
    par = strategy.parallelism
    apply_recompute(model, model.get_submodule(blocks), strategy.stages[0].ckpt_layers, is_hf_model(model))
    apply_batch_check(model, par.micro_batch_size, spec.seq_len,
                      lambda mistake: _leave(EXIT_BAD_INPUT, f"error: the first batch: {mistake}", together=False),
                      par.sp)
    training_data = deepspeed_args["training_data"]
    if par.sp > 1:  # DeepSpeed's Ulysses; its dataloader is built below (deepspeed_io cannot split by its mpu)
        check_sequence_parallel_data(training_data)
        deepspeed_args = {**deepspeed_args, "training_data": None, "mpu": apply_sequence_parallel(
            model, is_hf_model(model), par.sp, par.micro_batch_size, config.get("zero_optimization", {}),
            lambda mistake: _leave(EXIT_BAD_INPUT, f"error: a batch: {mistake}", together=False))}
    if dist.get_rank() == 0:
        optimizer = "your optimizer object" if deepspeed_args["optimizer"] is not None else "AdamW"
        log.info("%s; DeepSpeed config: %s", plan_json, f"the plan's ({optimizer}, its precision)" if not user.given
                 else f"{user.source} with the plan's batch, ZeRO, offload and tensor-parallel settings")
    out = _initialize_deepspeed(deepspeed_args, model, config)
    if par.sp > 1 and training_data is not None:
        out = (out[0], out[1], sequence_parallel_loader(out[0], training_data, deepspeed_args["collate_fn"]), out[3])
    teardown = Teardown(out[0].destroy)
    atexit.register(teardown)
    if settings.phase == "verify":
        StepTimer(out[0], settings.num_warmup_steps, settings.num_steps, settings.report, teardown, pipelined=False)
    return out


def _pipeline(settings: ScriptSettings, plan_json: Path, model: Any, spec: Any, config: dict[str, Any],
              deepspeed_args: dict[str, Any]):
    """pp > 1: the user's HF model cut into the plan's stages on DeepSpeed's PipelineEngine (mist_ds.runtime), which
    the loop steps with engine.train_batch(data_iter) over (input_ids, labels) micro-batches; its optimizer and
    scheduler from the config, the dataloader DeepSpeed's over `training_data`."""
    from mist_ds.runtime import initialize as run_plan
    from mist_ds.script.verify import StepTimer

    held = pipelines_held_because(is_hf_model(model), deepspeed_args["optimizer"], deepspeed_args["lr_scheduler"])
    if held is not None:
        raise ConfigError("plan", str(plan_json), f"a pipeline plan (pp > 1), and {held}")
    planned = run_plan(config, spec, module=model)
    engine = planned.engine
    data = deepspeed_args["training_data"]
    loader = engine.deepspeed_io(data, collate_fn=deepspeed_args["collate_fn"]) if data is not None else None
    teardown = Teardown(planned.close)
    atexit.register(teardown)
    if settings.phase == "verify":
        StepTimer(engine, settings.num_warmup_steps, settings.num_steps, settings.report, teardown, pipelined=True)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _launch_settings(model: Any, mpu: Any, mesh_param: Any) -> ScriptSettings:
    """The settings mist-deepspeed started this process with, for a call that hands a model and no layout of its own
    (ConfigError otherwise: the script's own mistake, or a script started without mist-deepspeed)."""
    if model is None:
        raise ConfigError("model", None, "mist_ds.initialize plans the model it is handed: pass model=")
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise ConfigError(name, type(value).__name__, "mist_ds lays out the ranks as its plan says (AutoTP, its "
                                                          f"pipeline grid): drop {name}")
    settings = settings_from_environment()
    if settings is None:
        raise ConfigError(SETTINGS_ENV, None, "mist_ds.initialize plans inside a launch by mist-deepspeed: start the "
                                              "script with `mist-deepspeed --autotune-mist run [deepspeed's "
                                              "arguments] your_script.py ...` (or call deepspeed.initialize)")
    return settings


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int = DEFAULT_PORT,
               mpu: Any = None, dist_init_required: bool | None = None, collate_fn: Callable | None = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None, *, pipeline: bool = False,
               loss: Callable | None = None):
    """deepspeed.initialize with mist_ds's plan for `model` (module docstring): (engine, optimizer, dataloader,
    lr_scheduler), as DeepSpeed returns them. `pipeline`: the loop can step with engine.train_batch(data_iter);
    `loss`: the loss function of a plain nn.Module (default: next-token cross entropy)."""
    from mist_ds.runtime import join_process_group

    try:
        settings = _launch_settings(model, mpu, mesh_param)
    except ConfigError as error:  # a script run without mist-deepspeed: one line, no traceback, before any group
        _leave(EXIT_BAD_INPUT, f"error: {error}", together=False)
    # in the plan phase the other ranks wait for rank 0's plan in one collective: a long trace or search must not
    # outlast DeepSpeed's default timeout (10 minutes)
    join_process_group(PLAN_PHASE_TIMEOUT_S if settings.phase == "plan" else None)
    show_messages()
    deepspeed_args = dict(args=args, optimizer=optimizer, model_parameters=model_parameters,
                          training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
                          dist_init_required=dist_init_required, collate_fn=collate_fn)
    try:
        user = read_user_config(args, config if config is not None else config_params)
    except ConfigError as error:  # the same on every rank, where the file is: they leave together, each saying why
        _leave(EXIT_BAD_INPUT, f"error: {error}")
    if settings.phase == "plan":
        _plan_phase(settings, model, loss, user, deepspeed_args, pipeline)
    try:
        return _train_phase(settings, model, loss, user, deepspeed_args, pipeline)
    except ConfigError as error:  # may be this rank's alone (its node's memory, its model): it leaves at once
        _leave(EXIT_BAD_INPUT, f"error: {error}", together=False)


def data_parallel(engine: Any) -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel size) of a DeepSpeed engine, for a loop that draws its own
    data: every rank of an AutoTP group gets the same samples (DeepSpeed's dataloader already splits this way). Under
    sequence parallelism every rank of the d x sp sequence-data group draws its own samples, which
    mist_ds.sequence_shards hands to the ranks of its sequence group in turn."""
    sequence = sequence_parallel_rank(engine)
    if sequence is not None:
        return sequence
    mpu = getattr(engine, "mpu", None)
    if mpu is not None:
        return mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    return engine.global_rank, engine.dp_world_size
