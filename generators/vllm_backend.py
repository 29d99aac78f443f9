"""vLLM generation through its engine API (no HTTP server), one chunk at a time.

The engine is vLLM's offline ``LLM`` and the ``LLMEngine`` inside it.
``import vllm`` happens only when a backend is built. Where the engine runs:

- ``generators.vllm_in_process: true`` (default): the engine core and its
  model worker run inside the generator process (vLLM's
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with the ``uni`` executor). No processes
  are spawned, nothing polls while idle, weights are handed over in memory. On
  a small CPU machine this is 2x faster per chunk and starts in a third of the
  time. vLLM caches its settings per process, so the mode is per process.
- ``false``: vLLM's default layout, the engine core and its worker in processes
  it spawns (a script building the backend then needs an
  ``if __name__ == "__main__":`` guard; the generator role has one). On GPUs
  this overlaps scheduling with the caller's work; on a 2-core CPU the worker's
  busy-polling after each step takes CPU from the learner.

Chunks. Each chunk submits one request per unfinished rollout: prompt +
response so far as token ids, ``max_tokens`` = the chunk (or what is left of
``max_new_tokens``), and steps the engine until they are done. Outputs stream
back as deltas, so an aborted request keeps the tokens it already returned.
Resuming a rollout is submitting it again, as the next chunk does anyway.

Log-probs. The engine runs with ``logprobs_mode="processed_logprobs"`` and each
request asks for ``logprobs=0``: the log-prob of the sampled token under the
distribution it was drawn from, i.e. log-softmax of the logits divided by the
temperature with top-k and top-p applied (renormalised), computed in float32.
The default mode (``raw_logprobs``) would record the temperature-1 distribution
instead, which is not what was sampled. ``generation_config="vllm"`` keeps the
model's own ``generation_config.json`` (top_k, repetition_penalty, extra EOS
ids, ...) out of sampling, as the HF backend does.

Weights. ``load_weights`` hands the state dict to the worker
(:class:`WeightLoaderExtension`, installed with ``worker_extension_cls``)
through ``collective_rpc``: in memory when the worker is in this process, else
as one safetensors file (in ``/dev/shm`` where there is one). The worker
reloads it in place with vLLM's ``reload_weights``, which re-runs the
per-layer weight processing (the CPU backend repacks its GEMM weights). The
engine keeps running; nothing restarts. A model with tied input/output
embeddings is given to vLLM untied (``lm_head.weight`` a copy of the
embedding, refreshed with it on every load): vLLM 0.32's in-place reload
re-creates the embedding but leaves a tied LM head on the old tensor. The
function computed is the same.

LoRA. With adapters published alone (``model.lora.publish: adapter``) the engine runs
with vLLM's own LoRA support (``enable_lora``, one adapter resident: ``max_loras=1``)
on the base model. Each version's adapters are written as a peft folder in the
replica's directory and registered as a ``LoRARequest`` of their own (id ``version +
1``); the previous version's is removed, its folder deleted, so at most one adapter is
ever resident however long the run. Every request of a chunk names the version's
adapter; version 0 (the base model) names none. The adapter digest reported for a
version is the digest of the tensors registered, once the engine lists the adapter as
loaded (vLLM packs and pre-scales its copy, so it is not read back): an adapter vLLM
did not take leaves the replica reporting the one it still serves.

Prefix cache. With ``vllm_prefix_caching`` (the default) the engine reuses the
KV of prefixes it has seen, so a chunk does not recompute the prompt and
response its previous chunk already encoded. KV computed with older weights
must never serve a newer version: every ``load_weights`` resets the prefix
cache (``LLM.reset_prefix_cache``) before returning, and raises if vLLM
refuses to (it would while requests run; between chunks none do).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from asyncrl.config import GeneratorsConfig, LoraConfig
from asyncrl.core.messages import BASE_DIGEST
from asyncrl.generation import lora
from asyncrl.generation.models import tied_names
from asyncrl.generators.backend import Rollout, StopStrings, append_tokens, check_state_dict
from asyncrl.weights.collective.buckets import Spec
from asyncrl.weights.layout import TORCH_DTYPES

log = logging.getLogger("asyncrl.generators.vllm")


WORKER_EXTENSION = "asyncrl.generators.vllm_weight_sync.CollectiveWeightExtension"
"""The one ``worker_extension_cls`` of every engine, whatever ``weights.transport`` says.

In process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the tests run it) vLLM
mixes the extension into its worker class for good, and refuses a second
engine whose different extension repeats a method name: one class for every
engine, so a replica on any path, or falling back to another, starts.
"""


class WeightLoaderExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): in-place weight reloads."""

    def asyncrl_load_tensors(self, weights: dict[str, torch.Tensor]) -> int:
        """Load ``weights`` (HF names) into the running model; returns how many were given."""
        # the worker's own reload: layer-wise weight loading plus re-processing
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        return len(weights)

    def asyncrl_load_file(self, path: str) -> int:
        """Load the safetensors file at ``path`` (the worker runs in another process)."""
        from safetensors.torch import load_file

        return self.asyncrl_load_tensors(load_file(path))


def export_model(model: torch.nn.Module, tokenizer, directory: Path) -> Path:
    """Write ``model`` and ``tokenizer`` where vLLM can load them, embeddings untied."""
    directory.mkdir(parents=True, exist_ok=True)
    to_save = model
    if getattr(model.config, "tie_word_embeddings", False):
        to_save = copy.deepcopy(model)
        to_save.config.tie_word_embeddings = False
        embedding = to_save.get_input_embeddings().weight
        to_save.get_output_embeddings().weight = torch.nn.Parameter(embedding.detach().clone())
    to_save.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts."""


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(
        f"model.lora.rank={rank}: vLLM serves LoRA adapters of rank {VLLM_LORA_RANKS[-1]} at "
        "most; use a lower rank, generators.backend=hf, or model.lora.publish=merged"
    )


def _swap_dir(work_dir: Path) -> Path:
    """Where weight files pass to the worker: RAM-backed ``/dev/shm`` if present."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="asyncrl-vllm-", dir=shm))
    path = work_dir / "swap"
    path.mkdir(parents=True, exist_ok=True)
    return path


class VLLMBackend:
    """vLLM's engine holding the policy; see the module docstring for the mechanics."""

    def __init__(
        self,
        model_dir: Path,
        tokenizer,
        sampling: GeneratorsConfig,
        *,
        parameter_names: set[str],
        parameter_specs: Mapping[str, Spec] | None = None,
        tied: tuple[str, str] | None = None,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        work_dir: Path | None = None,
        adapters: LoraConfig | None = None,
        **engine_kwargs,
    ):
        """Start an engine on ``model_dir`` (written by :func:`export_model`).

        ``parameter_names`` are the names a state dict for ``load_weights``
        must have (the HF model's), ``parameter_specs`` their shapes and dtypes where
        known (what a replica checks a version against before loading it,
        :mod:`asyncrl.weights.checks`); ``tied`` names the embedding and the LM head
        of a policy that ties them (the head may then be omitted, and is sent
        to vLLM as a copy of the embedding).
        ``adapters``: LoRA adapters published alone, served by vLLM's LoRA support on
        ``model_dir`` as the base (``parameter_specs`` then name the adapters' tensors).
        ``engine_kwargs`` go to ``vllm.LLM`` as they are (tests: ``block_size``).
        """
        # CPU build: let the engine's OpenMP threads float rather than pin every
        # replica's engine to the same core (its default binds to core 0).
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.in_process = sampling.vllm_in_process
        # read by vLLM per process (it caches its settings once an engine starts)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        if self.in_process:
            engine_kwargs.setdefault("distributed_executor_backend", "uni")
        # where weight files go for a worker in another process
        self._swap_dir = None if self.in_process else _swap_dir(work_dir or Path(model_dir))
        from vllm import LLM

        self.tokenizer = tokenizer
        self.sampling = sampling
        self.version = 0
        self.last_load_s = 0.0
        self.parameter_names = set(parameter_names)
        self.parameter_specs = None if parameter_specs is None else dict(parameter_specs)
        self.tied = tied
        self._request_ids = itertools.count()
        self._lock = threading.Lock()
        self._running: dict[int, str] = {}  # id(rollout) -> request id, for the chunk running
        self._to_abort: set[str] = set()
        self.adapters = adapters
        self.adapter_digest: str | None = None if adapters is None else BASE_DIGEST
        """The digest of the adapter the engine serves (see LoRA above); None: no LoRA."""
        self._adapter = None  # the LoRARequest of the version held; None: the base model
        self._adapter_dir = Path(work_dir or model_dir) / "adapters"
        self._base = str(model_dir)
        if adapters is not None:
            engine_kwargs.update(
                enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(adapters.rank)
            )
        self.llm = LLM(
            str(model_dir),
            dtype=dtype,
            seed=seed,
            enforce_eager=sampling.vllm_enforce_eager,
            enable_prefix_caching=sampling.vllm_prefix_caching,
            kv_cache_memory_bytes=int(sampling.vllm_kv_cache_gb * 2**30),
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            worker_extension_cls=WORKER_EXTENSION,
            **engine_kwargs,
        )
        self.engine = self.llm.llm_engine
        self._in_place = None

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        tokenizer,
        sampling: GeneratorsConfig,
        work_dir: Path,
        *,
        dtype: str = "float32",
        seed: int = 0,
        adapters: LoraConfig | None = None,
        **engine_kwargs,
    ) -> VLLMBackend:
        """An engine holding ``model``'s weights as version 0 (written to ``work_dir/model``);
        with ``adapters``, ``model`` is the base and gets peft's LoRA layers (in place)
        only to learn the adapters' names and shapes."""
        model_dir = export_model(model, tokenizer, Path(work_dir) / "model")
        tied = tied_names(model)
        loaded = model.state_dict()
        if adapters is not None:
            loaded, tied = lora.inject_adapters(model, adapters).state_dict(), None
        return cls(
            model_dir,
            tokenizer,
            sampling,
            parameter_names=set(loaded),
            parameter_specs={
                name: Spec(tuple(t.shape), TORCH_DTYPES.get(t.dtype)) for name, t in loaded.items()
            },
            tied=tied,
            adapters=adapters,
            dtype=dtype,
            seed=seed,
            max_model_len=getattr(model.config, "max_position_embeddings", None),
            work_dir=Path(work_dir),
            **engine_kwargs,
        )

    # ------------------------------------------------------------------ generation

    def _params(self, max_tokens: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = self.sampling
        return SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,  # 0 is off, as in the config
            max_tokens=max_tokens,
            logprobs=0,  # the sampled token's own log-prob
            stop=list(s.stop) or None,
            detokenize=bool(s.stop),  # text is only needed to match stop strings
            output_kind=RequestOutputKind.DELTA,
        )

    def generate_chunk(self, rollouts: list[Rollout], max_tokens: int) -> None:
        """Extend each unfinished rollout by up to ``max_tokens`` tokens, in place (see Backend)."""
        active = [r for r in rollouts if not r.finished]
        if not active:
            return
        budget = self.sampling.max_new_tokens
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {}
        ended: dict[str, str | None] = {}
        by_request: dict[str, Rollout] = {}
        params = {}  # max_tokens -> SamplingParams (vLLM copies them per request)
        with self._lock:
            for rollout in active:
                request_id = f"asyncrl-{next(self._request_ids)}"
                steps = min(max_tokens, rollout.token_limit(budget) - len(rollout.response_ids))
                if steps not in params:
                    params[steps] = self._params(steps)
                prompt = {"prompt_token_ids": rollout.prompt_ids + rollout.response_ids}
                self.engine.add_request(
                    request_id, prompt, params[steps], lora_request=self._adapter
                )
                by_request[request_id] = rollout
                tokens[request_id], logprobs[request_id] = [], []
                self._running[id(rollout)] = request_id
        try:
            while True:
                with self._lock:
                    to_abort, self._to_abort = list(self._to_abort), set()
                if to_abort:
                    self.engine.abort_request(to_abort)
                    for request_id in to_abort:
                        ended.setdefault(request_id, "abort")
                # checked after aborting: step() waits for output no aborted request sends
                if not self.engine.has_unfinished_requests():
                    break
                for output in self.engine.step():
                    completion = output.outputs[0]
                    request_id = output.request_id
                    if request_id not in tokens:
                        continue
                    tokens[request_id] += completion.token_ids
                    logprobs[request_id] += [
                        step[token].logprob
                        for step, token in zip(
                            completion.logprobs, completion.token_ids, strict=True
                        )
                    ]
                    if output.finished:
                        ended[request_id] = completion.finish_reason
        except BaseException:
            # leave no request of ours in the engine for the next chunk to trip on
            with contextlib.suppress(Exception):
                self.engine.abort_request(list(by_request))
            raise
        finally:
            with self._lock:
                self._running.clear()
                self._to_abort.clear()
        stop = StopStrings(self.tokenizer, self.sampling.stop)
        for request_id, rollout in by_request.items():
            append_tokens(
                rollout,
                tokens[request_id],
                logprobs[request_id],
                self.version,
                eos_token_id=self.tokenizer.eos_token_id,
                max_new_tokens=budget,
                stop=stop,
            )
            if not rollout.finished and ended.get(request_id) == "stop":
                rollout.finish_reason = "stop"  # an engine-side stop we did not see ourselves

    def abort(self, rollouts: Iterable[Rollout]) -> None:
        """End ``rollouts``' requests in the running chunk (any thread); see Backend."""
        with self._lock:
            for rollout in rollouts:
                request_id = self._running.get(id(rollout))
                if request_id is not None:
                    self._to_abort.add(request_id)

    # ------------------------------------------------------------------ weights

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Reload every parameter in the running engine, then drop its prefix cache."""
        start = time.perf_counter()
        optional = {self.tied[1]} if self.tied else set()
        check_state_dict(self.parameter_names, optional, state_dict, version)
        if self.adapters is not None:
            self._swap_adapter(state_dict, version)
        else:
            self._push_weights(state_dict)
        self._reset_prefix_cache()
        self.version = version
        self.last_load_s = time.perf_counter() - start

    def _push_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in state_dict.items()}
        if self.tied:
            embedding, head = self.tied  # vLLM holds an untied copy (module docstring)
            tensors[head] = tensors[embedding].clone()  # a view would share memory: refused
        if self.in_process:  # the worker is in this process: hand the tensors over
            (loaded,) = self.llm.collective_rpc("asyncrl_load_tensors", args=(tensors,))
        else:
            assert self._swap_dir is not None
            path = self._swap_dir / "weights.safetensors"
            save_file(tensors, path)
            try:
                (loaded,) = self.llm.collective_rpc("asyncrl_load_file", args=(str(path),))
            finally:
                path.unlink(missing_ok=True)
        if loaded != len(tensors):
            raise RuntimeError(f"the vLLM worker read {loaded} of {len(tensors)} tensors")

    def _swap_adapter(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Register ``version``'s adapters as a LoRA of their own, then drop the previous one:
        one resident at a time (see LoRA above)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        tensors = {name: t.detach().cpu().contiguous() for name, t in state_dict.items()}
        folder = self._adapter_dir / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        save_file(lora.peft_file_names(tensors), folder / "adapter_model.safetensors")
        assert self.adapters is not None
        settings = lora.adapter_config_json(self.adapters, tensors, self._base)
        (folder / "adapter_config.json").write_text(json.dumps(settings))
        previous = self._adapter
        if previous is not None:  # first: a version reloaded under the same id is fresh
            self.engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
            self._adapter, self.adapter_digest = None, BASE_DIGEST
        request = LoRARequest(f"v{version}", version + 1, str(folder))
        if not self.engine.add_lora(request) or request.lora_int_id not in self.list_adapters():
            raise RuntimeError(f"vLLM did not load the adapter of v{version} from {folder}")
        self._adapter = request
        self.adapter_digest = lora.adapter_digest(tensors.items())

    def list_adapters(self) -> set[int]:
        """The ids of the LoRA adapters the engine holds (at most one)."""
        return set(self.engine.list_loras())

    @property
    def in_place_weights(self):
        """The collective path's route into the workers: ``VLLMInPlace`` of the module of
        :data:`WORKER_EXTENSION` (``generators/vllm_weight_sync.py``, which imports this one);
        None with LoRA adapters, which go through ``load_weights``."""
        if self.adapters is not None:
            return None
        if self._in_place is None:
            module = importlib.import_module(WORKER_EXTENSION.rpartition(".")[0])
            self._in_place = module.VLLMInPlace(self)
        return self._in_place

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Shut the engine down (its processes, if any) and remove the swap directory."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.engine_core.shutdown()
            self.engine = None
        if self._swap_dir is not None:
            shutil.rmtree(self._swap_dir, ignore_errors=True)
        if getattr(self, "adapters", None) is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()
