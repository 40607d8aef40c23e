"""Planning the model a user's script hands `mist_ds.initialize` (rank 0 of the plan phase; docs/design.md, Your
own script).

A Hugging Face causal LM is planned from its own config (written into the plan folder, `model=hf`), attention
implementation and frozen parameters, as `mist-ds tune model=hf ...` plans it; any other nn.Module is traced from
the module itself (`mist_ds.tune(..., model=module)`). The plan files are those `mist-ds tune` writes (but cmd.txt:
the launcher writes the script's), and, with tuner.verify_top_n or tuner.write_top_n, plan/candidates/<i>/ for the
best plans of distinct layouts (the plan first), which the launcher's verify phase runs.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

from mist_ds.config.override_text import override_value
from mist_ds.script.user_config import UserConfig, check_parameter_dtypes, config_note
from mist_ds.specs.errors import ConfigError

log = logging.getLogger(__name__)

PIPELINE_HELD = "tuner.pp=[1]"
PIPELINES_PLANNED = "tuner.pipeline_script=true"
SEQUENCE_HELD = "tuner.sp=[1]"


def is_hf_model(model: Any) -> bool:
    """Whether `model` is a transformers model (planned from its config, hf_model_overrides) rather than any
    nn.Module (traced)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def hf_model_overrides(model: Any, config_dir: Path) -> list[str]:
    """`model=hf ...` for a transformers model the script built: its config written to `config_dir`, the attention
    it runs, the parameters it froze (none: said too, so that no plan's frozen list stands in for it). Only a causal
    LM's class: its config alone would price a classifier or a bare base model as the causal LM of that config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = type(model).__name__
    if name not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        raise ConfigError("model", name, "mist_ds plans causal language models (AutoModelForCausalLM's classes, e.g. "
                                         "LlamaForCausalLM); hand over the causal LM, or a plain nn.Module whose "
                                         "forward maps token ids to logits")
    config_dir.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(str(config_dir / "config.json"))
    attention = getattr(model.config, "_attn_implementation", None) or "eager"
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    return ["model=hf", f"model.name_or_path={config_dir}", f"model.attn_implementation={attention}",
            f"model.frozen=[{','.join(frozen)}]"]


def _asks_more_than_one(value: str | None) -> bool:
    return value is not None and value.strip("[] ") not in ("1", "")


def pipeline_overrides(overrides: Sequence[str], pipeline: bool, held_because: str | None) -> list[str]:
    """What the planner is told of pipeline stages: with `pipeline` (the loop steps with engine.train_batch) and
    nothing holding it (`held_because` None), that the script runs them; else tuner.pp held to [1], logged with the
    reason, and the user's own tuner.pp asking for more refused with it."""
    if pipeline and held_because is None:
        return [PIPELINES_PLANNED]
    if pipeline:
        why = held_because
    elif held_because is None:
        why = ("the script's loop steps with engine(...), backward and step: pipeline stages need engine.train_batch "
               "(say so with mist_ds.initialize(..., pipeline=True))")
    else:  # what holds it would hold it with pipeline=True too: said first, so that no one adds only that
        why = f"{held_because} (and the script's loop steps with engine(...), not engine.train_batch)"
    asked = override_value(overrides, "tuner.pp")
    if _asks_more_than_one(asked):
        raise ConfigError("tuner.pp", asked, f"{why}; drop --mist tuner.pp or give tuner.pp=[1]")
    log.info("pipeline parallelism held to pp 1: %s", why)
    return [PIPELINE_HELD]


def sequence_overrides(overrides: Sequence[str], training_data: Any) -> list[str]:
    """What the planner is told of sequence parallelism: nothing where the script's `training_data` can be cut into
    sequence slices (or the loop draws its own data); else tuner.sp held to [1], logged with the reason, and the
    user's own tuner.sp asking for more refused with it (a plan the training launch would refuse)."""
    from mist_ds.script.sequence import check_sequence_parallel_data

    try:
        check_sequence_parallel_data(training_data)
    except ConfigError as error:
        asked = override_value(overrides, "tuner.sp")
        if _asks_more_than_one(asked):
            raise ConfigError("tuner.sp", asked, f"{error}; drop --mist tuner.sp or give tuner.sp=[1]") from error
        if _searches_sequence_parallel(overrides):  # said only where the tuner would have tried sp > 1
            log.info("sequence parallelism held to sp 1: %s", error)
        return [SEQUENCE_HELD]
    return []


def _searches_sequence_parallel(overrides: Sequence[str]) -> bool:
    """Whether the tuner would search sp > 1 for these overrides: tuner.sp given, or a sequence of
    LONG_SEQUENCE_TOKENS or more (or one the overrides do not say)."""
    from mist_ds.tuner.space import LONG_SEQUENCE_TOKENS

    seq_len = override_value(overrides, "model.seq_len")
    return (override_value(overrides, "tuner.sp") is not None or seq_len is None or not seq_len.isdigit()
            or int(seq_len) >= LONG_SEQUENCE_TOKENS)


def pipelines_held_because(hf: bool, client_optimizer: Any, client_scheduler: Any) -> str | None:
    """Why this script's model cannot run as pipeline stages, or None when it can."""
    if not hf:
        return ("this model runs as one module in your script: mist_ds cuts Hugging Face decoders and the zoo's "
                "models into pipeline stages")
    if client_optimizer is not None or client_scheduler is not None:
        return ("a pipeline's stages build their optimizer and scheduler from the DeepSpeed config: give them there "
                "rather than as objects to mist_ds.initialize")
    return None


@dataclasses.dataclass(frozen=True)
class Planned:
    plan_json: Path
    candidates: tuple[Path, ...]


def candidate_count(tuner) -> int:
    """Plans of distinct layouts written under plan/candidates, the plan first: those verify runs, else with
    write_top_n the plan and its runner-ups, else none."""
    if tuner.verify.top_n:
        return tuner.verify.top_n
    return 1 + tuner.top_n if tuner.verify.write_top_n else 0


def plan_model(overrides: Sequence[str], module: Any, loss: Callable | None, plan_dir: Path,
               user: UserConfig | None = None, handed: Any = None) -> Planned:
    """Tune `module` (None: the model `overrides` name) with `overrides`, write the plan files into `plan_dir`, and
    those of the candidates (candidate_count) into plan_dir/candidates/<i> with the verify settings beside them
    (ConfigError, NoPlanFits). `user`: the script's DeepSpeed config, which summary.md names; `handed`: the model the
    script handed over (an hf model too), whose parameters must train in the precision priced."""
    from mist_ds.config import compose, refuse_strategy_overrides
    from mist_ds.symbolic import analyze_model
    from mist_ds.files import write_atomic
    from mist_ds.report.tune import plan_from_result, write_plan
    from mist_ds.script.settings import CANDIDATES_DIR, VERIFY_FILE
    from mist_ds.tuner import tune_specs

    refuse_strategy_overrides(overrides, "mist_ds.initialize's plan phase")
    specs = compose(overrides, with_strategy=False, module=module, loss=loss)
    if handed is not None:  # only now is the precision priced known (the user's config, --mist, or the default)
        check_parameter_dtypes(handed, specs.train.precision, user or UserConfig({}, "none"))
    if module is not None:  # traced now (once: cached), so that the cost model reads its analysis
        analyze_model(specs.model, specs.train.precision, module=module, loss=loss)
    count = candidate_count(specs.tuner)
    if count > 1 + specs.tuner.top_n:  # the runner-ups the search keeps are the candidates
        specs = dataclasses.replace(specs, tuner=dataclasses.replace(specs.tuner, top_n=count - 1))
    result = tune_specs(specs, progress=False)
    plan = plan_from_result(result, overrides)
    write_plan(plan_dir, plan, specs, result.caps, with_command=False)
    written = []
    choices = [(result.strategy, result.prediction), *((p.strategy, pred) for p, pred in result.runner_ups)]
    for i, (strategy, prediction) in enumerate(choices[:count]):
        candidate = dataclasses.replace(plan, strategy=strategy, prediction=prediction.to_dict(), runner_ups=[])
        write_plan(plan_dir / CANDIDATES_DIR / str(i), candidate, specs, result.caps, with_command=False)
        written.append(plan_dir / CANDIDATES_DIR / str(i) / "plan.json")
    for folder in (plan_dir, *(path.parent for path in written)) if user is not None else ():
        summary = folder / "summary.md"  # the candidate chosen by verify replaces the plan's files: each says it
        write_atomic(summary, summary.read_text() + f"\n{config_note(user, specs.train.precision)}\n")
    if written:
        write_atomic(plan_dir / CANDIDATES_DIR / VERIFY_FILE,
                     json.dumps(dataclasses.asdict(specs.tuner.verify), indent=1) + "\n")
    log.info("planned %s into %s", " ".join(overrides), plan_dir)
    return Planned(plan_dir / "plan.json", tuple(written))
