"""sympow.train.data: the mesh, batches wrapping around epochs, global arrays, divisibility,
window lengths."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from sympow.train import config as configlib
from sympow.train import data as datalib
from tests.train.helpers import CONFIGS, tiny_config


def test_train_batches_wrap_and_resume_positions():
    ds = datalib.open_loader(tiny_config().data, "train", 4, 16384)  # 2 blocks x 4 windows
    assert len(ds) == 8
    steps = [k for k, _, _ in datalib.train_batches(ds, 6, 19)]
    assert steps == list(range(6, 19))
    (_, x, y), = [b for b in datalib.train_batches(ds, 13, 14)]
    np.testing.assert_array_equal(x, ds[13 % 8][0])
    np.testing.assert_array_equal(y, ds[13 % 8][1])




def test_divisibility_and_data_errors():
    mesh = datalib.make_mesh()
    datalib.check_divisible(4, mesh, 2)
    with pytest.raises(ValueError, match="docs_per_batch"):
        datalib.check_divisible(3, mesh, 2)
    config = configlib.load_config(f"{CONFIGS / 'sweep_p2.py'}:softmax")
    with pytest.raises(ValueError, match="runlocal"):  # 512 docs > the 11 of Austen
        datalib.open_loader(config.data, "train", 512, 1024)



def test_window_lengths():
    assert datalib.window_loader_length(1) == 1
    assert datalib.window_loader_length(3000) == 4096
    assert datalib.window_loader_length(65536) == 65536
    with pytest.raises(ValueError, match="eval length"):
        datalib.window_loader_length(65537)


def test_mesh_and_global_batch():
    mesh = datalib.make_mesh()
    assert mesh.axis_names == ("data",) and mesh.size == len(jax.devices())
    assert datalib.batch_sharded(mesh).spec == PartitionSpec("data")
    assert datalib.replicated(mesh).spec == PartitionSpec()
    local = np.arange(4 * 8, dtype=np.int32).reshape(4, 8)  # one process: local = global
    batch = datalib.global_batch(local, datalib.batch_sharded(mesh), 4)
    assert batch.shape == (4, 8) and batch.sharding.spec == PartitionSpec("data")
    np.testing.assert_array_equal(np.asarray(batch), local)

