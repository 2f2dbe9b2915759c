"""lambdas/core/sizing.py: the data-group sizing advisor's arithmetic, its cheapest configuration, and a
sweep started from its prediction."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lambdas.core.price_performance import FALLBACK_PRICES
from lambdas.core.sizing import SizingError, SizingProfile, advise, data_hosts_needed, ms_per_batch_per_vcpu, predicted_step_ms
from lambdas.core.sweep import SweepSpecError, data_host_count, images_per_step, plan_sweep

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("preprocess", "train", "spare", "vcpus", "needed"),
    [
        (300, 100, 0, 1, 3),  # three vCPUs' worth of preprocessing per step
        (300, 100, 1, 1, 2),  # the DNN host's own spare vCPU covers one of them
        (100, 100, 0, 1, 1),  # exactly keeps up
        (400, 100, 8, 1, 0),  # the DNN host alone is enough
        (9544, 184, 0, 36, 2),  # 9.5 vCPU-s per batch, 184 ms steps, 36-vCPU hosts: 51.9 vCPUs → 2 hosts
    ],
)
def test_data_hosts_needed(preprocess: float, train: float, spare: float, vcpus: int, needed: int) -> None:
    profile = SizingProfile(preprocess, train, dnn_spare_vcpus=spare)
    assert data_hosts_needed(profile, vcpus) == needed
    assert predicted_step_ms(profile, needed, vcpus) == pytest.approx(train)  # keeps up: the step is training's
    if needed > 0:
        assert predicted_step_ms(profile, needed - 1, vcpus) > train  # one fewer is input-bound


def test_no_capacity_at_all_is_an_infinite_step() -> None:
    assert math.isinf(predicted_step_ms(SizingProfile(100, 50), 0, 36))


def test_the_advisor_names_the_cheapest_size_and_the_sizes_to_sweep() -> None:
    # ResNet50-like: a batch takes 2.4 s to preprocess on the GPU host's 8 spare vCPUs (19.2 vCPU-s), the
    # GPUs step in 86 ms; ml.c5.18xlarge hosts have 72 vCPUs.
    profile = SizingProfile(preprocess_ms_per_batch_per_vcpu=2400 * 8, train_ms_per_step=86, dnn_spare_vcpus=8)
    advice = advise(profile, "ml.p4d.24xlarge", "ml.c5.18xlarge", FALLBACK_PRICES)
    assert advice.needed == 3 and [c.data_hosts for c in advice.candidates] == [0, 1, 2, 3, 4]
    assert advice.cheapest.data_hosts == 3  # fewer are input-bound, more only cost
    assert advice.candidates[0].predicted_step_ms == pytest.approx(2400.0)
    assert advice.sweep_sizes == [0, 2, 3, 4]


def test_bad_profiles_and_gpu_data_hosts_are_refused() -> None:
    with pytest.raises(SizingError, match="positive"):
        SizingProfile(0, 100)
    with pytest.raises(SizingError, match="efficiency"):
        SizingProfile(100, 100, efficiency=1.5)
    with pytest.raises(SizingError, match="CPU instances"):
        advise(SizingProfile(100, 100), "ml.p3.2xlarge", "ml.p3.2xlarge", FALLBACK_PRICES)
    with pytest.raises(SizingError, match="larger data instance type"):
        advise(SizingProfile(1e6, 10), "ml.p3.2xlarge", "ml.c5.xlarge", FALLBACK_PRICES)


def test_a_sweep_can_start_from_the_prediction() -> None:
    base = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())
    # 9.5 vCPU-s per batch at 184 ms/step on 36-vCPU ml.c5.9xlarge hosts: 2 needed.
    plan = plan_sweep({"sweep_name": "advised", "base": base, "advisor": {"preprocess_ms_per_batch_per_vcpu": 9544, "train_ms_per_step": 184}})
    assert [spec["run_name"] for spec in plan.configurations] == ["vision-hetero-d0", "vision-hetero-d1", "vision-hetero-d2", "vision-hetero-d3"]
    with pytest.raises(SweepSpecError, match="advisor"):
        plan_sweep({"sweep_name": "advised", "base": base, "advisor": {"train_ms_per_step": 184}})
    with pytest.raises(SweepSpecError) as both:
        plan_sweep({"sweep_name": "advised", "base": base, "data_hosts": [1], "advisor": {"preprocess_ms_per_batch_per_vcpu": 1, "train_ms_per_step": 1}})
    assert both.value.field == "data_hosts"


def test_the_advisor_takes_images_per_second_per_vcpu_at_the_bases_batch_size() -> None:
    """bench/preprocess.py reports images/s per vCPU; the advisor costs a batch from it at the base's
    batch size (its hyperparameter, else the trainer's default), and the sizes match the per-batch form."""
    base = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())  # batch_size 64
    per_image = plan_sweep({"sweep_name": "advised", "base": base, "advisor": {"images_per_s_per_vcpu": 64 / 9.544, "train_ms_per_step": 184}})
    per_batch = plan_sweep({"sweep_name": "advised", "base": base, "advisor": {"preprocess_ms_per_batch_per_vcpu": 9544, "train_ms_per_step": 184}})
    assert [data_host_count(spec) for spec in per_image.configurations] == [data_host_count(spec) for spec in per_batch.configurations] == [0, 1, 2, 3]
    assert ms_per_batch_per_vcpu(150, 64) == pytest.approx(426.67, abs=0.01)
    default_batch = {**base, "hyperparameters": {key: value for key, value in base["hyperparameters"].items() if key != "batch_size"}}
    # The PyTorch trainer's default batch (32) halves the cost of a batch: fewer data hosts.
    halved = plan_sweep({"sweep_name": "advised", "base": default_batch, "advisor": {"images_per_s_per_vcpu": 64 / 9.544, "train_ms_per_step": 184}})
    assert max(data_host_count(spec) for spec in halved.configurations) == 2
    # samples/s per vCPU, what `hetero profile` prints for any workload, is the same figure by its own name.
    per_sample = plan_sweep({"sweep_name": "advised", "base": base, "advisor": {"samples_per_s_per_vcpu": 64 / 9.544, "train_ms_per_step": 184}})
    assert per_sample.configurations == per_image.configurations
    with pytest.raises(SweepSpecError, match="give the preprocessing cost once"):
        plan_sweep({"sweep_name": "advised", "base": base, "advisor": {"samples_per_s_per_vcpu": 7, "images_per_s_per_vcpu": 7, "train_ms_per_step": 184}})


@pytest.mark.parametrize(("advisor", "field", "message"), [
    ({"images_per_s_per_vcpu": 100, "preprocess_ms_per_batch_per_vcpu": 9, "train_ms_per_step": 1}, "advisor", "once"),
    ({"images_per_s_per_vcpu": 0, "train_ms_per_step": 184}, "advisor", "positive"),
    ({"images_per_s_per_vcpu": float("inf"), "train_ms_per_step": 184}, "advisor", "positive"),
    ({"images_per_s_per_vcpu": "fast", "train_ms_per_step": 184}, "advisor", "could not convert"),
])
def test_a_bad_images_per_second_figure_is_refused_by_name(advisor: dict, field: str, message: str) -> None:
    base = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())
    with pytest.raises(SweepSpecError, match=message) as refused:
        plan_sweep({"sweep_name": "advised", "base": base, "advisor": advisor})
    assert refused.value.field == field


def test_a_base_with_a_bad_batch_size_is_refused_by_name_and_a_string_one_is_read_as_the_trainer_reads_it() -> None:
    base = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())
    base["hyperparameters"]["batch_size"] = "sixty-four"
    with pytest.raises(SweepSpecError) as refused:
        plan_sweep({"sweep_name": "advised", "base": base, "advisor": {"images_per_s_per_vcpu": 100, "train_ms_per_step": 184}})
    assert refused.value.field.startswith("base.hyperparameters")
    base["hyperparameters"]["batch_size"] = "64"  # what the trainer accepts, the advisor accepts
    assert images_per_step(base) == 64
    # A per-step figure needs no batch size at all.
    plan_sweep({"sweep_name": "advised", "base": base, "advisor": {"preprocess_ms_per_batch_per_vcpu": 9544, "train_ms_per_step": 184}})


def test_a_step_takes_a_batch_from_every_trainer_process() -> None:
    """One process per GPU (or NeuronCore) of every DNN host: 8 on a p4d, 32 on a trn1.32xlarge. The
    same images/s per vCPU must then advise more data hosts for more GPUs."""
    base = json.loads((EXAMPLES / "pytorch-heterogeneous.json").read_text())  # 1× ml.p3.2xlarge, batch 64
    assert images_per_step(base) == 64
    dnn = next(group for group in base["instance_groups"] if group["role"] == "dnn")
    dnn.update(instance_type="ml.p4d.24xlarge", count=2)
    assert images_per_step(base) == 64 * 8 * 2
    advised = plan_sweep({"sweep_name": "advised", "base": base, "advisor": {"images_per_s_per_vcpu": 50, "train_ms_per_step": 100}})
    # 1024 images per 100 ms step at 50 images/s per vCPU: 204.8 vCPUs, 6 ml.c5.9xlarge of 36.
    assert sorted(data_host_count(spec) for spec in advised.configurations) == [0, 5, 6, 7]
    neuron = json.loads((EXAMPLES / "neuron-trn1-32xlarge.json").read_text())
    cores = 32 * next(group["count"] for group in neuron["instance_groups"] if group["role"] == "dnn")
    assert images_per_step(neuron) == cores * int(neuron["hyperparameters"].get("batch_size", 32))
