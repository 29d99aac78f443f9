"""The whole run configuration: every section, and the checks that span sections."""

from __future__ import annotations

from pydantic import model_validator

from asyncrl.config.algorithm import AlgorithmField, GrpoConfig
from asyncrl.config.base import Section
from asyncrl.config.buffer import BufferConfig
from asyncrl.config.cluster import ClusterConfig
from asyncrl.config.data import DataConfig, EvalConfig, RewardConfig, TaskConfig
from asyncrl.config.environment import EnvironmentConfig
from asyncrl.config.generators import GeneratorsConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.run import ModelConfig, RunConfig, TrackingConfig
from asyncrl.config.weights import WeightsConfig


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig
    task: TaskConfig = TaskConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmField = GrpoConfig()
    buffer: BufferConfig = BufferConfig()
    learner: LearnerConfig = LearnerConfig()
    generators: GeneratorsConfig = GeneratorsConfig()
    tracking: TrackingConfig = TrackingConfig()
    cluster: ClusterConfig = ClusterConfig()
    weights: WeightsConfig = WeightsConfig()
    environment: EnvironmentConfig | None = None
    """Multi-turn episodes (tool calling); unset: one model turn per sample."""

    @model_validator(mode="after")
    def _tools_score_with_reward_function(self) -> Config:
        """The built-in `tools` environment scores final answers with `reward.function`
        unless its own `kwargs.compute_score` says otherwise: one reward setting serves
        single-turn and multi-turn runs, and the preflight checks the same function."""
        environment = self.environment
        if environment is None or environment.name != "tools" or not self.reward.function:
            return self
        if "compute_score" not in environment.kwargs:
            environment.kwargs = {**environment.kwargs, "compute_score": self.reward.function}
        return self

    @model_validator(mode="after")
    def _weights_fresh_enough(self) -> Config:
        k = self.buffer.max_staleness
        if self.learner.sync_interval > k + 1:
            raise ValueError(
                f"learner.sync_interval={self.learner.sync_interval} must be at most "
                f"buffer.max_staleness + 1 = {k + 1}: generators would only hold weights "
                "too stale to train on; raise buffer.max_staleness or lower learner.sync_interval"
            )
        return self

    @model_validator(mode="after")
    def _minibatches_fit(self) -> Config:
        if self.learner.minibatches > self.algorithm.samples_per_step:
            raise ValueError(
                f"learner.minibatches={self.learner.minibatches} is more than the "
                f"{self.algorithm.samples_per_step} samples of a batch "
                "(algorithm.group_size * algorithm.prompts_per_step)"
            )
        return self

    @model_validator(mode="after")
    def _eval_can_run(self) -> Config:
        evaluation = self.eval
        if not evaluation.enabled:
            return self
        if evaluation.every_steps % self.learner.sync_interval:
            raise ValueError(
                f"eval.every_steps={evaluation.every_steps} must be a multiple of "
                f"learner.sync_interval={self.learner.sync_interval}: a round evaluates "
                "weights the generators have, and only every sync_interval-th version is published"
            )
        if self.data.train_files and not evaluation.files:
            raise ValueError(
                "eval.files is empty but data.train_files is set: name held-out prompt files "
                "(e.g. the test split) in eval.files; the built-in task's prompts would not "
                "measure this run"
            )
        if not evaluation.files:
            space = 10**self.task.num_digits
            if evaluation.max_prompts > space // 2:
                raise ValueError(
                    f"eval.max_prompts={evaluation.max_prompts} is more than half of the "
                    f"{space} prompts of task.num_digits={self.task.num_digits}: training "
                    "never draws eval prompts, so it would have too few left; lower "
                    "eval.max_prompts or raise task.num_digits"
                )
        for pool in self.generators.resolved_pools():
            if evaluation.samples_per_prompt > pool.settings.max_active_samples:
                raise ValueError(
                    f"eval.samples_per_prompt={evaluation.samples_per_prompt} is more than "
                    f"generators.max_active_samples={pool.settings.max_active_samples} (pool "
                    f"{pool.name!r}): an eval prompt's samples go to one replica together"
                )
        return self


# --------------------------------------------------------------------------
# warnings


def config_warnings(config: Config) -> list[str]:
    """Valid but risky settings, one human-readable line each, to print at launch."""
    warnings: list[str] = []
    algorithm, buffer = config.algorithm, config.buffer
    if algorithm.correction == "none" and buffer.max_staleness > 0:
        warnings.append(
            f"algorithm.correction=none with buffer.max_staleness={buffer.max_staleness}: "
            "tokens sampled by older policies are trained as if on-policy, so the clipped "
            "ratio no longer bounds the update; uncorrected off-policy PPO has collapsed "
            "silently in other trainers. Use algorithm.correction=tis (the default), or "
            "buffer.max_staleness=0"
        )
    return warnings
