"""bench.serving on CPU at tiny shapes: the real engine server on loopback, the real gRPC client, every config.

On CPU configs a and d take the reference attention backend (the Triton kernels only run interpreted here, minutes
per request), so a against d is offload off against offload on over the same attention: the greedy tokens must
be equal, and the long request must really have moved KV blocks to the host and read them back.
"""

import json
import xml.etree.ElementTree as ET

import pytest
import torch

from bench.serving.cli import main, parse_args, run
from bench.serving.client import RequestResult
from bench.serving.engine import mxfp8_copy
from bench.serving.report import decode_rate, ratios, summarize, tables, target_report
from bench.serving.runner import host_cpu_per_step, predict_point_s
from bench.serving.workload import Workload
from m3stack.engine.model import weights
from m3stack.engine.model.loader import load_model
from m3stack.engine.model.mxfp8_writer import write_mxfp8_copy

PREFIX, SUFFIX, OUTPUT, BLOCK = 256, 32, 4, 16  # the tiny model's MSA blocks are 16 tokens
SHAPES = ["--device", "cpu", "--model", "tiny", "--prefix-tokens", str(PREFIX), "--suffix-tokens", str(SUFFIX),
          "--output-tokens", str(OUTPUT), "--concurrency", "1,2", "--requests-per-point", "3", "--warmup-tokens",
          "32"]  # fmt: skip


def _warm(rows: list[dict]) -> dict[tuple[str, int], dict]:
    return {(r["config"], r["concurrency"]): r for r in rows if r["phase"] == "warm"}


def test_every_config_and_concurrency_measured_offload_gives_the_same_tokens(tmp_path):
    bench = run([*SHAPES, "--long-context", "768", "--long-output-tokens", "30", "--budget-s", "120",
                 "--out", str(tmp_path)])  # fmt: skip
    payload = json.loads((tmp_path / "serving.json").read_text())
    assert {"device", "date", "command", "rows", "ratios", "targets"} <= set(payload)
    rows = payload["rows"]
    warm = _warm(rows)
    assert set(warm) == {(c, n) for c in "abcd" for n in (1, 2)}
    for (config, concurrency), row in warm.items():
        assert "error" not in row and "skipped" not in row, row
        assert row["requests"] == max(concurrency, 3)
        assert row["output_tokens"] == row["requests"] * OUTPUT
        assert row["output_tok_s"] > 0 and row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] > 0
        # Every warm request finds the whole (block-aligned) shared prefix cached and nothing of its suffix.
        assert row["prefix_hit_rate"] == PREFIX / (PREFIX + SUFFIX), (config, row)
        assert row["offload"] == (config == "d")
        assert row["kernel_compiles"] == 0  # on CPU no Triton kernel is compiled (reference attention)
        # Each request needs at least its OUTPUT tokens' steps; on CPU the engine thread computes the model itself.
        assert row["engine_steps"] >= OUTPUT and row["step_ms"] > 0
        assert 0 < row["engine_cpu_ms_per_step"] <= 1.5 * row["step_ms"] and row["loop_cpu_ms_per_step"] > 0
    cold = [r for r in rows if r["phase"] == "cold"]
    assert sorted(r["config"] for r in cold) == list("abcd") and all(r["prefix_hit_rate"] == 0 for r in cold)

    expected_keys = {"cold", "long"} | {f"c{c}-{i}" for c in (1, 2) for i in range(3)}
    assert set(bench.tokens["a"]) == set(bench.tokens["d"]) == expected_keys
    lengths = {"cold": 8, "long": 30}
    assert all(len(bench.tokens["a"][key]) == lengths.get(key, OUTPUT) for key in expected_keys)
    assert bench.tokens["d"] == bench.tokens["a"]
    assert payload["greedy_agreement"]["d_vs_a"] == {"requests": len(expected_keys), "equal": len(expected_keys)}

    long = {r["config"]: r for r in rows if r["phase"] == "long"}
    assert set(long) == {"a", "d"}
    # Decoded in thirds (graphs where there are any, eagerly, graphs again): a rate for each.
    assert all(long["a"][key] > 0 for key in ("decode_tok_s", "eager_decode_tok_s", "late_graph_decode_tok_s"))
    offloaded = long["d"]
    assert offloaded["context"] == 768 and offloaded["output_tokens"] == 30
    # 768 tokens are 48 blocks; the offload config keeps fewer on the device, the rest went to the host and back.
    assert payload["engines"]["d-long"]["num_kv_blocks"] < 768 // BLOCK
    assert offloaded["offload_spilled_blocks"] > 0 and offloaded["offload_spill_bytes"] > 0
    assert offloaded["offload_miss_bytes"] > 0 and offloaded["offload_staged_bytes"] > 0
    assert 0 <= offloaded["offload_hit_rate"] < 1

    assert set(payload["ratios"]["a_over_c"]) == set(payload["ratios"]["a_over_b"]) == {"1", "2"}
    plot = ET.parse(tmp_path / payload["plot"]).getroot()
    assert plot.tag.endswith("svg") and len(plot.findall(".//{http://www.w3.org/2000/svg}polyline")) == 3 * 4


def test_clients_sharing_one_engine_stream_get_the_same_tokens(tmp_path):
    """--engine-stream shared: every request of a point over one GenerateStream, read as its own call is."""
    own = run([*SHAPES, "--configs", "b", "--long-context", "0", "--budget-s", "60", "--out", str(tmp_path / "own")])
    shared = run([*SHAPES, "--configs", "b", "--long-context", "0", "--budget-s", "60", "--engine-stream", "shared",
                  "--out", str(tmp_path / "shared")])  # fmt: skip
    warm_keys = {f"c{n}-{i}" for n in (1, 2) for i in range(3)}
    assert shared.tokens["b"] == own.tokens["b"] and warm_keys <= set(own.tokens["b"])
    for row in _warm(shared.rows).values():
        assert "error" not in row and row["output_tokens"] == row["requests"] * OUTPUT and row["itl_p50_ms"] > 0


def test_points_past_the_budget_are_skipped_and_the_results_still_written(tmp_path):
    bench = run([*SHAPES, "--configs", "b,c", "--long-context", "0", "--budget-s", "2.5",
                 "--out", str(tmp_path), "--name", "short"])  # fmt: skip
    payload = json.loads((tmp_path / "short.json").read_text())
    rows = payload["rows"]
    assert rows == bench.rows and payload["plot"] == "short.svg" and (tmp_path / "short.svg").exists()
    assert not (tmp_path / "serving.json").exists()
    assert set(_warm(rows)) == {(c, n) for c in "bc" for n in (1, 2)}
    assert all(r["skipped"] == "budget" and "error" not in r for r in _warm(rows).values())


def test_a_failing_config_records_its_error_and_the_others_still_run(tmp_path, capsys):
    # One host block and 4 device blocks of 16 tokens cannot hold a 292-token context: config d cannot start.
    code = main([*SHAPES, "--configs", "d,b", "--long-context", "0", "--offload-device-blocks", "4",
                 "--offload-gb", "1e-6", "--budget-s", "60", "--out", str(tmp_path)])  # fmt: skip
    assert code == 1
    warm = _warm(json.loads((tmp_path / "serving.json").read_text())["rows"])
    assert all("capacity" in warm[("d", n)]["error"] for n in (1, 2))
    assert all(warm[("b", n)]["output_tokens"] == warm[("b", n)]["requests"] * OUTPUT for n in (1, 2))
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("| b | warm | 2 |")


def test_summaries_of_known_results():
    results = [
        RequestResult("x", [1, 2, 3], 0.1, [0.01, 0.03], 0.2, 100, 80, [0.1, 0.11, 0.14]),
        RequestResult("y", [4, 5, 6], 0.3, [0.02, 0.02], 0.4, 100, 0, [0.3, 0.32, 0.34]),
    ]
    row = summarize(results, seconds=2.0)
    assert row["requests"] == 2 and row["output_tokens"] == 6 and row["output_tok_s"] == 3.0
    assert row["ttft_p50_ms"] == 200.0 and abs(row["itl_p50_ms"] - 20.0) < 1e-9 and row["prefix_hit_rate"] == 0.4
    assert decode_rate([0.0, 1.0, 1.5, 2.0], 1, 3) == 2.0 and decode_rate([0.0], 0, 5) is None
    # 4 requests on 2 clients after 1-client requests of 3 s: 2 rounds of 3 s, batch twice as large.
    assert predict_point_s(4, 2, 1, 3.0) == 12.0 and predict_point_s(64, 64, 16, 2.0) == 8.0
    assert host_cpu_per_step(4, (1.0, 2.0), (1.2, 2.8), 2.0) == pytest.approx(
        {"engine_steps": 4, "step_ms": 500.0, "loop_cpu_ms_per_step": 50.0, "engine_cpu_ms_per_step": 200.0}
    )
    assert host_cpu_per_step(0, (1.0, 2.0), (1.0, 2.0), 2.0) == {"engine_steps": 0}
    rows = [{"phase": "warm", "config": c, "concurrency": n, "output_tok_s": v}
            for c, n, v in [("a", 1, 10.0), ("c", 1, 4.0), ("a", 2, 18.0), ("c", 2, 12.0), ("b", 1, 5.0)]]  # fmt: skip
    assert ratios(rows, "a", "c") == {"1": 2.5, "2": 1.5} and ratios(rows, "a", "b") == {"1": 2.0}
    workload = Workload(60_000, 2048, 512, 1000)
    targets = target_report(rows, workload, [1, 2])
    assert targets["a_over_c_ge_1.8_every_concurrency"] is False and targets["a_over_b_ge_2_at_60k"] is True
    assert targets["a_over_b_ge_2_at_concurrencies"] == [1]
    rows.append({"phase": "warm", "config": "b", "concurrency": 2, "output_tok_s": 10.0})
    assert target_report(rows, workload, [1, 2])["a_over_b_ge_2_at_concurrencies"] == [1]
    assert target_report(rows, workload, [1, 2])["a_over_b_ge_2_at_60k"] is False
    assert target_report(rows, workload, [1, 2, 4])["a_over_c_ge_1.8_every_concurrency"] is None
    assert targets["offload_miss_copy_ge_40_gbps"] is None


def test_config_weights_are_parsed_and_bad_ones_refused(capsys):
    assert parse_args(["--weights", "c=3,a=0.5"]).weights == {"c": 3.0, "a": 0.5}
    assert parse_args([]).weights == {}
    for bad in ("x=2", "c=0", "c=many", "c"):
        with pytest.raises(SystemExit):
            parse_args(["--weights", bad])
        assert "--weights" in capsys.readouterr().err


def test_fp8_caches_and_mxfp8_weights_configs_serve_beside_the_optimized_engine(tmp_path):
    """Config e is a over fp8 caches, f is a serving the same weights in MXFP8: every point measured, e's engine
    settings name both fp8 dtypes, f's engine held FP8 weights with their scales, f/a is reported, and their tokens
    are compared with a's (fp8 K/V and e4m3 weights move them: tests/engine/model/test_fp8_cache.py bounds e)."""
    bench = run([*SHAPES, "--configs", "a,e,f", "--concurrency", "1", "--long-context", "0", "--budget-s", "120",
                 "--out", str(tmp_path)])  # fmt: skip
    payload = json.loads((tmp_path / "serving.json").read_text())
    warm = _warm(payload["rows"])
    assert set(warm) == {("a", 1), ("e", 1), ("f", 1)}
    assert all("error" not in r and r["output_tok_s"] > 0 for r in warm.values())
    assert (warm[("a", 1)]["weights"], warm[("f", 1)]["weights"]) == ("float32", "mxfp8")
    engine = payload["engines"]["e"]
    assert engine["index_dtype"] == engine["kv_cache_dtype"] == "fp8_e4m3"
    assert "index_dtype" not in payload["engines"]["a"]
    assert payload["greedy_agreement"]["e_vs_a"]["requests"] > 0 and "e_over_a" in payload["ratios"]

    # What each engine's model held: a none of MXFP8; f every quantizable linear (attention, dense MLP, shared and
    # routed experts) as float8_e4m3fn with uint8 scales, the rest (embeddings, LM head, norms, routers) float32.
    quantizable = [name for name, _ in bench.model.named_parameters() if weights.quantizable(name)]
    served_a, served_f = payload["weights"]["a"], payload["weights"]["f"]
    assert served_a["mxfp8_parameters"] == 0 and set(served_a["parameter_bytes"]) == {"float32"}
    assert served_f["mxfp8_parameters"] == len(quantizable) > 0
    fp8_values = sum(bench.model.get_parameter(name).numel() for name in quantizable)
    assert served_f["parameter_bytes"]["float8_e4m3fn"] == fp8_values
    assert served_f["parameter_bytes"]["uint8"] == served_f["parameter_bytes"]["float8_e4m3fn"] // 32
    assert payload["ratios"]["f_over_a"]["1"] == warm[("f", 1)]["output_tok_s"] / warm[("a", 1)]["output_tok_s"]
    assert "f_over_a" in tables(bench.rows, bench.extra, [1]).splitlines()[2]
    assert payload["greedy_agreement"]["f_vs_a"]["requests"] > 0


def test_the_mxfp8_config_serves_the_loaders_model_of_the_writers_release_copy(tiny_model_dir, tmp_path):
    """``mxfp8_copy`` of a float model is, tensor for tensor (values, dtypes, the scales' block-major layout), the
    model the engine loads from the MXFP8 copy ``mxfp8_writer`` writes of that model's checkpoint."""
    cpu = torch.device("cpu")
    model, m3 = load_model(tiny_model_dir, cpu, torch.float32)
    ours, ours_m3 = mxfp8_copy(model, m3, cpu, torch.float32)
    released, released_m3 = load_model(write_mxfp8_copy(tiny_model_dir, tmp_path / "mxfp8"), cpu, torch.float32)
    assert ours_m3.quantization == released_m3.quantization is not None
    ours_params, released_params = dict(ours.named_parameters()), dict(released.named_parameters())
    assert ours_params.keys() == released_params.keys()
    assert any(p.dtype == torch.float8_e4m3fn for p in ours_params.values())
    for name, param in ours_params.items():
        expected = released_params[name]
        assert (param.dtype, param.shape, param.stride()) == (expected.dtype, expected.shape, expected.stride()), name
        as_bytes = param.dtype == torch.float8_e4m3fn  # torch.equal has no float8 kernel
        assert torch.equal(param.view(torch.uint8) if as_bytes else param,
                           expected.view(torch.uint8) if as_bytes else expected), name  # fmt: skip
