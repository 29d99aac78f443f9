"""What a replica's weight checks cost against the load they guard, on SmolLM2-135M.

    .venv/bin/python benchmarks/weight_checks.py              # 10 rounds, torch's threads
    .venv/bin/python benchmarks/weight_checks.py --threads 1  # as a CPU replica runs

The policy's own tensors (``models/SmolLM2-135M-Instruct``, 538 MB of float32
with the tied head left out, as the learner publishes them) stand for a
version in a shared-memory slot; the model loaded from the same folder is the
engine. Each round, interleaved so that the machine's load falls on all alike:

- load: the HF backend's copy of the version into the model
  (``load_module_in_parts``, what ``HFBackend.load_weights`` runs);
- check: :func:`asyncrl.weights.checks.nonfinite` over the version, what every
  path runs before the engine gets it;
- layout: :func:`asyncrl.weights.checks.check_layout` against the engine's;
- fused: each tensor's sum checked just before its copy, for all tensors (what
  checking "as it is loaded" would cost), against check then load.

Prints the minimum and the median of each, and the check as a share of the load.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.core.messages import TensorEntry  # noqa: E402
from asyncrl.generation.models import load_pretrained, tied_names  # noqa: E402
from asyncrl.generators.backend import load_module_in_parts  # noqa: E402
from asyncrl.weights.checks import check_layout, engine_layout, nonfinite  # noqa: E402
from asyncrl.weights.layout import TORCH_DTYPES  # noqa: E402

MODEL_DIR = ROOT / "models" / "SmolLM2-135M-Instruct"


class Engine:
    """The HF backend's weight contract on the loaded model (what ``engine_layout`` reads)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_pretrained(str(MODEL_DIR), torch.float32).eval()
    head = (tied_names(model) or ("", ""))[1]
    version = {
        name: tensor.detach().clone() for name, tensor in model.state_dict().items() if name != head
    }
    entries = [
        TensorEntry(name, TORCH_DTYPES[t.dtype], tuple(t.shape), 0, t.numel() * t.element_size())
        for name, t in version.items()
    ]
    layout = engine_layout(Engine(model))
    optional = {head} if head else set()
    names = list(version)
    nbytes = sum(entry.nbytes for entry in entries)

    def load() -> None:
        load_module_in_parts(model, optional, names, [version], 1)

    def check() -> None:
        assert nonfinite(version.items()) is None

    def check_names_shapes_dtypes() -> None:
        check_layout(layout, entries, 1, "shm")

    parameters = model.state_dict()

    def check_then_load() -> None:
        check()
        load()

    def fused() -> None:
        with torch.no_grad():
            for name, tensor in version.items():
                assert math.isfinite(float(tensor.sum()))
                parameters[name].copy_(tensor)

    load()  # warm: every page of both sides touched once
    rounds = {
        "load": load,
        "check": check,
        "layout": check_names_shapes_dtypes,
        "check+load": check_then_load,
        "fused": fused,
    }
    times: dict[str, list[float]] = {what: [] for what in rounds}
    for _ in range(args.repeats):
        for what, function in rounds.items():
            times[what].append(timed(function))
    print(f"{len(names)} tensors, {nbytes / 1e6:.0f} MB, {torch.get_num_threads()} threads")
    for what, values in times.items():
        print(
            f"{what:10s} min {min(values) * 1e3:8.2f} ms   median "
            f"{statistics.median(values) * 1e3:8.2f} ms"
        )
    share = [c / lo for c, lo in zip(times["check"], times["load"], strict=True)]
    print(f"check / load: min {min(share):.2f}, median {statistics.median(share):.2f}")
    saved = [1 - f / t for f, t in zip(times["fused"], times["check+load"], strict=True)]
    print(f"fused saves of check+load: median {statistics.median(saved):.0%}")


if __name__ == "__main__":
    main()
