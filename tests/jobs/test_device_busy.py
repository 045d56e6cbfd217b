"""How busy a chunk kept its device (issue 46.5): NVML's own utilisation samples where NVML works
(here its stand-in, ``queue_worker/drills/simulated_nvml.py``), the time in the model's forward on the CPU;
one figure per run in status, report and the metrics. A run end to end: test_observability."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from chunkq.jobs.compute import device_busy, model_refs, models
from chunkq.jobs.contract.specs import EncodeOptions
from chunkq.jobs.embed import encode_texts
from chunkq.queue_worker.devices import utilisation
from chunkq.queue_worker.devices.discovery import SIMULATED_ENV
from chunkq.queue_worker.processes import metrics
from chunkq.supervisor.watch.display import describe
from chunkq.supervisor.watch.snapshot import Snapshot
from tests.helpers import make_texts


@pytest.fixture
def simulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "utilization": 85}, {"name": "NVIDIA A10"}]}
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(gpus))
    monkeypatch.setenv(SIMULATED_ENV, str(path))


def _second_ago() -> int:
    return int((time.time() - 1.0) * 1e6)


def test_a_gpus_utilisation_samples_over_a_chunk_give_its_busy_share(simulated: None) -> None:
    read = utilisation.reader("0")
    assert read is not None
    samples = read(_second_ago())
    assert samples is not None and 5 <= len(samples) <= 6 and {p for _, p in samples} == {85.0}
    busy = device_busy._from_nvml(read, _second_ago())
    assert busy is not None and (busy.share, busy.source) == (pytest.approx(0.85), "nvml")


def test_where_nvml_cannot_say_there_is_no_nvml_figure(
    simulated: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unsupported = utilisation.reader("1")  # a GPU that keeps no samples: NOT_SUPPORTED
    assert unsupported is not None and unsupported(_second_ago()) is None
    assert device_busy._from_nvml(unsupported, _second_ago()) is None
    assert utilisation.reader("0-mig1") is None  # a MIG slice: not counted per instance
    assert utilisation.reader(None) is None
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"gpus": [], "init_error": "LIB_RM_VERSION_MISMATCH"}))
    monkeypatch.setenv(SIMULATED_ENV, str(broken))
    assert utilisation.reader("0") is None  # the seeds' host: CUDA events take over


def test_the_pool_serves_each_gpus_utilisation_where_nvml_gives_it(simulated: None) -> None:
    families = {f.name: f for f in metrics._GpuMemory(["0", "1"]).collect()}
    samples = {tuple(s.labels.values()): s.value for s in families["chunkq_gpu_busy_ratio"].samples}
    assert samples == {("0", "NVIDIA H100 80GB HBM3"): pytest.approx(0.85)}  # GPU 1 cannot say: no sample


def test_on_the_cpu_the_share_is_the_time_in_the_models_forward() -> None:
    loaded = models.get_model(model_refs.BUNDLED_MODEL, "cpu", "fp32", EncodeOptions())
    _, texts = make_texts(64, seed=3)
    with device_busy.measured(loaded.model, "cpu", None) as busy:
        encode_texts(loaded, texts, EncodeOptions())
    assert busy.source == "cpu-forward" and busy.share is not None and 0.5 < busy.share <= 1.0
    with device_busy.measured(loaded.model, "cpu", None) as idle:
        pass  # no forward: nothing measured, rather than a made-up 0 %
    assert idle.to_dict() is None
    assert not loaded.model.children().__next__()._forward_pre_hooks  # the hooks are gone after


def test_a_runs_figure_weighs_each_chunk_by_its_seconds() -> None:
    tally = device_busy.Tally()
    tally.add({"share": 0.9, "source": "nvml"}, 30.0)
    tally.add({"share": 0.3, "source": "nvml"}, 10.0)
    tally.add({"share": 1.0, "source": "cuda-events"}, 5.0)  # fewer seconds: not the run's figure
    tally.add(None, 100.0)  # a chunk from before the figure was kept
    tally.add({"share": "high", "source": "nvml"}, 100.0)  # damaged
    assert tally.figure() == {"share": 0.75, "source": "nvml", "seconds": 40.0}


@pytest.mark.parametrize(
    ("figure", "shown"),
    [
        ({"share": 0.31, "source": "nvml", "seconds": 9.0}, ", GPU busy 31 %"),
        ({"share": 0.31, "source": "cuda-events", "seconds": 9.0}, ", GPU busy 31 %"),
        ({"share": 0.97, "source": "cpu-forward", "seconds": 9.0}, None),  # a CPU is busy anyway
        (None, None),
    ],
)
def test_status_shows_how_busy_the_gpus_were(figure: dict[str, Any] | None, shown: str | None) -> None:
    snap = Snapshot("r", 4, 400, chunks_done=2, rows_done=200, rows_per_second=50.0, device_busy=figure)
    line = describe(snap)
    assert ("GPU busy" in line) == (shown is not None), line
    assert shown is None or f"50 rows/s{shown}" in line, line
