"""Hugging Face transformers generation, one chunk at a time.

A chunk extends every unfinished sequence by at most ``max_tokens`` tokens
with the weights currently loaded, recording for each new token its log-prob
under the distribution it was sampled from and the weight version that
produced it. Between chunks the caller may load newer weights; the next chunk
re-encodes the prefix (prompt plus response so far) with them, so no cache
computed with older weights is ever reused.

Log-probs come from ``generate``'s processed scores: temperature, top-k and
top-p are applied before the log-softmax, so with top-k/top-p on, the record
is that of the truncated distribution the token was really drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from asyncrl.config import GeneratorsConfig


@dataclass
class Rollout:
    """One sample in progress: a prompt and the response generated so far."""

    group_id: int
    sample_index: int
    prompt_ids: list[int]
    ground_truth: str
    data_source: str = ""
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    started_at: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class HFBackend:
    def __init__(self, model: torch.nn.Module, tokenizer, sampling: GeneratorsConfig):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.version = 0
        # generate() fills unset fields from the model's own generation defaults
        # (a Hub model's top_k, repetition_penalty, ...): sample only from what
        # the config says, or the recorded log-probs would not be the learner's.
        self.model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Replace every parameter; a missing or extra tensor is an error, checked first."""
        expected = set(self.model.state_dict())
        if getattr(self.model.config, "tie_word_embeddings", False):
            expected.discard("lm_head.weight")  # tied to the embedding, may be omitted
        missing = expected - set(state_dict)
        extra = set(state_dict) - set(self.model.state_dict())
        if missing or extra:
            problem = f"missing {sorted(missing)}, extra {sorted(extra)}"
            raise ValueError(f"weights v{version} do not fit the model: {problem}")
        self.model.load_state_dict(state_dict, strict=False)
        self.version = version

    @torch.no_grad()
    def generate_chunk(self, rollouts: list[Rollout], max_tokens: int) -> None:
        """Extend each unfinished rollout by up to ``max_tokens`` tokens, in place."""
        active = [r for r in rollouts if not r.finished]
        if not active:
            return
        budget = self.sampling.max_new_tokens
        steps = min(max_tokens, max(budget - len(r.response_ids) for r in active))
        input_ids, attention_mask = self._left_pad([r.prompt_ids + r.response_ids for r in active])
        output = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self._generation_config(steps),
        )
        new_tokens = output.sequences[:, input_ids.shape[1] :]  # [B, steps']
        scores = torch.stack(output.scores, dim=1).float()  # [B, steps', V]
        logprobs = scores.log_softmax(-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        eos = self.tokenizer.eos_token_id
        for row, rollout in enumerate(active):
            for token, logprob in zip(
                new_tokens[row].tolist(), logprobs[row].tolist(), strict=True
            ):
                rollout.response_ids.append(token)
                rollout.logprobs.append(logprob)
                rollout.token_versions.append(self.version)
                if token == eos:
                    rollout.finish_reason = "stop"
                    break
                if len(rollout.response_ids) >= budget:
                    rollout.finish_reason = "length"
                    break

    def _generation_config(self, steps: int) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=steps,
            do_sample=True,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,  # 0 is off
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    def _left_pad(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in sequences)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(sequences), width), pad, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, width - len(sequence) :] = torch.tensor(sequence)
            mask[row, width - len(sequence) :] = 1
        return ids, mask
