"""The Fits condition from an M3Deployment's spec: the released checkpoints by name, GPUs by product, the
engine's fields (or, where unset, its flags in extraArgs) that size its KV cache; and the Warning event the first
False brings."""

import pytest

from m3stack.operator.fits import assess_fit
from m3stack.operator.spec import M3Deployment
from m3stack.operator.status import Observed, compute_status
from tests.operator.conftest import body

T0 = "2026-12-04T10:00:00Z"
FOUR_H200 = {"accelerator": {"count": 4, "product": "NVIDIA-H200"}, "parallelism": {"tensor": 4}}


def _fit(path: str, engine: dict, name: str = "m3"):
    return assess_fit(M3Deployment.from_body(body({"model": {"name": name, "path": path}, "engine": engine})))


@pytest.mark.parametrize(
    ("path", "engine", "status", "reason"),
    [
        ("/models/MiniMax-M3", FOUR_H200, "False", "InsufficientGPUMemory"),
        ("/models/MiniMax-M3-MXFP8", FOUR_H200, "True", "ModelFits"),
        (
            "/models/MiniMax-M3",
            {**FOUR_H200, "accelerator": {"count": 8, "product": "NVIDIA-H200"}, "parallelism": {"tensor": 8}},
            "True",
            "ModelFits",
        ),
        # Eight GPUs in the pod but one engine GPU (parallelism.tensor 1): what the engine would use.
        ("/models/MiniMax-M3", {**FOUR_H200, "parallelism": {"tensor": 1}}, "False", "InsufficientGPUMemory"),
        # 512K of bf16 KV does not fit beside the MXFP8 weights in 0.9 of the GPUs; in all of them it does.
        ("/models/MiniMax-M3-MXFP8", {**FOUR_H200, "maxModelLen": 524288}, "False", "InsufficientGPUMemory"),
        (
            "/models/MiniMax-M3-MXFP8",
            {**FOUR_H200, "maxModelLen": 524288, "gpuMemoryUtilization": 1},
            "True",
            "ModelFits",
        ),
        # Half of each GPU does not hold the MXFP8 weights, even at the default context.
        ("/models/MiniMax-M3-MXFP8", {**FOUR_H200, "gpuMemoryUtilization": 0.5}, "False", "InsufficientGPUMemory"),
        # The same settings as flags in extraArgs (resources written before the fields): an fp8 cache fits 512K.
        (
            "/models/MiniMax-M3-MXFP8",
            {**FOUR_H200, "extraArgs": ["--max-model-len", "524288"]},
            "False",
            "InsufficientGPUMemory",
        ),
        (
            "/models/MiniMax-M3-MXFP8",
            {
                **FOUR_H200,
                "extraArgs": ["--max-model-len=524288"],
                "kvCache": {"dtype": "fp8_e4m3", "indexDtype": "fp8_e4m3"},
            },
            "True",
            "ModelFits",
        ),
        ("/models/my-finetune", FOUR_H200, "Unknown", "UnknownModel"),
        (
            "/models/MiniMax-M3",
            {"accelerator": {"count": 4}, "parallelism": {"tensor": 4}},
            "Unknown",
            "UnknownAccelerator",
        ),
        ("/models/MiniMax-M3", {"accelerator": {"count": 0}}, "Unknown", "CPUEngines"),
    ],
)
def test_fit_by_release_gpu_and_flags(path: str, engine: dict, status: str, reason: str) -> None:
    fit = _fit(path, engine)
    assert (fit.status, fit.reason) == (status, reason), fit.message


@pytest.mark.parametrize(
    "engine",
    [
        {**FOUR_H200, "maxModelLen": 131072, "gpuMemoryUtilization": 0.75},
        {**FOUR_H200, "extraArgs": ["--max-model-len=131072", "--gpu-memory-utilization", "0.75"]},
    ],
    ids=["fields", "extra-args"],
)
def test_the_context_and_utilization_sized_are_the_engines(engine: dict) -> None:
    message = _fit("/models/MiniMax-M3-MXFP8", engine).message
    assert "(0.75 usable = " in message and " for 131072 tokens" in message, message


def test_a_release_named_by_the_served_name_and_the_figures_in_the_message() -> None:
    fit = _fit("/models/checkpoint", FOUR_H200, name="MiniMaxAI/MiniMax-M3")
    assert fit.status == "False"
    assert fit.message.startswith("MiniMax-M3 (854 GB) on parallelism.tensor 4 (accelerator.count 4) NVIDIA-H200: ")
    assert "weights 201.8 GiB" in fit.message and "GiB short" in fit.message


def test_a_first_false_fits_is_a_warning_event_and_unknown_is_none() -> None:
    for path, events in (("/models/MiniMax-M3", [("Fits", "False", "InsufficientGPUMemory")]), ("default", [])):
        m3d = M3Deployment.from_body(body({"model": {"path": path}, "engine": FOUR_H200}))
        status, transitions = compute_status(m3d, Observed(deployments={}), {}, observed_generation=3, now=T0)
        assert [(t.type, t.status, t.reason) for t in transitions if t.type == "Fits"] == events
        assert all(not t.healthy for t in transitions if t.type == "Fits")
        assert any(c["type"] == "Fits" for c in status["conditions"])
