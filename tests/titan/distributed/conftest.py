from datetime import timedelta

import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one(tmp_path, monkeypatch):
    """A real one-rank gloo process group with a long init timeout."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=300))
    yield
    dist.destroy_process_group()
