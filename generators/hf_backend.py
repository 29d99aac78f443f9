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

Within a chunk, ``generate`` runs the whole batch (left-padded) with its KV
cache, one forward per token after the prefill. Rows whose prefix is the same
(a group's samples in their first chunk: the same prompt) are prefilled once,
their cache copied to each (:func:`shared_prefill`): with 8 samples a prompt,
one eighth of the prefill. Stop strings are matched on the
decoded response (:class:`~asyncrl.generators.backend.StopStrings`); the
sequence ends at the token that completes one and what ``generate`` sampled
after it in the same chunk is dropped, log-probs with it. ``abort`` from another
thread ends the chosen rows at the next token (a stopping criterion).

With LoRA adapters published alone, the model gets peft's LoRA layers (all zero: the
base) and each version loads into them alone (:class:`~asyncrl.generation.lora.AdapterWeights`,
what every weight path sees as the engine's tensors); the forward is peft's, the
learner's. After each load the adapter is read back from the model and digested
(``adapter_digest``): what the replica reports to the buffer for that version.

A pool that asks for a GPU (``generators.num_gpus`` > 0; under Ray, the GPU Ray gave
the replica) generates on it: the model moves there and each chunk's inputs with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import torch
from transformers import DynamicCache, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from asyncrl.config import GeneratorsConfig, LoraConfig
from asyncrl.generation import lora
from asyncrl.generators.backend import (
    Rollout,
    StopStrings,
    append_tokens,
    load_module_in_parts,
    module_buffers,
)

__all__ = ["HFBackend", "Rollout"]  # Rollout lives in asyncrl.generators.backend


class _AbortRows(StoppingCriteria):
    """Ends the rows whose rollouts were aborted; remembers how many tokens each had."""

    def __init__(self, backend: HFBackend, rows: list[Rollout], prefix_width: int):
        self.backend = backend
        self.rows = rows
        self.prefix_width = prefix_width
        self.kept: dict[int, int] = {}  # row -> new tokens it keeps

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        aborted = self.backend._aborted
        if aborted:
            for row, rollout in enumerate(self.rows):
                if id(rollout) in aborted:
                    done[row] = True
                    self.kept.setdefault(row, input_ids.shape[1] - self.prefix_width)
        return done


def shared_prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> DynamicCache | None:
    """The KV cache of every row's prefix but its last token, each distinct prefix
    computed once; None when no two rows are the same (``generate`` then prefills).

    The positions are those ``generate`` gives left-padded rows (the count of real tokens
    before each), so the tokens it samples next see the cache it would have made.
    """
    rows = [tuple(row) for row in input_ids.tolist()]
    distinct: dict[tuple[int, ...], int] = {}
    which = [distinct.setdefault(row, len(distinct)) for row in rows]
    if len(distinct) == len(rows) or input_ids.shape[1] < 2:
        return None
    firsts = [which.index(index) for index in range(len(distinct))]
    mask = attention_mask[firsts, :-1]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    decoder = model.get_decoder()  # the layers without the LM head: no logits are needed
    decoder(
        input_ids=input_ids[firsts, :-1],
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
    )
    cache.reorder_cache(torch.tensor(which, device=input_ids.device))  # [distinct] -> [rows]
    return cache


def engine_device(sampling: GeneratorsConfig) -> torch.device:
    """Where a replica generates: CUDA when its pool asks for a GPU, else the CPU."""
    if sampling.num_gpus <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"generators.num_gpus={sampling.num_gpus:g} asks for a GPU, but torch sees no "
            "CUDA device; set generators.num_gpus=0 to generate on the CPU"
        )
    return torch.device("cuda")


class HFBackend:
    """The transformers engine: ``generate`` on the policy module held in this process."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        sampling: GeneratorsConfig,
        adapters: LoraConfig | None = None,
    ):
        """``adapters``: LoRA adapters published alone, applied to ``model`` as its base."""
        self.device = engine_device(sampling)
        self.model = model.to(self.device).eval()
        self.loads_into: torch.nn.Module | lora.AdapterWeights = self.model
        """What a version loads into: the model, or its LoRA adapters alone."""
        self.adapter_digest: str | None = None
        """The digest of the adapters held (read back after each load); None: no LoRA."""
        if adapters is not None:
            self.loads_into = lora.inject_adapters(self.model, adapters)
            self.adapter_digest = self.loads_into.digest()
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.version = 0
        self.last_load_s = 0.0
        self._homes: list[torch.Tensor] | None = None  # weight_buffers' (collective path)
        self._receiving_since = 0.0
        self._lock = threading.Lock()
        self._in_chunk: set[int] = set()  # ids of the rollouts the running chunk generates
        self._aborted: frozenset[int] = frozenset()
        # generate() fills unset fields from the model's own generation defaults
        # (a Hub model's top_k, repetition_penalty, ...): sample only from what
        # the config says, or the recorded log-probs would not be the learner's.
        self.model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace every parameter; a missing or extra tensor is an error, checked first.

        No cache outlives a chunk here (every chunk re-encodes its prefix), so
        nothing computed with the old weights can be reused after this.
        """
        self.load_weights_in_parts(list(state_dict), [state_dict], version)

    def load_weights_in_parts(
        self, names: Sequence[str], parts: Iterable[Mapping[str, torch.Tensor]], version: int
    ) -> None:
        """``load_weights`` with the tensors arriving in parts (see Backend): the names are
        checked first, each part is copied in as it comes, ``version`` holds after the last."""
        start = time.perf_counter()
        optional = set()
        if self.loads_into is self.model and getattr(
            self.model.config, "tie_word_embeddings", False
        ):
            optional.add("lm_head.weight")  # tied to the embedding, may be omitted
        load_module_in_parts(self.loads_into, optional, names, parts, version)
        self._loaded(version)
        self.last_load_s = time.perf_counter() - start

    def _loaded(self, version: int) -> None:
        """``version`` is in the engine: later tokens get it, and its adapters' digest."""
        self.version = version
        if self.adapter_digest is not None:
            self.adapter_digest = self.loads_into.digest()

    def weight_buffers(self, buckets: Sequence) -> list[torch.Tensor] | None:
        """The model's tensors as one flat buffer per bucket (see Backend): the collective
        path receives into them, with no copy after the transfer."""
        self._receiving_since = time.perf_counter()
        if self.device.type != "cpu":  # the broadcast arrives in host buffers: load from them
            return None
        self._homes = module_buffers(self.loads_into, buckets, self._homes)
        return self._homes

    def weights_written(self, version: int) -> None:
        """The buffers hold ``version`` (no cache outlives a chunk here, as in load_weights)."""
        self._loaded(version)
        self.last_load_s = time.perf_counter() - self._receiving_since

    def abort(self, rollouts: Iterable[Rollout]) -> None:
        """End ``rollouts`` at the next token of the running chunk (any thread); see Backend."""
        with self._lock:
            self._aborted = self._aborted | ({id(r) for r in rollouts} & self._in_chunk)

    def close(self) -> None:
        """Nothing to release: the model is an ordinary module of this process."""

    @torch.no_grad()
    def generate_chunk(self, rollouts: list[Rollout], max_tokens: int) -> None:
        """Extend each unfinished rollout by up to ``max_tokens`` tokens, in place."""
        active = [r for r in rollouts if not r.finished]
        if not active:
            return
        budget = self.sampling.max_new_tokens
        steps = min(max_tokens, max(r.token_limit(budget) - len(r.response_ids) for r in active))
        input_ids, attention_mask = self._left_pad([r.prompt_ids + r.response_ids for r in active])
        aborts = _AbortRows(self, active, input_ids.shape[1])
        with self._lock:
            self._in_chunk = {id(r) for r in active}
        try:
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=shared_prefill(self.model, input_ids, attention_mask),
                generation_config=self._generation_config(steps),
                stopping_criteria=StoppingCriteriaList([aborts]),
            )
        finally:
            with self._lock:
                self._in_chunk, self._aborted = set(), frozenset()
        new_tokens = output.sequences[:, input_ids.shape[1] :]  # [B, steps']
        # log-softmax at the sampled token, step by step: no [B, steps', V] copy is made
        logprobs = torch.stack(
            [
                step.float().gather(-1, new_tokens[:, t, None])[:, 0] - step.float().logsumexp(-1)
                for t, step in enumerate(output.scores)  # each [B, V]
            ],
            dim=1,
        )  # [B, steps']
        stop = StopStrings(self.tokenizer, self.sampling.stop)
        for row, rollout in enumerate(active):
            kept = aborts.kept.get(row, new_tokens.shape[1])
            append_tokens(
                rollout,
                new_tokens[row, :kept].tolist(),
                logprobs[row, :kept].tolist(),
                self.version,
                eos_token_id=self.tokenizer.eos_token_id,
                max_new_tokens=budget,
                stop=stop,
            )

    def _generation_config(self, steps: int) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=steps,
            do_sample=True,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,  # 0 is off
            use_cache=True,  # one forward per new token after the prefill
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
        return ids.to(self.device), mask.to(self.device)
