"""The built-in synthetic task and its character-level tokenizer (no downloads).

``digits``: the prompt is a string of random digits followed by ``=``; the right
answer is each digit plus ``shift``, mod 10 (``372=`` -> ``483``). The reward
is the fraction of answer positions the response gets right, so it lies in
[0, 1] and depends on the prompt: any fixed output scores 0.1 on average.
A randomly initialised model learns it from reward alone in a few hundred
updates, which is what a quickstart needs.

Prompts are a pure function of (seed, index): the buffer's dataset cursor is
just an integer, so a resumed run hands out the same prompts from the same place.

Held-out evaluation (``eval:``, :func:`eval_work_items`) draws its prompts from
another stream (:func:`eval_digits`), and training then redraws any prompt that
is one of them, so the two never share a prompt: with 3 digits there are only
1000, and a training run sees most of them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

# The tokenizer and the task's reward live in their own modules (the tiny model and the
# reward workers need them without the rest of this one); imported from here as before.
from asyncrl.generation.char_tokenizer import build_tokenizer
from asyncrl.generation.rewards import REWARD_FUNCTIONS as REWARD_FUNCTIONS
from asyncrl.generation.rewards import check_reward_sources
from asyncrl.generation.rewards import digits_score as digits_score

if TYPE_CHECKING:  # imported lazily: the buffer imports this module, and needs no transformers
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from asyncrl.config import Config, TaskConfig
    from asyncrl.core.messages import WorkItem
    from asyncrl.generation.data import PromptDataset, PromptRow


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    ground_truth: str
    data_source: str


class DigitsTask:
    """Prompt ``index`` is drawn from its own seeded RNG: random access, no state.

    ``exclude``: digit strings never drawn (the held-out eval prompts); a draw that
    hits one is drawn again from the same RNG, so prompts stay a function of the index.
    """

    data_source = "synthetic/digits"

    def __init__(self, config: TaskConfig, seed: int | str, exclude: Collection[str] = ()):
        self.config = config
        self.seed = seed
        self.exclude = frozenset(exclude)
        if len(self.exclude) >= 10**config.num_digits:
            raise ValueError(f"every {config.num_digits}-digit prompt is excluded")

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"{self.seed}:{index}")
        while True:
            digits = "".join(rng.choice("0123456789") for _ in range(self.config.num_digits))
            if digits not in self.exclude:
                break
        return self.make_prompt(index, digits)

    def make_prompt(self, index: int, digits: str) -> Prompt:
        answer = "".join(str((int(d) + self.config.shift) % 10) for d in digits)
        return Prompt(index, f"{digits}=", answer, self.data_source)

    def encode_prompt(self, prompt: Prompt, tokenizer: PreTrainedTokenizerFast) -> list[int]:
        return [tokenizer.bos_token_id, *tokenizer.encode(prompt.text, add_special_tokens=False)]


def eval_digits(config: Config) -> list[str]:
    """The built-in task's held-out prompts (digit strings): ``eval.max_prompts`` distinct
    ones from a stream seeded apart from training's, in a fixed order."""
    rng = random.Random(f"eval:{config.run.seed}")
    count = min(config.eval.max_prompts, 10**config.task.num_digits // 2)
    chosen: dict[str, None] = {}  # insertion-ordered set
    while len(chosen) < count:
        chosen["".join(rng.choice("0123456789") for _ in range(config.task.num_digits))] = None
    return list(chosen)


def eval_group_id(position: int) -> int:
    """The group id of eval prompt ``position``: negative, so never a training group's."""
    return -1 - position


def eval_work_items(config: Config) -> list[WorkItem]:
    """The held-out prompts of every eval round, in order (empty when ``eval`` is off).

    Each is a group of ``eval.samples_per_prompt`` samples with group id
    :func:`eval_group_id`; the buffer tags a round's copies with its number. From
    ``eval.files``: a fixed sample of ``eval.max_prompts`` rows drawn with
    ``run.seed``; otherwise the built-in task's held-out prompts (:func:`eval_digits`).
    """
    evaluation = config.eval
    if not evaluation.enabled:
        return []
    samples = evaluation.samples_per_prompt
    if evaluation.files:
        dataset = _checked_dataset(config, evaluation.files, shuffle=True)
        positions = range(min(evaluation.max_prompts, len(dataset)))
        # epoch 0 of a shuffled dataset: distinct rows, a seeded permutation
        return [_row_item(config, eval_group_id(p), samples, dataset[p]) for p in positions]
    task = DigitsTask(config.task, config.run.seed)
    tokenizer = build_tokenizer()
    items = []
    for position, digits in enumerate(eval_digits(config)):
        prompt = task.make_prompt(eval_group_id(position), digits)
        items.append(_task_item(config, samples, task, prompt, tokenizer))
    return items


def work_item_factory(config: Config) -> Callable[[int], WorkItem]:
    """``index -> WorkItem``: prompt ``index``, tokenized, as one group.

    With ``data.train_files`` set, prompts come from those files
    (:class:`asyncrl.generation.data.PromptDataset`, rendered with the model's chat template);
    otherwise from the built-in task, never one of its held-out eval prompts when
    ``eval`` is on.
    """
    group_size = config.algorithm.group_size
    if config.data.train_files:
        dataset = _checked_dataset(config, config.data.train_files, shuffle=config.data.shuffle)
        return lambda index: _row_item(config, index, group_size, dataset[index])

    tokenizer = build_tokenizer()
    held_out = eval_digits(config) if config.eval.enabled and not config.eval.files else []
    task = DigitsTask(config.task, config.run.seed, exclude=held_out)
    return lambda index: _task_item(config, group_size, task, task.prompt(index), tokenizer)


def _checked_dataset(config: Config, files: list[str], shuffle: bool) -> PromptDataset:
    """Prompt files read with the policy's tokenizer, each data source with a reward function."""
    from asyncrl.generation.data import PromptDataset

    dataset = PromptDataset(
        files,
        prompt_tokenizer(config),
        max_prompt_tokens=config.data.max_prompt_tokens,
        shuffle=shuffle,
        seed=config.run.seed,
    )
    check_reward_sources(config.reward.function, dataset.data_sources)
    return dataset


def _row_item(config: Config, group_id: int, samples: int, row: PromptRow) -> WorkItem:
    """A prompt file's row as a group; with an environment it renders the row's messages."""
    from asyncrl.core.messages import WorkItem
    from asyncrl.generation.data import DataError

    if config.environment is not None and not row.messages:
        raise DataError(f"{row.source}: a plain-text prompt; an environment needs chat messages")

    return WorkItem(
        group_id,
        samples,
        row.prompt_ids,
        row.ground_truth,
        row.data_source,
        extra_info=row.extra_info,
        messages=row.messages if config.environment is not None else [],
    )


def _task_item(
    config: Config,
    samples: int,
    task: DigitsTask,
    prompt: Prompt,
    tokenizer: PreTrainedTokenizerFast,
) -> WorkItem:
    """A built-in task prompt as a group (its index is the group id)."""
    from asyncrl.core.messages import WorkItem

    with_messages = config.environment is not None  # the environment renders the prompt
    return WorkItem(
        prompt.index,
        samples,
        task.encode_prompt(prompt, tokenizer),
        prompt.ground_truth,
        prompt.data_source,
        messages=[{"role": "user", "content": prompt.text}] if with_messages else [],
    )


def prompt_tokenizer(config: Config) -> PreTrainedTokenizerBase:
    """The policy's tokenizer as :func:`asyncrl.generation.models.build_policy` loads it
    (no model)."""
    if config.model.name_or_path is None:
        return build_tokenizer()
    from asyncrl.generation.models import load_tokenizer

    return load_tokenizer(config.model.name_or_path)
