"""bench.profile_step: the CPU run end to end (tiny shape), the CUDA summary on synthetic events,
name shortening and the flag errors."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from blockdraft.bench.profile_step import STEP_LABEL, format_mode, main, shorten, summarize, trace_path, union_us


def test_cpu_run_prints_tables_and_writes_json_and_traces(tmp_path, capsys):
    out, trace = tmp_path / "p.json", tmp_path / "t.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--batch-size", "2", "--steps", "2", "--warmup", "1",
                 "--prompt-len", "16", "--out", str(out), "--trace", str(trace), "--draft-vocab-size", "64"]) == 0
    text = capsys.readouterr().out
    assert "== plain: 2 steps, batch 2" in text and "== dflash: 2 steps, batch 2" in text
    assert "CPU op (self time)" in text and "aten::" in text
    assert "graph launches" not in text  # GPU-only counts are not printed as zeros on the CPU
    doc = json.loads(out.read_text())
    assert doc["schema"] == "blockdraft-profile-step/1" and doc["settings"]["num_speculative_tokens"] == 15
    assert doc["settings"]["draft_vocab_size"] == 64 and doc["workload"]["draft_vocab_size"] == 64
    assert list(doc["modes"]) == ["plain", "dflash"] and doc["device"]["type"] == "cpu"
    for mode, s in doc["modes"].items():
        assert s["timeline"] == "cpu" and s["steps"] == 2 and s["batch_size"] == 2, mode
        assert s["wall_ms"] > 0 and s["profiled_wall_ms"] > 0 and s["busy_ms"] > 0
        assert s["idle_ms"] == pytest.approx(s["wall_ms"] - s["busy_ms"])
        assert s["kernels"] == 0 and s["graph_launches"] == 0 and s["host_rows"] is None
        assert s["rows"] and all(r["name"] != STEP_LABEL for r in s["rows"])
        assert sum(r["pct"] for r in s["rows"]) == pytest.approx(100)
        assert s["busy_ms"] == pytest.approx(s["device_time_ms"])
        assert any(r["name"].startswith("aten::") for r in s["rows"])
    assert doc["modes"]["plain"]["tokens"] == 2.0  # one token per request per step
    assert doc["modes"]["dflash"]["tokens"] >= 2.0
    for mode in ("plain", "dflash"):
        events = json.loads((tmp_path / f"t-{mode}.json").read_text())["traceEvents"]
        assert sum(e.get("name") == STEP_LABEL for e in events) == 2


def _event(name, device, start, end, self_cpu=0.0, annotation=False):
    return SimpleNamespace(name=name, device_type=device, self_cpu_time_total=self_cpu, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start))


def test_summarize_cuda_events_per_step():
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [
        _event(STEP_LABEL, cpu, 0, 100, self_cpu=50), _event(STEP_LABEL, cpu, 100, 200, self_cpu=50),
        _event("cudaGraphLaunch", cpu, 1, 2, 1.0), _event("cudaGraphLaunch", cpu, 101, 102, 1.0),
        _event("cudaLaunchKernel", cpu, 3, 4, 1.0), _event("cuLaunchKernelEx", cpu, 5, 6, 1.0),
        _event("cudaStreamSynchronize", cpu, 90, 99, 9.0), _event("aten::argmax", cpu, 7, 9, 2.0),
        _event("cudaDeviceSynchronize", cpu, 201, 250, 49.0),
        _event("void at::native::reduce_kernel<512, 1>(at::native::ReduceOp<float>)", gpu, 10, 30),
        _event("void at::native::reduce_kernel<512, 1>(at::native::ReduceOp<float>)", gpu, 110, 130),
        _event("_rms_norm_kernel", gpu, 20, 40),  # overlaps the first reduce: busy counts the union
        _event("Memcpy DtoH (Device -> Pinned)", gpu, 50, 52),
        # Kineto's GPU-side copies of record_function ranges: not GPU activity
        _event(STEP_LABEL, gpu, 10, 52, annotation=True), _event("other_range", gpu, 0, 200, annotation=True),
    ]
    s = summarize(events, steps=2, cuda=True)
    assert s["timeline"] == "cuda" and s["kernels"] == 1.5 and s["memcpy_memset"] == 0.5
    assert s["graph_launches"] == 1.0 and s["eager_launches"] == 1.0 and s["host_syncs"] == 0.5
    assert s["busy_ms"] == pytest.approx((30 + 20 + 2) / 2 / 1e3)
    assert s["device_time_ms"] == pytest.approx((40 + 20 + 2) / 2 / 1e3)
    rows = {r["name"]: r for r in s["rows"]}
    assert rows["reduce_kernel<512, 1>"]["count_per_step"] == 1.0
    assert rows["reduce_kernel<512, 1>"]["us_per_step"] == 20.0
    assert rows["Memcpy DtoH"]["pct"] == pytest.approx(100 * 2 / 62)
    hosts = {r["name"] for r in s["host_rows"]}
    assert STEP_LABEL not in hosts and {"cudaGraphLaunch", "aten::argmax"} <= hosts
    assert "cudaDeviceSynchronize" not in hosts  # outside the steps: the clock's synchronize
    s.update(steps=2, batch_size=1, tokens=1.0, wall_ms=0.1, profiled_wall_ms=0.1, idle_ms=0.05, floor_ms=0.05,
             wall_over_floor=2.0)
    text = format_mode("plain", s, top=5)
    assert "graph launches 1.0/step | eager launches 1.0/step | host syncs 0.5/step" in text


def test_shorten_union_and_trace_path():
    assert shorten("void (anonymous namespace)::foo<int>(float*, c10::Half)") == "foo<int>"
    assert shorten("nvjet_sm90_tst_128x8_64x12_4x1_v_bz_TNT") == "nvjet_sm90_tst_128x8_64x12_4x1_v_bz_TNT"
    assert len(shorten("k" * 100)) == 60
    assert union_us([(0, 10), (5, 15), (20, 25)]) == 20
    assert trace_path("a/t.json", "plain") == "a/t-plain.json"
    assert trace_path("t.json.gz", "dflash") == "t-dflash.json.gz" and trace_path("t", "plain") == "t-plain.json"


@pytest.mark.parametrize("flag, value, allowed", [
    ("--steps", "0", ">= 1"), ("--batch-size", "two", ">= 1"), ("--warmup", "-1", ">= 0"),
    ("--shape", "qwen9", "qwen3-8b"), ("--mode", "fast", "plain"), ("--device", "tpu", "cuda"),
])
def test_bad_flag_names_value_and_choices(flag, value, allowed, capsys):
    with pytest.raises(SystemExit) as e:
        main([flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and value in err and allowed in err and flag in err


def test_a_flag_it_lacks_is_not_taken_for_an_abbreviation(capsys):
    """`--draft` (other tools have it) once parsed as --draft-vocab-size and failed on its value."""
    with pytest.raises(SystemExit) as e:
        main(["--draft", "shipped"])
    assert e.value.code == 2 and "unrecognized arguments: --draft shipped" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--shape", "tiny", "--device", "cuda"])
    assert e.value.code == 2 and "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--out", "--trace"])
def test_output_path_that_is_a_folder_is_refused_before_the_run(flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--shape", "tiny", "--device", "cpu", flag, str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{flag} {str(tmp_path)!r} is a folder" in err


def test_draft_vocab_beyond_the_shape_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--shape", "tiny", "--device", "cpu", "--draft-vocab-size", "513"])
    assert exc.value.code == 2 and "--draft-vocab-size must be in [0, 512] for tiny" in capsys.readouterr().err


def test_num_speculative_tokens_reaches_the_dflash_engine(tmp_path, monkeypatch, capsys):
    import blockdraft.bench.suite as suite

    built = []
    real = suite.build_engines
    monkeypatch.setattr(suite, "build_engines", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    out = tmp_path / "p.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--mode", "dflash", "--batch-size", "2", "--steps", "1",
                 "--warmup", "0", "--prompt-len", "16", "--num-speculative-tokens", "3", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["settings"]["num_speculative_tokens"] == 3
    (dflash,) = [e for e in built[0][0] if e.mode == "dflash"]
    assert dflash.llm.speculator.num_speculative_tokens == 3
    with pytest.raises(SystemExit) as exc:
        main(["--shape", "tiny", "--device", "cpu", "--num-speculative-tokens", "16"])
    assert exc.value.code == 2 and "--num-speculative-tokens must be in [1, 15]" in capsys.readouterr().err
