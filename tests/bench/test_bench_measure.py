"""Measurement loop, parity, settings, report assembly and the printed table (fake engines)."""

import pytest
import torch

from blockdraft.bench import report as rep
from blockdraft.bench.command import parse_batch_sizes
from blockdraft.bench.engines import Generation
from blockdraft.bench.measure import Run, compare_outputs, measure
from blockdraft.bench.suite import Settings

CPU = torch.device("cpu")


class _Fake:
    engine, mode = "fake", "plain"

    def __init__(self, fail=False, limit=None):
        self.fail, self.limit, self.calls, self.concurrency = fail, limit, [], []

    def unsupported(self, batch_size):
        return "too many" if self.limit and batch_size > self.limit else None

    def generate(self, prompts, max_tokens, concurrency=None):
        self.calls.append(max_tokens)
        self.concurrency.append(concurrency)
        if self.fail:
            raise RuntimeError("boom")
        return Generation([[5] * max_tokens for _ in prompts], num_steps=max_tokens)


def test_measure_warms_up_then_times_prefill_and_full_runs():
    eng = _Fake()
    cell = measure(eng, [[1, 2], [3]], max_tokens=6, repeats=3, warmup=2, device=CPU)
    assert eng.calls == [6, 6, 1, 6, 1, 6, 1, 6]
    assert cell.status == "ok" and len(cell.runs) == 3 and cell.deterministic
    r = cell.runs[0]
    assert (r.num_steps, r.num_tokens, r.prefill_steps, r.prefill_tokens) == (6, 12, 1, 2)
    assert cell.summary()["tokens_per_s"] > 0 and cell.token_ids == [[5] * 6] * 2
    assert cell.summary()["ttft_ms"] == pytest.approx(1e3 * sorted(x.prefill_seconds for x in cell.runs)[1])


def test_measure_sends_every_prompt_at_the_given_concurrency():
    """A cell of 5 requests at concurrency 2: every call gets all 5 prompts and concurrency 2; the
    cell is filed under batch size 2 with 5 requests; the engine is asked about 2, not 5."""
    eng = _Fake(limit=2)
    cell = measure(eng, [[1]] * 5, max_tokens=4, repeats=1, warmup=1, device=CPU, concurrency=2)
    assert cell.status == "ok" and eng.concurrency == [2, 2, 2]
    assert (cell.batch_size, cell.num_requests, cell.summary()["num_requests"]) == (2, 5, 5)
    assert cell.runs[0].num_tokens == 20 and len(cell.token_ids) == 5
    assert measure(_Fake(limit=2), [[1]] * 5, 4, 1, 0, CPU, concurrency=3).status == "n/a"
    default = measure(_Fake(), [[1]] * 3, 4, 1, 0, CPU)  # None: one closed batch of all prompts
    assert (default.batch_size, default.num_requests) == (3, 3)


def test_measure_records_unsupported_and_failing_engines():
    cell = measure(_Fake(limit=1), [[1], [2]], 4, 1, 0, CPU)
    assert (cell.status, cell.reason, cell.runs) == ("n/a", "too many", [])
    cell = measure(_Fake(fail=True), [[1]], 4, 1, 0, CPU)
    assert cell.status == "error" and "RuntimeError: boom" in cell.reason
    with pytest.raises(ValueError, match=r"^max_tokens must be >= 2"):
        measure(_Fake(), [[1]], 1, 1, 0, CPU)


def test_step_time_subtracts_the_prefill_run():
    r = Run(seconds=1.1, num_steps=11, num_tokens=22, prefill_seconds=0.1, prefill_steps=1, prefill_tokens=2)
    assert r.ms_per_step == pytest.approx(100.0)
    assert r.decode_tokens_per_s == pytest.approx(20.0)
    assert r.tokens_per_s == pytest.approx(20.0)
    assert r.ttft_ms == pytest.approx(100.0)
    noisy = Run(seconds=0.1, num_steps=11, num_tokens=22, prefill_seconds=0.2, prefill_steps=1, prefill_tokens=2)
    assert noisy.ms_per_step is None and noisy.decode_tokens_per_s is None


def test_compare_outputs_counts_requests_and_first_mismatch():
    got = compare_outputs([[1, 2, 3], [1, 2, 3], [1, 2]], [[1, 2, 3], [1, 9, 3], [1, 2, 3]])
    assert got == {"num_requests": 3, "mismatched_requests": 2, "first_mismatch": [None, 1, 2]}
    with pytest.raises(ValueError, match="cannot compare 1 outputs with 2"):
        compare_outputs([[1]], [[1], [2]])


def test_settings_and_batch_sizes_refuse_bad_values():
    assert parse_batch_sizes("1, 8,32") == (1, 8, 32)
    for bad in ("1,x", "0", "1,,2", "-4"):
        with pytest.raises(ValueError, match="--batch-sizes takes positive integers"):
            parse_batch_sizes(bad)
    with pytest.raises(ValueError, match=r"^max_tokens must be >= 2"):
        Settings((1,), 1)
    with pytest.raises(ValueError, match="engines must include 'ours'"):
        Settings((1,), 8, engines=("hf",))
    with pytest.raises(ValueError, match="engines must include"):
        Settings((1,), 8, engines=("ours", "vllm"))
    with pytest.raises(ValueError, match=r"num_prompts must be >= every batch size, got 16 with batch sizes up to 32"):
        Settings((1, 32), 8, num_prompts=16)
    assert Settings((1, 32), 8, num_prompts=32).num_prompts == 32


def _row(engine, mode, batch, tps, ms, status="ok"):
    return {"engine": engine, "mode": mode, "batch_size": batch, "status": status, "reason": None,
            "tokens_per_s": tps, "decode_tokens_per_s": tps, "ms_per_step": ms, "seconds": 1.0,
            "acceptance_length": None, "deterministic": True, "runs": [{}] if status == "ok" else []}


def _report(rows, parity=()):
    floor = {"hbm_bytes_per_s": 4.25e12, "target_weight_bytes": 8.5e9, "plain_step_floor_ms": 2.0,
             "dflash_extra_bytes": 1e9, "dflash_step_floor_ms": 2.2}
    rows = rep.add_speedups(rows)
    return {"schema": rep.SCHEMA, "created": "now", "workload": {"name": "w"}, "device": {"name": "dev"},
            "dtype": "bfloat16", "settings": {"max_tokens": 8, "repeats": 3, "warmup": 1, "num_speculative_tokens": 15},
            "floor": floor, "results": rows, "parity": list(parity), "skipped": {"x": "why"},
            "criteria": rep.criteria(rows, floor)}


def test_speedups_are_same_batch_ratios_and_zlab_is_mode_matched():
    rows = [_row("ours", "plain", 1, 100, 2.4), _row("ours", "dflash", 1, 250, 2.9),
            _row("ours", "dflash-forced", 1, 500, 3.0), _row("hf", "plain", 1, 50, 9.0),
            _row("zlab", "plain", 1, 40, 10.0), _row("zlab", "dflash", 1, 80, 12.0),
            _row("ours", "plain", 8, 800, 3.0), _row("zlab", "plain", 8, None, None, status="n/a")]
    doc = _report(rows)
    by = {(r["engine"], r["mode"], r["batch_size"]): r for r in doc["results"]}
    assert by[("ours", "dflash", 1)]["speedup_vs_ours_plain"] == pytest.approx(2.5)
    assert by[("ours", "dflash", 1)]["speedup_vs_hf"] == pytest.approx(5.0)
    assert by[("ours", "dflash", 1)]["speedup_vs_zlab"] == pytest.approx(250 / 80)
    assert by[("ours", "plain", 1)]["speedup_vs_zlab"] == pytest.approx(100 / 40)
    assert by[("ours", "dflash-forced", 1)]["speedup_vs_zlab"] is None
    assert by[("ours", "plain", 8)]["speedup_vs_hf"] is None
    c = doc["criteria"]
    assert c["plain_step_over_floor"] == pytest.approx(1.2) and c["plain_step_pass"] is True
    assert c["dflash_step_over_plain_step"] == pytest.approx(2.9 / 2.4) and c["dflash_step_pass"] is True
    rep.validate_report(doc)
    table = rep.format_table(doc)
    assert "our plain step / HBM floor at batch 1: 1.200 (target <= 1.3) PASS" in table
    assert "our DFlash step / our plain step at batch 1: 1.208 (target <= 1.25) PASS" in table
    assert "n/a" in table and "skipped x: why" in table


def test_criteria_fail_and_missing_rows():
    doc = _report([_row("ours", "plain", 1, 100, 3.0), _row("ours", "dflash", 1, 100, 4.0)])
    assert doc["criteria"]["plain_step_pass"] is False and doc["criteria"]["dflash_step_pass"] is False
    assert "FAIL" in rep.format_table(doc)
    empty = _report([_row("ours", "plain", 8, 100, 3.0)])["criteria"]
    assert empty["plain_step_over_floor"] is None and empty["plain_step_pass"] is None
    # a CPU run: the ratios for information, no pass / fail against an HBM floor
    cpu = rep.criteria([_row("ours", "plain", 1, 100, 3.0), _row("ours", "dflash", 1, 100, 4.0)],
                       {"plain_step_floor_ms": 2.5}, gpu=False)
    assert cpu["plain_step_over_floor"] == pytest.approx(1.2) and cpu["plain_step_pass"] is None
    assert cpu["dflash_step_pass"] is None


def test_validate_report_names_what_is_wrong():
    doc = _report([_row("ours", "plain", 1, 100, 2.0)])
    rep.validate_report(doc)
    for breakage, message in (
        (lambda d: d.update(schema="x"), "schema must be"),
        (lambda d: d.pop("floor"), "missing top-level key 'floor'"),
        (lambda d: d["results"][0].pop("ms_per_step"), r"results\[0\] is missing \['ms_per_step'\]"),
        (lambda d: d["results"][0].update(status="maybe"), "status must be one of"),
        (lambda d: d["results"][0].update(runs=[]), "ok but has no runs"),
        (lambda d: d["parity"].append({"batch_size": 1}), r"parity\[0\] is missing"),
    ):
        broken = _report([_row("ours", "plain", 1, 100, 2.0)])
        breakage(broken)
        with pytest.raises(ValueError, match=message):
            rep.validate_report(broken)


def test_run_matrix_builds_one_engine_at_a_time(monkeypatch):
    """Each of our engines is measured at every batch size alone in the process (built, measured,
    dropped), and cells and parity rows still come out in batch-size order."""
    import weakref

    from blockdraft.bench import suite
    from blockdraft.bench.engines import ours
    from blockdraft.bench.workload import random_workload

    live, alive_at_build = weakref.WeakSet(), []
    original = ours.OurEngine.__init__

    def counting_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        live.add(self)
        alive_at_build.append(len(live))

    monkeypatch.setattr(ours.OurEngine, "__init__", counting_init)
    workload = random_workload("tiny", torch.device("cpu"), torch.float32, num_prompts=2, prompt_len=8,
                               draft_layers=None, block_size=4)
    settings = Settings((1, 2), 6, repeats=1, warmup=0, engines=("ours",), forced=True)
    cells, parity, skipped = suite.run_matrix(workload, settings)
    assert alive_at_build == [1, 1, 1]  # plain, DFlash, forced: never two at once
    assert [(c.batch_size, c.mode) for c in cells] == [
        (b, m) for b in (1, 2) for m in ("plain", "dflash", "dflash-forced")]
    assert all(c.status == "ok" for c in cells)
    assert [(r["batch_size"], r["candidate"]) for r in parity] == [
        (b, c) for b in (1, 2) for c in ("ours/dflash", "ours/dflash-forced")]
    assert all(r["mismatched_requests"] == 0 for r in parity), parity  # fp32: speculative == plain, forced == ref


def test_table_says_how_many_mismatches_are_near_ties():
    rows = [_row("ours", "plain", 8, 100, 2.0), _row("ours", "dflash", 8, 200, 3.0), _row("hf", "plain", 8, 50, 9.0)]
    rows[0]["ttft_ms"] = 12.345
    parity = [{"batch_size": 8, "candidate": "ours/dflash", "reference": "ours/plain", "num_requests": 8,
               "mismatched_requests": 2, "first_mismatch": [None] * 6 + [5, 9], "divergences": [{}, {}],
               "near_ties": 1},
              {"batch_size": 8, "candidate": "hf/plain", "reference": "ours/plain", "num_requests": 8,
               "mismatched_requests": 3, "first_mismatch": [None] * 5 + [1, 2, 3]}]
    table = rep.format_table(_report(rows, parity))
    assert "2/8 (1 tie)" in table and "3/8" in table and "3/8 (" not in table
    parity[0]["near_ties"] = 2
    assert "2/8 (2 ties)" in rep.format_table(_report(rows, parity))
    assert "TTFT ms" in table and " 12.35 " in table and "t of them first differ at a near-tie" in table  # rows of older JSON files without ttft_ms print n/a


def test_table_explains_ttft_with_num_prompts_and_a_missing_step_time():
    """With --num-prompts the TTFT column is the prefill-only run of all requests: the table says
    so; an ok row whose prefill-only run was not shorter than its full run (ms/step None) gets the
    reason. Neither line without the cause."""
    rows = [_row("ours", "plain", 2, 100, 2.0), _row("ours", "dflash", 2, 200, 3.0)]
    plain = rep.format_table(_report(rows))
    assert "TTFT ms: the prefill-only run" not in plain and "ms/step, dec tok/s n/a" not in plain
    report = _report(rows)
    report["settings"]["num_prompts"] = 6
    report["results"][1]["ms_per_step"] = None
    table = rep.format_table(report)
    assert "TTFT ms: the prefill-only run, all 6 requests to their first token, 'batch' at a time" in table
    assert "ms/step, dec tok/s n/a: the full run took no longer than the prefill-only run, or ran no more steps" in table
