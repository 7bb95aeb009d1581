"""One assembly step: every part of a run made from its config, once, in the order it needs.

:func:`assemble` reads top to bottom as a run comes together: the config's checks (envs, tasks)
and the run directory, before any model; then the policy, the learner that trains it, the
engine or SGLang client that serves it, the teacher, the weight push; then the rollout engines
and the trackers. The :class:`~agentrl.loop.trainer.Trainer` receives the result; a test or a
script may hand in a part of its own (a policy, a learner, a client) and the rest is made around
it. Where each part lives (its card, its KV budget) is :mod:`agentrl.loop.placement`'s.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from agentrl.config import TrainConfig
from agentrl.data import tasks_for
from agentrl.env import import_envs
from agentrl.errors import ConfigError
from agentrl.learner import Learner, LearnerConfig
from agentrl.loop import ranks as dist_ranks
from agentrl.loop.engine_procs import DedicatedClient, start_engines
from agentrl.loop.placement import (
    learner_state_bytes,
    load_policy,
    make_local_engine,
    make_remote_client,
    make_weight_push,
)
from agentrl.loop.run_dir import prepare
from agentrl.loop.teacher import Teacher, make_teacher
from agentrl.rollout.chat import ChatTokenizer
from agentrl.rollout.engine import RolloutEngine
from agentrl.types import Task

if TYPE_CHECKING:
    from agentrl.inference.base import InferenceClient
    from agentrl.loop.loggers import Loggers


@dataclass
class RunParts:
    """The parts of one run, as :func:`assemble` made them (the trainer's state aside).

    Attributes:
        config: the resolved config.
        resume: the run directory was prepared to continue the run it holds.
        ranks: this process's place among the training ranks (one outside ``torchrun``).
        run_dir: the run directory, checked and made (by rank 0).
        train_tasks: the training split, in its file's (or generator's) order.
        eval_tasks: the held-out split.
        model: the policy, on ``model.device`` (under FSDP once the learner shards it).
        tokenizer: the policy's tokenizer.
        chat: the chat template over ``tokenizer``.
        learner: the learner that updates ``model``.
        client: the embedded engine, or the SGLang client of ``inference.endpoints`` (or of
            the engines ``inference.engine_gpus`` started: :mod:`agentrl.loop.engine_procs`).
        teacher: the on-policy distillation teacher, or ``None``.
        weight_push: the push to the endpoints (rank 0's), or ``None`` (in process, or disk).
        rollout: the training episodes' rollout engine.
        evaluator: the held-out episodes' (``train.eval_samples``, ``eval_temperature``).
        loggers: ``train.loggers`` beside ``metrics.jsonl`` (rank 0's), or ``None``.
    """

    config: TrainConfig
    resume: bool
    ranks: dist_ranks.Ranks
    run_dir: Path
    train_tasks: list[Task]
    eval_tasks: list[Task]
    model: Any
    tokenizer: Any
    chat: ChatTokenizer
    learner: Learner
    client: InferenceClient
    teacher: Teacher | None
    weight_push: Any
    rollout: RolloutEngine
    evaluator: RolloutEngine
    loggers: Loggers | None


def assemble(
    config: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    policy: tuple[Any, Any] | None = None,
    learner: Learner | None = None,
    client: InferenceClient | None = None,
) -> RunParts:
    """Make every part of the run ``config`` describes, in the order each needs the others.

    Args:
        config: the resolved config.
        resume: continue from the newest good checkpoint in ``config.run_dir``.
        overwrite: replace what ``config.run_dir`` holds (else a run directory that holds a run
            is refused unless ``resume``: :mod:`agentrl.loop.run_dir`).
        policy: ``(model, tokenizer)`` to train instead of loading ``model.path``.
        learner: a learner of the policy (``policy``'s model, when given) to use as it is.
        client: an engine or client serving the policy, to use as it is (it gets the learner's
            weights at the first push, like one made here).

    Raises:
        ConfigError: the config is wrong (before any model or file is made), or the run
            directory is refused.
    """
    # the config: everything that can be wrong with it fails here, before a model or a file
    if resume and config.run_dir is None:
        raise ConfigError("run_dir: resume needs the run directory to continue")
    import_envs(config.imports)
    ranks = dist_ranks.active()  # several under torchrun (agentrl.loop.ranks)
    train_tasks, eval_tasks = tasks_for(config, "train"), tasks_for(config, "test")
    run_dir = _run_dir(config, ranks, resume=resume, overwrite=overwrite)

    # the policy and its learner
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    model, tokenizer = policy if policy is not None else load_policy(config)
    chat = ChatTokenizer(tokenizer, template_kwargs=config.model.chat_template_kwargs)
    # several ranks: the engine copies the policy before the learner shards it; LoRA: before
    # the learner adds its adapters (the engine serves the base and takes the adapters apart)
    engine_model = None
    apart = ranks.world_size > 1 or config.learner.lora is not None
    dedicated = config.inference.engine_gpus is not None  # engines of its own (engine_procs)
    if client is None and apart and not config.inference.endpoints and not dedicated:
        engine_model = copy.deepcopy(model)
    if learner is None:
        learner = Learner(model, _learner_config(config))

    # what serves the policy, and what its weights reach it by
    served = config  # with engine_gpus: as if inference.endpoints were its engines
    if client is None and dedicated:
        served, client = start_engines(config, run_dir, model)
    elif client is None:
        client = _client(config, model, tokenizer, engine_model)
    try:
        teacher = make_teacher(config, tokenizer)  # on-policy distillation, or None
        weight_push = (  # None: disk or local; rank 0 pushes for every rank
            make_weight_push(served, learner.device) if ranks.is_main else None
        )
    except BaseException:
        if isinstance(client, DedicatedClient) and client.procs is not None:
            client.procs.stop()  # no server outlives a run that never started
        raise
    if isinstance(client, DedicatedClient):
        client.weight_push = weight_push  # torchrun: the gathered shards go out through it

    # the episodes, and where their figures go
    rollout = RolloutEngine(client, tokenizer, config.rollout, chat=chat)
    eval_rollout = config.rollout.model_copy(
        update={
            "group_size": config.train.eval_samples,
            "temperature": config.train.eval_temperature,
        }
    )
    evaluator = RolloutEngine(client, tokenizer, eval_rollout, chat=chat)
    loggers = _loggers(config, run_dir) if ranks.is_main else None
    return RunParts(
        config=config, resume=resume, ranks=ranks, run_dir=run_dir, train_tasks=train_tasks,
        eval_tasks=eval_tasks, model=model, tokenizer=tokenizer, chat=chat, learner=learner,
        client=client, teacher=teacher, weight_push=weight_push, rollout=rollout,
        evaluator=evaluator, loggers=loggers,
    )  # fmt: skip


def _run_dir(
    config: TrainConfig, ranks: dist_ranks.Ranks, *, resume: bool, overwrite: bool
) -> Path:
    """``config.run_dir`` (or a dated one under ``out_dir``), checked and made by rank 0."""
    stamp = ranks.broadcast(time.strftime("%Y%m%d-%H%M%S"))  # one run dir for all
    run_dir = Path(config.run_dir or Path(config.out_dir) / f"{config.name}-{stamp}")
    refused = None
    if ranks.is_main:
        try:
            prepare(run_dir, resume=resume, overwrite=overwrite)
        except ConfigError as e:
            refused = str(e)
    if ranks.broadcast(refused):
        raise ConfigError(refused or "run_dir")
    return run_dir


def _learner_config(config: TrainConfig) -> LearnerConfig:
    """``config.learner``, with the body a float32 learner can run when none was chosen."""
    learner_config = config.learner  # temperature and seed follow the rollout's
    if "body" not in learner_config.model_fields_set and learner_config.dtype != "bfloat16":
        # the packed body's FlashAttention has no float32: a float32 learner on a card
        learner_config = learner_config.model_copy(update={"body": "transformers"})
    return learner_config


def _client(config: TrainConfig, model: Any, tokenizer: Any, engine_model: Any) -> Any:
    """The SGLang client of ``inference.endpoints``, else the embedded engine.

    ``engine_model``: an unsharded copy of the policy (several ranks: this rank's engine), or
    ``None`` (the engine copies ``model`` on the learner's card).
    """
    if config.inference.endpoints:
        return make_remote_client(model, config)
    reserve = learner_state_bytes(model)  # the learner's lazily made state shares the card
    if engine_model is not None:
        return make_local_engine(
            engine_model, tokenizer, config, copy_model=False, reserve_bytes=reserve
        )
    return make_local_engine(model, tokenizer, config, reserve_bytes=reserve)


def _loggers(config: TrainConfig, run_dir: Path) -> Loggers:
    """The trackers of ``train.loggers`` (and the ``tensorboard`` alias), rank 0's."""
    from agentrl.loop.loggers import Loggers

    trackers = [*config.train.loggers, *(["tensorboard"] if config.tensorboard else [])]
    return Loggers(trackers, run_dir, name=run_dir.name, config=config.model_dump(mode="json"))
