"""HF generator replica: tokens/s at batch 1, 8 and 32, and weight-swap latency.

    .venv/bin/python benchmarks/generation.py            # full run, writes docs/benchmarks/
    .venv/bin/python benchmarks/generation.py --quick    # the tiny model only

One HF backend (the generator's own :class:`asyncrl.generators.hf_backend.HFBackend`)
generates in chunks of ``--chunk`` tokens, as a replica does, for models built
from config (no download): the quickstart's tiny model and a 19M-parameter
Qwen2. Tokens/s counts generated tokens over the wall time of the chunks,
prefix re-encoding included. Side by side in the same run, the same batch is
generated in one call (``chunk = max_new_tokens``): the ratio is what partial
rollouts cost on this backend.

Weight swap: the time ``load_weights`` takes, and the time from
``WeightPublisher.publish`` to weights loaded through a ``WeightClient`` over
loopback (what ``weight_swap_latency_s`` measures in a run, minus the wait for
the next chunk boundary).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import zmq

from asyncrl.config import GeneratorsConfig, ModelConfig, TinyModelConfig
from asyncrl.core.transport import free_port, tcp
from asyncrl.generation.models import build_policy
from asyncrl.generators.hf_backend import HFBackend, Rollout
from asyncrl.weights import WeightClient, WeightPublisher

MODELS = {
    "tiny (0.1M)": TinyModelConfig(),
    "19M": TinyModelConfig(
        hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1376,
        max_position_embeddings=512,
    ),
}  # fmt: skip


def rollouts(batch: int, prompt_len: int) -> list[Rollout]:
    prompt = [1] + [3 + (i % 10) for i in range(prompt_len - 1)]
    return [
        Rollout(group_id=0, sample_index=i, prompt_ids=list(prompt), ground_truth="")
        for i in range(batch)
    ]


def generate_all(backend: HFBackend, batch: int, chunk: int) -> float:
    """Tokens/s for one batch generated to the end in chunks of ``chunk`` tokens."""
    work = rollouts(batch, prompt_len=16)
    start = time.perf_counter()
    while not all(r.finished for r in work):
        backend.generate_chunk(work, chunk)
    elapsed = time.perf_counter() - start
    return sum(len(r.response_ids) for r in work) / elapsed


def chunked_and_whole(
    backend: HFBackend, batch: int, new_tokens: int, chunk: int, repeats: int
) -> tuple[float, float]:
    """Medians of chunked and one-call tokens/s, measured alternately (ABAB...), so a
    load spike on a shared machine hits both and their ratio stays meaningful."""
    chunked, whole = [], []
    for _ in range(repeats):
        chunked.append(generate_all(backend, batch, chunk))
        whole.append(generate_all(backend, batch, new_tokens))
    return statistics.median(chunked), statistics.median(whole)


def swap_latency(model: torch.nn.Module, backend: HFBackend, repeats: int) -> dict[str, float]:
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    load, end_to_end = [], []
    publisher = WeightPublisher(tcp("127.0.0.1", free_port("127.0.0.1")))
    context = zmq.Context()
    client = WeightClient(context, publisher.endpoint)
    try:
        for version in range(1, repeats + 1):
            start = time.perf_counter()
            backend.load_weights(state, version)
            load.append(time.perf_counter() - start)
        for version in range(repeats + 1, 2 * repeats + 1):
            start = time.perf_counter()
            publisher.publish(state, version)
            fetched = client.fetch_newer(backend.version)
            backend.load_weights(fetched[2], fetched[0])
            end_to_end.append(time.perf_counter() - start)
    finally:
        client.close()
        publisher.close()
        context.destroy(linger=0)
    return {"load_s": statistics.median(load), "publish_to_loaded_s": statistics.median(end_to_end)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/generation.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {"tiny (0.1M)": MODELS["tiny (0.1M)"]} if args.quick else MODELS
    results = []
    for name, tiny in models.items():
        model, tokenizer = build_policy(ModelConfig(tiny=tiny), seed=0)
        params = sum(p.numel() for p in model.parameters())
        sampling = GeneratorsConfig(max_new_tokens=args.new_tokens, chunk_tokens=args.chunk)
        backend = HFBackend(model, tokenizer, sampling)
        backend.generate_chunk(rollouts(2, 16), 4)  # warm-up
        for batch in (1, 8, 32):
            repeats = 1 if args.quick else 5
            chunked, whole = chunked_and_whole(backend, batch, args.new_tokens, args.chunk, repeats)
            results.append(
                {"model": name, "params": params, "batch": batch, "chunked_tok_s": chunked,
                 "one_call_tok_s": whole, "chunked_over_one_call": chunked / whole}
            )  # fmt: skip
            print(json.dumps(results[-1]), flush=True)
        swap = swap_latency(model, backend, repeats=2 if args.quick else 5)
        results.append({"model": name, "params": params, **swap})
        print(json.dumps(results[-1]), flush=True)
    machine = {"cpus": os.cpu_count(), "threads": torch.get_num_threads(),
               "load_avg_after": os.getloadavg(), "torch": torch.__version__,
               "python": platform.python_version(), "processor": platform.processor()}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "args": vars(args) | {"out": str(args.out)},
                                    "results": results}, indent=1))  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
