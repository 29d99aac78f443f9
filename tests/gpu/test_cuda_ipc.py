"""Colocated GPUs: a second process maps the learner's CUDA tensors by IPC handle, no copy."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from asyncrl.weights.cuda_ipc import export_handles, import_handles, ipc_available


def importer(data: bytes, pipe) -> None:
    tensors = import_handles(data)
    pipe.send({name: t.cpu() for name, t in tensors.items()})
    assert pipe.recv() == "changed"  # the exporter wrote into its tensors in place
    pipe.send({name: t.cpu() for name, t in tensors.items()})


@pytest.mark.timeout(120)
def test_tensors_shared_by_ipc_handle_are_the_exporters_own_memory():
    assert ipc_available()
    tensors = {
        "w": torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16, device="cuda"),
        "view": torch.arange(10, dtype=torch.float32, device="cuda")[2:8],  # an offset view
    }
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=importer, args=(export_handles(tensors), there))
    process.start()
    try:
        assert here.poll(60)
        seen = here.recv()
        for name, tensor in tensors.items():
            assert torch.equal(seen[name], tensor.cpu()), name
        for tensor in tensors.values():
            tensor.mul_(2)
        torch.cuda.synchronize()
        here.send("changed")
        assert here.poll(60)
        seen = here.recv()
        for name, tensor in tensors.items():
            assert torch.equal(seen[name], tensor.cpu()), name  # the same memory, doubled
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()


def test_forged_handles_are_refused_before_any_mapping():
    import msgspec

    from asyncrl.weights.cuda_ipc import Handle

    bad = Handle("w", "complex64", (2,), (1,), 0, 0, b"", 8, 0, b"", 0, None, False)
    with pytest.raises(ValueError, match="dtype 'complex64'"):
        import_handles(msgspec.msgpack.encode([bad]))
    negative = Handle("w", "float32", (-2,), (1,), 0, 0, b"", 8, 0, b"", 0, None, False)
    with pytest.raises(ValueError, match="shape"):
        import_handles(msgspec.msgpack.encode([negative]))
