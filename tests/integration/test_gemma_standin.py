"""A tiny random Gemma-3 stands in for Gemma-3-270M: the same paths, in CI's time.

Gemma-3-270M (``bash scripts/gemma3.sh``, 1.1 GB, 19.5 s a learner step on 2 cores) is
what ``configs/gemma3_arithmetic.yaml`` trains, and docs/real-model.md ("A second model
family") lists what it does that SmolLM2 does not: a 262,144-token vocabulary (the
learner's LM head runs in chunks), sliding-window attention, tied embeddings, plain-text
prompts with no chat template, and a BOS the model needs before any text. The folder the
module fixture :func:`gemma_dir` writes has each of those in a model of 8.4M parameters
(33 MB): ``Gemma3ForCausalLM`` with two layers, one sliding (window of
:data:`WINDOW` tokens, shorter than every prompt) and one full, hidden size 32, the
embedding tied to the head, and a character-level tokenizer of 262,144 entries (the
characters of the arithmetic prompts, the specials, and unused fillers) with no chat
template, whose post-processor puts ``<bos>`` first, and an ``<end_of_turn>`` that is not
its EOS.

``configs/gemma3_arithmetic.yaml`` is launched on it as it ships, shortened: 2 prompts x
8 samples of :data:`MAX_NEW_TOKENS` tokens, no eval, synchronous
(``buffer.max_staleness=0``, so every step's ``logprob_mismatch`` compares the
generator's log-probs with the learner's for the same weights), a checkpoint after step
2, then ``--resume`` to step 3. Measured figures are printed (run with ``-s``).

What it cannot stand in for: a trained model's behaviour (a random model answers no sum,
so the reward here is the answer's length, see :data:`REWARD`); Gemma's real tokenizer
(SentencePiece, byte fallback) and its GGUF conversion (``load_tokenizer``'s
``add_bos_token`` from the file); the real widths (head_dim 256, 18 layers,
``query_pre_attn_scalar`` 256); vLLM. And the learner's layout: Gemma's window (512) is
longer than its rows, so its run packs each group into one sequence, while here rows
are longer than the window and the learner runs them padded (as it must: packing is
only for micro-batches within the window); that Gemma-3 computes the same log-probs
packed as padded is the learner's own check at start, asserted here in-process.
"""

from __future__ import annotations

import json
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.learner import packing
from asyncrl.learner.algorithms import logprobs as head_chunks
from asyncrl.run.status import read_metrics
from tests.helpers.run_processes import processes_of

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs/gemma3_arithmetic.yaml"
VOCAB = 262_144
"""Gemma-3's vocabulary."""
WINDOW = 16
"""The sliding layer's window: every prompt is longer (33-35 tokens with the BOS)."""
STEPS, MORE_STEPS = 2, 3
"""Steps of the first launch (checkpointed at its last), and the total after ``--resume``."""
PROMPTS_PER_STEP, GROUP_SIZE = 2, 8
SAMPLES = PROMPTS_PER_STEP * GROUP_SIZE
MAX_NEW_TOKENS = 20
"""A random model over 262,144 tokens almost never samples the ``"\\n"`` stop or the EOS
(about 1 in 262,144 a token), so its answers run to this length: 16 x 20 = 320 trained
tokens a step, over the 256 (``HEAD_CHUNK_ELEMENTS / VOCAB``) past which the head is
chunked; and over one engine chunk (``generators.chunk_tokens: 16``), so the HF engine's
second chunk of each answer re-encodes a prefix longer than the window."""
MISMATCH = 1e-4
"""Largest mean |generator - learner| log-prob of a step. Both are the same transformers
module in float32, differing by padding (left in the engine, right in the learner), the
engine's chunked re-encoding and thread counts: measured 1.2-1.5e-7 here, 1.0e-6 to
2.2e-6 on the real Gemma-3-270M. A generator or learner that ignored the sliding window
on these lengths would be off by about 0.1 (measured in
:func:`test_the_stand_in_has_gemma3_s_traits_and_its_sliding_layer_masks`, which asserts
it is over 100 x this), so the tolerance sits between the two by orders of magnitude."""
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>"]
"""Gemma's ids for the first four (0 pad, 1 eos, 2 bos, 3 unk); its end of turn is 106."""
BOS_ID = 2
CHARACTERS = list("0123456789+-=?:.,!\n " + string.ascii_letters)
"""Every character of the arithmetic prompts, and some."""
REWARD = '''\
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The answer's length modulo 5, in [0, 1]: a random model answers no sum, so the
    arithmetic reward would be 0 for every sample, every advantage 0 and no weight
    would move; lengths differ within a group, so these rewards do."""
    return (len(solution_str) % 5) / 4
'''


def tiny_gemma3_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=WINDOW,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=BOS_ID,
    )


def tiny_gemma3_tokenizer():
    """Characters as tokens (a WordLevel vocabulary), padded to Gemma's 262,144 entries with
    unused fillers, so that whatever id the model samples decodes; BOS first on encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + CHARACTERS
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=["<end_of_turn>"],
    )


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder of the tiny random Gemma-3 and its tokenizer (41 MB)."""
    from transformers import Gemma3ForCausalLM

    output = tmp_path_factory.mktemp("gemma3-standin")
    torch.manual_seed(0)
    Gemma3ForCausalLM(tiny_gemma3_config()).save_pretrained(output)
    tiny_gemma3_tokenizer().save_pretrained(output)
    return output


@pytest.fixture(scope="module")
def text_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train.parquet and test.parquet of plain-text prompts, by the example's data script."""
    output = tmp_path_factory.mktemp("arithmetic-text")
    command = [
        sys.executable, str(REPO / "examples/arithmetic/data.py"), "--text",
        "--output", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (output / "train.parquet").is_file() and (output / "test.parquet").is_file()
    return output


def files(model_dir: Path, data_dir: Path, reward: Path) -> list[str]:
    """The shipped config on the stand-in, the text data and the length reward."""
    return [
        f"model.name_or_path={model_dir}",
        f"data.train_files=[{data_dir / 'train.parquet'}]",
        f"eval.files=[{data_dir / 'test.parquet'}]",
        f"reward.function={reward}:compute_score",
    ]


SHORTENED = [
    "eval.every_steps=0", "eval.before_training=false", "eval.at_end=false",
    f"algorithm.prompts_per_step={PROMPTS_PER_STEP}", f"algorithm.group_size={GROUP_SIZE}",
    f"generators.max_new_tokens={MAX_NEW_TOKENS}",
    "buffer.max_staleness=0", "tracking.aim=false",
]  # fmt: skip
"""The run shortened (see the module docstring)."""


def asyncrl(*arguments: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "asyncrl", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def sequence_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits.float().log_softmax(-1)
    return logprobs[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]


# ---------------------------------------------------------------------------- the folder


def test_the_stand_in_has_gemma3_s_traits_and_its_sliding_layer_masks(gemma_dir, text_data):
    from asyncrl.generation.data import encode_text, read_rows, render_row
    from asyncrl.generation.models import load_tokenizer

    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["vocab_size"] == VOCAB
    assert config["tie_word_embeddings"] is True
    assert set(config["layer_types"]) == {"sliding_attention", "full_attention"}
    assert config["sliding_window"] == WINDOW
    assert (gemma_dir / "model.safetensors").stat().st_size < 40e6

    tokenizer = load_tokenizer(str(gemma_dir))  # as every role loads it
    assert tokenizer.chat_template is None and len(tokenizer) == VOCAB
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn != tokenizer.eos_token_id and end_of_turn != tokenizer.unk_token_id
    assert tokenizer.bos_token_id == BOS_ID
    rows = list(read_rows(text_data / "train.parquet"))
    assert rows and all(row.form == "text" for row in rows)
    prompts = [render_row(tokenizer, row) for row in rows]
    assert all(ids[0] == BOS_ID and BOS_ID not in ids[1:] for ids in prompts)
    assert not any(tokenizer.unk_token_id in ids for ids in prompts)  # every character known
    assert min(map(len, prompts)) > WINDOW
    assert (
        encode_text(tokenizer, rows[0].text)[1:]
        == tokenizer(rows[0].text, add_special_tokens=False)["input_ids"]
    )
    assert tokenizer.decode(prompts[0], skip_special_tokens=True) == rows[0].text

    # the sliding layer masks at the run's lengths: the same weights with a window as long
    # as the sequence give other log-probs, by far more than MISMATCH
    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    wide_config = tiny_gemma3_config()
    wide_config.sliding_window = 4096
    wide = type(model)(wide_config).eval()
    wide.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(0)
    response = torch.randint(len(SPECIALS), VOCAB, (MAX_NEW_TOKENS,), generator=generator)
    ids = torch.cat([torch.tensor(prompts[0]), response])[None]
    narrow_lp, wide_lp = sequence_logprobs(model, ids), sequence_logprobs(wide, ids)
    # within the window both see the same tokens
    torch.testing.assert_close(narrow_lp[: WINDOW - 1], wide_lp[: WINDOW - 1], atol=1e-6, rtol=0)
    difference = (narrow_lp - wide_lp)[-MAX_NEW_TOKENS:].abs().mean().item()
    print(f"\n[stand-in] mean |log-prob| difference, window {WINDOW} vs none: {difference:.3g}")
    assert difference > 100 * MISMATCH

    # the learner's check at start (the same tokens packed with a 4-D mask and padded, in
    # rows within the window) passes on Gemma-3, so it packs micro-batches within the window
    layout = packing.Layout(model, "auto", torch.device("cpu"), world_size=1)
    assert layout.packed and layout.window == WINDOW, layout.reason


def test_validate_says_the_files_hold_plain_text_prompts(gemma_dir, text_data, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    # the shipped config as it is but for the paths: eval on, so its files are read too
    result = asyncrl("validate", str(CONFIG), *files(gemma_dir, text_data, reward))
    assert result.returncode == 0, result.stdout + result.stderr
    for key, name, rows in (("data.train_files", "train", 192), ("eval.files", "test", 64)):
        note = (
            f"{key}: {text_data / f'{name}.parquet'}: {rows} rows of plain text "
            "(as it is, the tokenizer's BOS rule)"
        )
        assert note in result.stderr, result.stderr
    assert "chat messages" not in result.stderr


# ---------------------------------------------------------------------------- the run


@pytest.mark.timeout(600)
def test_a_run_keeps_log_probs_resumes_and_exports_a_gemma3_that_puts_bos_first(
    gemma_dir, text_data, tmp_path
):
    """Two steps, a checkpoint, ``--resume`` to a third: log-probs agree at every step, the
    prompts the generator got start with the BOS, and ``final/`` loads as a Gemma-3."""
    from asyncrl.config import load_config
    from asyncrl.generation.tasks import work_item_factory

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    first = asyncrl(
        "launch", str(CONFIG), *files(gemma_dir, text_data, reward), *SHORTENED,
        f"run.total_steps={STEPS}", f"learner.checkpoint_every={STEPS}",
        "--run-dir", str(run_dir),
    )  # fmt: skip
    first_s = time.monotonic() - started
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    assert [r["version"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    checkpoint = run_dir / "checkpoints" / f"step-{STEPS:06d}"
    assert (checkpoint / "COMPLETE").exists()
    assert processes_of(run_dir) == [], "the launcher left processes behind"

    started = time.monotonic()
    second = asyncrl("launch", "--resume", str(run_dir), f"run.total_steps={MORE_STEPS}")
    second_s = time.monotonic() - started
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert f"resuming from {checkpoint}" in second.stdout
    assert f"at version {STEPS}" in (run_dir / "logs" / "learner.log").read_text()
    assert "resumed from" in (run_dir / "logs" / "buffer.log").read_text()
    assert processes_of(run_dir) == [], "the launcher left processes behind"

    records = read_metrics(run_dir)
    assert [r["version"] for r in records] == list(range(1, MORE_STEPS + 1))
    # samples_total counts a launch's own samples: the first launch's steps, whole batches
    assert [r["samples_total"] for r in records[:STEPS]] == [
        SAMPLES * (i + 1) for i in range(STEPS)
    ]
    assert [r["staleness_max"] for r in records] == [0.0] * MORE_STEPS
    mismatches = [r.get("logprob_mismatch") for r in records]
    print(
        f"\n[run] {first_s:.1f}s + {second_s:.1f}s resumed; logprob_mismatch per step "
        f"{', '.join(f'{m:.2e}' for m in mismatches if m is not None)}; response_len_mean "
        f"{[r['response_len_mean'] for r in records]}; learner_positions "
        f"{[r['learner_positions'] for r in records]}; update_s "
        f"{[round(r['time_update_s'], 2) for r in records]}"
    )
    assert None not in mismatches, mismatches  # max_staleness=0: measured at every step
    assert max(mismatches) < MISMATCH
    assert any(r["advantage_abs_mean"] > 0 for r in records)  # a gradient to follow

    # the learner's head ran in chunks: one micro-batch a step, whose trained tokens'
    # logits (every response token) are over HEAD_CHUNK_ELEMENTS, through a plain linear
    # head (packing.token_outputs; tests/unit/learner/test_packing.py checks the values)
    for record in records:
        assert record["learner_microbatches"] == 1
        trained_tokens = record["response_len_mean"] * SAMPLES
        assert trained_tokens * VOCAB > head_chunks.HEAD_CHUNK_ELEMENTS, record
    assert packing.CHUNKED_HEAD

    # the prompts: group ids are dataset indices, and the buffer accepts a sample only if
    # its prompt ids are the ones it handed out (buffer/validation.py), so these are the
    # generator's prompts; every one starts with the BOS
    lines = (run_dir / "trained_groups.jsonl").read_text().splitlines()
    steps = {r["step"]: r["group_ids"] for r in map(json.loads, lines)}
    assert sorted(steps) == list(range(MORE_STEPS))
    assert all(len(groups) == PROMPTS_PER_STEP for groups in steps.values())
    trained = [group for groups in steps.values() for group in groups]
    assert len(set(trained)) == len(trained), f"a group trained twice: {steps}"
    make_item = work_item_factory(load_config(run_dir / "config.yaml"))
    checked = 0
    for record in records:
        prompts = [make_item(group).prompt_ids for group in steps[record["step"]]]
        assert all(ids[0] == BOS_ID and BOS_ID not in ids[1:] for ids in prompts)
        # rows longer than the window are not packed: right-padded, rows x widest row;
        # with every answer MAX_NEW_TOKENS long the widest is the longest prompt's, BOS
        # included (one position a row less without it)
        if record["response_len_mean"] == MAX_NEW_TOKENS:
            width = max(map(len, prompts)) + MAX_NEW_TOKENS
            assert width > WINDOW
            assert record["learner_positions"] == SAMPLES * width, record["step"]
            checked += 1
    assert checked, "no step whose answers all ran to max_new_tokens"

    # the export: a Gemma-3 that from_pretrained loads whole, still tied and sliding, moved
    # by training, with a tokenizer that still puts the BOS first and has no chat template
    final, info = AutoModelForCausalLM.from_pretrained(
        run_dir / "final", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    final.eval()
    assert type(final).__name__ == "Gemma3ForCausalLM"
    assert final.config.tie_word_embeddings
    assert final.lm_head.weight.data_ptr() == final.model.embed_tokens.weight.data_ptr()
    assert final.config.sliding_window == WINDOW
    assert final.config.layer_types == ["sliding_attention", "full_attention"]
    initial = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).state_dict()
    moved = max((t - initial[n]).abs().max().item() for n, t in final.state_dict().items())
    print(f"[run] largest weight change over {MORE_STEPS} steps: {moved:.3g}")
    assert moved > 0

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    assert tokenizer.chat_template is None and len(tokenizer) == VOCAB
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") != tokenizer.eos_token_id
    prompt_ids = make_item(0).prompt_ids
    question = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    encoded = tokenizer(question)["input_ids"]
    assert encoded[0] == tokenizer.bos_token_id == BOS_ID and encoded == prompt_ids
    logprobs = sequence_logprobs(final, torch.tensor([encoded]))
    assert torch.isfinite(logprobs).all()
