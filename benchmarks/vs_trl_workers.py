"""The two halves of ``benchmarks/vs_trl.py`` that run in processes of their own.

    python benchmarks/vs_trl_workers.py trl  --seed S --steps N --out DIR   # TRL trains
    python benchmarks/vs_trl_workers.py eval --policy DIR --out FILE         # one evaluator

``trl``: Hugging Face TRL's ``GRPOTrainer`` (synchronous: generate, score, train, in
one process) on the model, data, reward and hyperparameters of
``configs/smollm2_arithmetic.yaml``, set as that config sets them (see
:func:`trl_config`); it records each optimizer step's wall time, the part of it
spent generating and scoring, and the tokens it trained on, and saves the final
policy to ``DIR/final``.

``eval``: the one evaluator both final policies (and the untrained model) go
through: the held-out prompts of ``data/arithmetic/test.parquet``, each sampled
``--samples`` times at the config's temperature with Hugging Face ``generate``,
scored by the task's reward function; the same seed for every policy.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples" / "arithmetic"))
from reward import compute_score  # noqa: E402  (the task's own reward function)

MODEL = REPO / "models" / "SmolLM2-135M-Instruct"
TRAIN = REPO / "data" / "arithmetic" / "train.parquet"
TEST = REPO / "data" / "arithmetic" / "test.parquet"
SETTINGS = {
    "prompts_per_step": 4,
    "group_size": 8,
    "lr": 2e-5,
    "temperature": 0.7,
    "max_new_tokens": 32,
    "clip": 0.2,
    "grad_clip": 1.0,
}
"""``configs/smollm2_arithmetic.yaml``'s values, which both sides run with."""
EVAL_PROMPTS_PER_BATCH = 8
"""The evaluator generates this many prompts' samples in one ``generate`` call."""


# --------------------------------------------------------------------------- TRL


def trl_config(output_dir: Path, seed: int, steps: int):
    """GRPOConfig set as the asyncrl config is; where TRL's default differs, it is named."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=SETTINGS["prompts_per_step"] * SETTINGS["group_size"],
        num_generations=SETTINGS["group_size"],
        gradient_accumulation_steps=1,  # one optimizer update per batch, as asyncrl
        num_iterations=1,
        max_completion_length=SETTINGS["max_new_tokens"],
        temperature=SETTINGS["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=SETTINGS["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=SETTINGS["grad_clip"],
        epsilon=SETTINGS["clip"],
        beta=0.0,  # no KL term, as asyncrl's kl_coef 0
        loss_type="dapo",  # token-level, normalised by the batch's tokens: token-mean
        scale_rewards="group",  # (r - group mean) / group std: asyncrl's grpo
        gradient_checkpointing=False,  # TRL's default recomputes activations; asyncrl does not
        bf16=False,  # fp32, as model.dtype: float32
        use_cpu=True,
        max_steps=steps,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def train_dataset():
    from datasets import Dataset

    rows = pq.read_table(TRAIN).to_pylist()
    return Dataset.from_list(
        [
            {
                "prompt": row["prompt"],
                "ground_truth": row["reward_model"]["ground_truth"],
                "data_source": row["data_source"],
            }
            for row in rows
        ]
    )


def arithmetic_reward(prompts, completions, ground_truth, data_source, **_) -> list[float]:
    """The task's ``compute_score`` in TRL's reward signature."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [
        compute_score(source, text, truth)
        for source, text, truth in zip(data_source, texts, ground_truth, strict=True)
    ]


def run_trl(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    steps: list[dict] = []

    class Timed(GRPOTrainer):
        """Times generation and scoring apart from the whole step, and counts tokens."""

        def _generate_and_score_completions(self, inputs):
            started = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            tokens = int(out["prompt_mask"].sum() + out["completion_mask"].sum())
            steps.append({"generate_s": time.perf_counter() - started, "tokens": tokens})
            return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.began = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps[-1]["step_s"] = time.perf_counter() - self.began
            steps[-1]["time_s"] = time.perf_counter() - started

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    trainer = Timed(
        model=model,
        reward_funcs=arithmetic_reward,
        args=trl_config(args.out / "trl", args.seed, args.steps),
        train_dataset=train_dataset(),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    started = time.perf_counter()
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    for step, reward in zip(steps, rewards, strict=False):
        step["reward_mean"] = reward
    trainer.save_model(str(args.out / "final"))
    tokenizer.save_pretrained(args.out / "final")
    (args.out / "steps.json").write_text(json.dumps(steps, indent=1) + "\n")


# --------------------------------------------------------------------------- eval


def run_eval(args) -> None:
    """Mean reward of ``--policy`` over the held-out prompts; writes ``--out`` (JSON)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.policy, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32).eval()
    rows = pq.read_table(TEST).to_pylist()[: args.prompts]
    started = time.perf_counter()
    per_prompt = []
    for first in range(0, len(rows), EVAL_PROMPTS_PER_BATCH):
        batch_rows = rows[first : first + EVAL_PROMPTS_PER_BATCH]
        texts = [
            tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
            for row in batch_rows
        ]
        batch = tokenizer(
            [text for text in texts for _ in range(args.samples)],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        torch.manual_seed(args.seed * 100_003 + first)  # the same draws for every policy
        with torch.no_grad():
            out = model.generate(
                **batch,
                do_sample=True,
                temperature=SETTINGS["temperature"],
                top_p=1.0,
                top_k=0,
                max_new_tokens=SETTINGS["max_new_tokens"],
                pad_token_id=tokenizer.pad_token_id,
            )
        width = batch["input_ids"].shape[1]
        replies = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        for index, row in enumerate(batch_rows):
            truth = row["reward_model"]["ground_truth"]
            mine = replies[index * args.samples : (index + 1) * args.samples]
            per_prompt.append(
                statistics.fmean(compute_score(row["data_source"], r, truth) for r in mine)
            )
    mean = statistics.fmean(per_prompt)
    stderr = statistics.stdev(per_prompt) / math.sqrt(len(per_prompt))
    result = {
        "policy": str(args.policy),
        "reward_mean": mean,
        "reward_stderr": stderr,
        "prompts": len(per_prompt),
        "samples_per_prompt": args.samples,
        "seconds": time.perf_counter() - started,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    trl = sub.add_parser("trl")
    trl.add_argument("--seed", type=int, required=True)
    trl.add_argument("--steps", type=int, required=True)
    trl.add_argument("--out", type=Path, required=True)
    trl.add_argument("--threads", type=int, default=2)
    ev = sub.add_parser("eval")
    ev.add_argument("--policy", type=Path, required=True)
    ev.add_argument("--out", type=Path, required=True)
    ev.add_argument("--prompts", type=int, default=64)
    ev.add_argument("--samples", type=int, default=8)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.what == "trl":
        args.out.mkdir(parents=True, exist_ok=True)
        run_trl(args)
    else:
        run_eval(args)


if __name__ == "__main__":
    main()
