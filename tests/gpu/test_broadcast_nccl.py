"""Rank 0's batch reaches every rank over NCCL, on each rank's own GPU (two processes)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers.gpu import broadcast_worker

RANKS = 2


@pytest.mark.timeout(120)
def test_broadcast_batch_over_nccl_gives_every_rank_rank_0s_batch_on_its_gpu(tmp_path):
    if (count := torch.cuda.device_count()) < RANKS:
        pytest.skip(f"needs {RANKS} CUDA GPUs for a {RANKS}-rank NCCL group; found {count}")
    store = str(tmp_path / "store")  # a FileStore: the way the local launcher's ranks meet
    mp.spawn(broadcast_worker, args=(RANKS, store, "cuda"), nprocs=RANKS, join=True)
