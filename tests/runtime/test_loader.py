"""run.loader in-process: resume at the next batch, the same order with workers, epochs whole."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_run
from torch.utils.data import TensorDataset

from kchain.runtime.preflight import PreflightError


def batches_after_resume(root: Path, workers: int, stop_after: int, more: int):
    """Deliver stop_after batches, checkpoint the loader, then `more` from a fresh loader at that state."""
    data = TensorDataset(torch.arange(50))
    run = make_run(root, {"seed": 7})
    lo = run.loader(data, batch_size=4, num_workers=workers)
    for _ in range(stop_after):
        next(lo)
    state = lo.state_dict()
    straight = [next(lo)[0].tolist() for _ in range(more)]
    again = make_run(root, {"seed": 7}).loader(data, batch_size=4, num_workers=workers)
    again.load_state_dict(state)
    resumed = [next(again)[0].tolist() for _ in range(more)]
    run.close()
    return straight, resumed


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_mid_epoch_with_the_next_batch(tmp_path, workers):
    straight, resumed = batches_after_resume(tmp_path, workers, stop_after=5, more=12)  # crosses an epoch
    assert resumed == straight


def test_loader_order_is_the_same_with_and_without_workers_and_leaves_user_rng_alone(tmp_path):
    class Noisy(TensorDataset):
        def __getitem__(self, i):
            return self.tensors[0][i] + torch.rand(()), np.random.rand(), random.random()

    data = Noisy(torch.zeros(20))
    run = make_run(tmp_path)
    torch.manual_seed(3)
    expected_next = torch.rand(())
    torch.manual_seed(3)
    a = [next(run.loader(data, batch_size=5, num_workers=w)) for w in (0, 2) for _ in range(1)]
    assert torch.rand(()) == expected_next  # fetching in the main process did not consume the user's RNG
    for x, y in zip(a[0], a[1], strict=True):
        assert torch.equal(torch.as_tensor(x), torch.as_tensor(y))
    lo = run.loader(data, batch_size=5, shuffle=False)
    assert len(list(lo)) == 4 and lo.epoch == 1 and len(list(lo)) == 4 and lo.epoch == 2
    run.close()


def test_loader_workers_under_a_temp_dir_too_long_for_their_sockets_are_refused(tmp_path, monkeypatch):
    """Past 107 bytes a worker's socket cannot bind: its batch is lost and the loader would wait forever."""
    import tempfile

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    run = make_run(tmp_path / "root")
    data = TensorDataset(torch.randn(32, 4))
    with pytest.raises(PreflightError, match=r"set TMPDIR to a shorter directory"):
        run.loader(data, batch_size=8, num_workers=2)
    lo = run.loader(data, batch_size=8, num_workers=0)  # no workers, no sockets: allowed
    assert next(lo)[0].shape == (8, 4)
    monkeypatch.setattr(tempfile, "tempdir", None)  # the fixture's short TMPDIR: workers deliver
    lo = run.loader(data, batch_size=8, num_workers=2, name="with_workers")
    assert next(lo)[0].shape == (8, 4)
    run.close()
    del run, lo  # the persistent workers end with their loader, before the fixture removes TMPDIR
    import gc

    gc.collect()


def test_a_consumer_that_reads_exactly_len_batches_gets_every_epoch_whole(tmp_path):
    # Lightning's fit loop takes len(loader) batches an epoch and never asks for the end: each new
    # pass must be the next epoch, not the empty rest of the last one (half the epochs were empty).
    run = make_run(tmp_path)
    lo = run.loader(TensorDataset(torch.arange(12)), batch_size=4, shuffle=False)
    epochs = []
    for _ in range(3):
        it = iter(lo)
        epochs.append([next(it)[0].tolist() for _ in range(len(lo))])
    assert epochs == [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]] * 3 and lo.epoch == 2
    run.close()


def test_a_sampler_already_sharded_across_ranks_is_refused_in_one_line(tmp_path):
    """kchain shards each batch across the ranks itself: a DistributedSampler (or any sampler with
    num_replicas, e.g. timm's OrderedDistributedSampler) would have each rank read 1/N² of the data."""
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

    class OrderedDistributedSampler:  # timm's shape: a sampler with num_replicas, not torch's class
        num_replicas = 2

        def __iter__(self):
            return iter(range(0, 16, 2))

        def __len__(self):
            return 8

    data = TensorDataset(torch.arange(16))
    run = make_run(tmp_path)
    fix = ("build the DataLoader without a DistributedSampler (e.g. timm's create_loader(..., distributed=False)), "
           "or pass its dataset: run.loader(dataset, batch_size=...)")
    why = ("already sharded across the ranks; kchain shards each batch across the ranks itself, so each rank would "
           "read 1/4 of the data in place of 1/2")
    with pytest.raises(TypeError) as refused:
        run.loader(DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0)))
    assert str(refused.value) == (f"run.loader(DataLoader): its sampler is a DistributedSampler (num_replicas=2), "
                                  f"{why}: {fix}")
    with pytest.raises(TypeError) as refused:
        run.loader(DataLoader(data, batch_sampler=BatchSampler(OrderedDistributedSampler(), 4, drop_last=False)))
    assert str(refused.value) == ("run.loader(DataLoader): its batch_sampler's sampler is a OrderedDistributedSampler "
                                  f"(num_replicas=2), {why}: {fix}")
    with pytest.raises(TypeError) as refused:  # one rank (the smoke's) is refused too: Kaggle's two would shard twice
        run.loader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    assert str(refused.value) == ("run.loader(TensorDataset, sampler=...): its sampler is a DistributedSampler "
                                  "(num_replicas=1), already sharded across the ranks; kchain shards each batch across "
                                  "the ranks itself, so each rank would read 1/N² of the data in place of 1/N (N ranks): "
                                  "give a sampler over the whole dataset, or none (run.loader shuffles each epoch itself)")
    lo = run.loader(DataLoader(data, batch_size=4, shuffle=True))  # an unsharded DataLoader is rebuilt as before
    assert sorted(i for _ in range(4) for i in next(lo)[0].tolist()) == list(range(16))
    run.close()
