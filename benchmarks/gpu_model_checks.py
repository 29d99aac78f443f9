"""The GPU check's model-sized checks (``gpu_check.py`` runs each in a process of its own):
the device itself, the learner's FSDP2 step and HF generation on Qwen2-shaped models.

The models are built from a :class:`~transformers.Qwen2Config` with Qwen2.5's real shapes
and random weights, straight on the device: nothing is downloaded, and a 1.5B model is
ready in seconds. The learner's step is the learner's own code (``sharding.shard``, the
optimizer it makes, :class:`~asyncrl.learner.update.Update`) on a synthetic batch;
generation is :class:`~asyncrl.generators.hf_backend.HFBackend`, chunks and all.

MFU counts the model FLOPs of PaLM (Chowdhery et al. 2022, appendix B): per trained token
``6N + 12·L·d·T`` (``N`` the parameters, a tied embedding counted once as the LM head;
``L`` layers, ``d`` hidden size, ``T`` sequence length), plus a forward pass,
``2N + 4·L·d·T``, when the step makes its no-grad pre-pass; over the GPU's dense bf16
peak from :data:`BF16_DENSE_PEAK_TFLOPS`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import fields

import torch
from gpu_check import Figures

QWEN2_SHAPES = {
    # Qwen2.5-0.5B and -1.5B (their config.json), and a toy of the same layout
    "qwen2-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                   "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936},
    "qwen2-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                   "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936},
    "toy": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512},
}  # fmt: skip
BF16_DENSE_PEAK_TFLOPS = (
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200 NVL", 835.0),
    ("H200", 989.0),
)
"""Dense BF16 Tensor Core TFLOP/s by a part of the device name, first match first."""
PEAK_SOURCE = (
    "NVIDIA H100 and H200 Tensor Core GPU datasheets: BF16 Tensor Core, dense "
    "(half the figure 'with sparsity')"
)
PAD_ID = 0
GROUP = 8


def bf16_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU named ``device_name``; None when not in the table."""
    return next((peak for part, peak in BF16_DENSE_PEAK_TFLOPS if part in device_name), None)


def qwen2_model(shape: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised Qwen2 causal LM of ``shape``, built on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        **QWEN2_SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=PAD_ID,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def parameters(model: torch.nn.Module) -> int:
    """Distinct parameters: a tied embedding and LM head count once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def train_flops_per_token(n: int, layers: int, hidden: int, seq_len: int, pre_pass: bool) -> float:
    """Model FLOPs of one trained token (PaLM's count; see the module docstring)."""
    flops = 6 * n + 12 * layers * hidden * seq_len
    return flops + (2 * n + 4 * layers * hidden * seq_len if pre_pass else 0)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(function, device: str) -> float:
    synchronize(device)
    started = time.perf_counter()
    function()
    synchronize(device)
    return time.perf_counter() - started


# ------------------------------------------------------------------ device


def device_check(figures: Figures, device: str) -> None:
    """What the other checks run on: GPU, versions, bf16 peak, a bf16 matmul's TFLOP/s."""
    import common
    import numpy
    import transformers

    figures["machine"] = common.machine_info()
    figures["commit"] = common.git_commit()
    figures["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "numpy": numpy.__version__, "cuda": torch.version.cuda}  # fmt: skip
    figures["cuda_available"] = torch.cuda.is_available()
    if not torch.cuda.is_available():
        figures["gpu_name"] = "none"
        return
    properties = torch.cuda.get_device_properties(0)
    figures["gpu_name"] = properties.name
    figures["device"] = {
        "count": torch.cuda.device_count(),
        "capability": list(torch.cuda.get_device_capability(0)),
        "memory_gib": round(properties.total_memory / 2**30, 1),
        "multiprocessors": properties.multi_processor_count,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }
    figures["bf16_peak_tflops"] = bf16_peak_tflops(properties.name)
    figures["bf16_peak_source"] = PEAK_SOURCE if figures["bf16_peak_tflops"] else (
        f"'{properties.name}' is not in gpu_model_checks.BF16_DENSE_PEAK_TFLOPS: no MFU"
    )  # fmt: skip
    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    for _ in range(3):
        a @ b
    seconds = timed(lambda: [a @ b for _ in range(10)], "cuda") / 10
    figures["matmul_bf16_8192_tflops"] = round(2 * 8192**3 / seconds / 1e12, 1)


# ------------------------------------------------------------------ the learner's step


def synthetic_batch(rows: int, seq_len: int, vocab: int, device: str):
    """Full-length rows, a quarter prompt and three quarters response, groups of
    :data:`GROUP`, random rewards and behaviour log-probs, made at version 0."""
    from asyncrl.learner.batch import TrainBatch

    prompt = seq_len // 4
    generator = torch.Generator().manual_seed(0)
    loss_mask = torch.zeros(rows, seq_len - 1)
    loss_mask[:, prompt - 1 :] = 1
    batch = TrainBatch(
        input_ids=torch.randint(3, vocab, (rows, seq_len), generator=generator),
        attention_mask=torch.ones(rows, seq_len, dtype=torch.long),
        behavior_logprobs=-torch.rand(rows, seq_len - 1, generator=generator) * 3,
        loss_mask=loss_mask,
        token_versions=torch.where(loss_mask.bool(), 0, -1),
        rewards=torch.rand(rows, generator=generator),
        group_ids=torch.arange(rows) // GROUP,
        versions=torch.zeros(rows, dtype=torch.long),
        response_lengths=torch.full((rows,), seq_len - prompt),
    )
    return TrainBatch(**{f.name: getattr(batch, f.name).to(device) for f in fields(batch)})


def learner_step(
    figures: Figures,
    device: str,
    shape: str,
    rows: int,
    seq_len: int,
    microbatch_tokens: int,
    steps: int,
    lora_rank: int = 0,
) -> None:
    """The learner's bf16 FSDP2 step (one rank) on a ``shape`` model: tokens/s, MFU, memory;
    with ``lora_rank``, peft's adapters on every linear layer train and the base is frozen."""
    from asyncrl.config import LoraConfig, load_config
    from asyncrl.generation import lora
    from asyncrl.learner import distributed, sharding
    from asyncrl.learner.update import Update

    config = load_config(None, [
        "model.tiny.num_layers=1",  # required, unused: the model is built here
        f"learner.device={device}", "learner.mixed_precision=bf16",
        f"learner.max_tokens_per_microbatch={microbatch_tokens}",
        f"algorithm.group_size={GROUP}", f"algorithm.prompts_per_step={rows // GROUP}",
        f"generators.max_new_tokens={seq_len}",
    ])  # fmt: skip
    ranks = distributed.init(device)
    try:
        model = qwen2_model(shape, device, torch.float32)  # fp32 weights, as the learner's
        n = parameters(model)
        figures["model"] = {"shape": shape, **QWEN2_SHAPES[shape], "parameters": n}
        if lora_rank:
            adapters = LoraConfig(rank=lora_rank, alpha=2 * lora_rank)
            model = lora.with_adapters(model, adapters, seed=0)
        model = sharding.shard(model, config.learner, ranks)
        trained = [p for p in model.parameters() if p.requires_grad]
        figures["lora_rank"] = lora_rank
        figures["trainable_parameters"] = sum(p.numel() for p in trained)
        optimizer = torch.optim.AdamW(
            trained, lr=config.learner.lr, weight_decay=config.learner.weight_decay
        )
        update = Update(model, optimizer, config, ranks)
        batch = synthetic_batch(rows, seq_len, QWEN2_SHAPES[shape]["vocab_size"], device)
        figures["batch"] = {"rows": rows, "seq_len": seq_len, "tokens": rows * seq_len,
                            "microbatch_tokens": microbatch_tokens}  # fmt: skip
        model.train()
        step_s, metrics, pre = [], {}, {}

        def one_step(version: int) -> None:
            nonlocal metrics, pre
            pre = update.proximal_logprobs(batch)
            metrics = update.step(batch, pre, version)

        for version in range(steps + 1):  # the first is a warm-up
            seconds = timed(lambda v=version: one_step(v), device)
            if version:
                step_s.append(seconds)
        median = statistics.median(step_s)
        tokens_per_s = rows * seq_len / median
        dims = QWEN2_SHAPES[shape]
        flops = train_flops_per_token(
            n, dims["num_hidden_layers"], dims["hidden_size"], seq_len, pre_pass=bool(pre)
        )
        figures["step_s"] = {"median": median, "all": step_s}
        figures["tokens_per_s"] = tokens_per_s
        figures["pre_pass"] = bool(pre)
        figures["model_tflops"] = tokens_per_s * flops / 1e12
        figures["loss_policy"] = metrics.get("loss_policy")
        figures["grad_norm"] = metrics.get("learner_grad_norm")
        if lora_rank:  # no weight gradients for the frozen base: fewer FLOPs than counted
            figures["model_tflops_note"] = "counted as full training: an upper bound for LoRA"
        if device == "cuda":
            peak = bf16_peak_tflops(torch.cuda.get_device_name(0))
            figures["mfu"] = figures["model_tflops"] / peak if peak and not lora_rank else None
            figures["bf16_peak_tflops"] = peak
            figures["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            figures["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        if not all(map(_finite, (metrics.get("loss_policy"), metrics.get("learner_grad_norm")))):
            raise AssertionError(f"a step of random data gave no finite loss: {metrics}")
    finally:
        distributed.shutdown()


def _finite(value) -> bool:
    return value is not None and value == value and abs(value) != float("inf")


# ------------------------------------------------------------------ generation


def generation(
    figures: Figures,
    device: str,
    shape: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    chunk_tokens: int,
) -> None:
    """HF generation of ``batch`` samples at once, by the backend (chunks of
    ``chunk_tokens``, each re-encoding its prefix) and by one ``generate`` call, in bf16."""
    from asyncrl.config import GeneratorsConfig
    from asyncrl.generation.tasks import build_tokenizer
    from asyncrl.generators.hf_backend import HFBackend, Rollout

    sampling = GeneratorsConfig(
        max_new_tokens=new_tokens, chunk_tokens=chunk_tokens, max_active_samples=batch,
        num_gpus=1 if device == "cuda" else 0,
    )  # fmt: skip
    model = qwen2_model(shape, device, torch.bfloat16)
    backend = HFBackend(model, build_tokenizer(), sampling)
    vocab = QWEN2_SHAPES[shape]["vocab_size"]
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=generator)
    figures["settings"] = {"shape": shape, "dtype": "bfloat16", "batch": batch,
                           "prompt_len": prompt_len, "new_tokens": new_tokens,
                           "chunk_tokens": chunk_tokens}  # fmt: skip

    def rollouts() -> list:
        return [Rollout(0, row, prompt.tolist(), "") for row, prompt in enumerate(prompts)]

    backend.generate_chunk(rollouts(), 2)  # warm-up: kernels, allocator
    active = rollouts()
    started = time.perf_counter()
    while not all(r.finished for r in active):
        backend.generate_chunk(active, chunk_tokens)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.response_ids) for r in active)
    figures["backend"] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}

    ids = prompts.to(device)
    seconds = timed(lambda: model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=PAD_ID,
    ), device)  # fmt: skip
    tokens = batch * new_tokens
    figures["one_generate_call"] = {"seconds": seconds, "tokens": tokens,
                                    "tokens_per_s": tokens / seconds}  # fmt: skip
    figures["backend_over_one_call"] = (
        figures["backend"]["tokens_per_s"] / figures["one_generate_call"]["tokens_per_s"]
    )
