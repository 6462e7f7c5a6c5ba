"""sample(): purity w.r.t. batch composition, greedy semantics, seeds; SamplingTensors; compute_logprobs."""

import pytest
import torch

from blockdraft.sample import SamplingTensors, compute_logprobs, sample
from blockdraft.sampling_params import SamplingParams

V = 1000


def _mixed_params(n: int, gen: torch.Generator) -> list[SamplingParams]:
    out = []
    for i in range(n):
        kind = i % 8
        seed = int(torch.randint(0, 2**31, (1,), generator=gen))
        if kind == 0:
            out.append(SamplingParams(temperature=0.0, seed=seed))
        elif kind == 1:
            out.append(SamplingParams(temperature=1.0, seed=seed))
        elif kind == 2:
            out.append(SamplingParams(temperature=0.7, top_k=20, seed=seed))
        elif kind == 3:
            out.append(SamplingParams(temperature=1.3, top_p=0.9, seed=seed))
        elif kind == 4:
            out.append(SamplingParams(temperature=0.8, top_k=50, top_p=0.8, seed=seed))
        elif kind == 5:
            out.append(SamplingParams(temperature=0.5, top_k=-1, top_p=0.95, seed=seed))
        elif kind == 6:
            out.append(SamplingParams(temperature=1.2, min_p=0.1, seed=seed))
        else:
            out.append(SamplingParams(temperature=0.9, top_k=60, top_p=0.9, min_p=0.05, seed=seed))
    return out


def _setup(n=60):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, V, generator=gen) * 2.0
    params = _mixed_params(n, gen)
    positions = torch.randint(0, 5000, (n,), generator=gen)
    return logits, params, positions


def _sample_rows(logits, params, positions, hints: bool):
    st = SamplingTensors.from_params(params)
    if hints:
        return st.sample(logits, positions)
    return sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, positions, min_p=st.min_p)


@pytest.mark.parametrize("hints", [True, False])
def test_batch_composition_and_order_do_not_matter(hints):
    logits, params, positions = _setup()
    n = len(params)
    ref = _sample_rows(logits, params, positions, hints=False)
    full = _sample_rows(logits, params, positions, hints=hints)
    assert torch.equal(full, ref)
    # permuted rows
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    out = _sample_rows(logits[perm], [params[i] for i in perm.tolist()], positions[perm], hints)
    assert torch.equal(out, ref[perm])
    # each row alone (a batch of one takes different fast paths through the hints)
    for i in range(n):
        one = _sample_rows(logits[i : i + 1], [params[i]], positions[i : i + 1], hints)
        assert one.item() == ref[i].item(), i
    # sub-batches of several sizes, mixed with foreign rows of other parameters
    for size in (2, 5, 17):
        idx = torch.arange(0, n, max(1, n // size))[:size]
        sub = _sample_rows(logits[idx], [params[i] for i in idx.tolist()], positions[idx], hints)
        assert torch.equal(sub, ref[idx])


def test_same_request_many_rows_per_step_equals_one_row_per_step():
    # Speculative verify: K+1 rows of one request in one step == plain decoding one row at a time.
    gen = torch.Generator().manual_seed(3)
    k1 = 16
    logits = torch.randn(k1, V, generator=gen)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    st = SamplingTensors.from_params([p]).repeat_interleave(k1)
    positions = torch.arange(100, 100 + k1)
    block = st.sample(logits, positions)
    single = SamplingTensors.from_params([p])
    for j in range(k1):
        assert single.sample(logits[j : j + 1], positions[j : j + 1]).item() == block[j].item()


def test_hint_paths_agree_exactly():
    # topk fast path (no top-p anywhere, every row has top-k) vs full-sort path vs no hints.
    gen = torch.Generator().manual_seed(4)
    n = 40
    logits = torch.randn(n, V, generator=gen) * 3
    logits[:, 10] = logits[:, 11] = 20.0  # a tie at the top: k = 1 keeps both (threshold semantics)
    params = [SamplingParams(temperature=1.0, top_k=k, seed=i) for i, k in enumerate([1, 2, 5, 30, 999, 2000] * 7)][:n]
    st = SamplingTensors.from_params(params)
    assert st.max_top_k == 2000 and not st.any_top_p
    pos = torch.arange(n)
    a = st.sample(logits, pos)
    b = sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, pos)
    c = sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, pos, any_top_k=True, any_top_p=False, max_top_k=2000)
    d = sample(logits, st.temperature, st.top_k, st.top_p, st.seeds, pos, any_top_k=True, any_top_p=True)
    assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    small = SamplingTensors.from_params(params[:4])  # max_top_k = 30 < V: torch.topk path
    assert small.max_top_k == 30
    assert torch.equal(small.sample(logits[:4], pos[:4]), b[:4])
    k1_rows = [i for i, p in enumerate(params) if p.top_k == 1]
    assert set(a[k1_rows].tolist()) == {10, 11}  # top_k=1 with a tie keeps both tied tokens


def test_greedy_rows_take_argmax_with_lowest_index_ties():
    gen = torch.Generator().manual_seed(5)
    n = 12
    logits = torch.randn(n, V, generator=gen)
    logits[0, 5] = logits[0, 700] = 100.0  # tie -> 5
    logits[1, :] = 0.0  # all tied -> 0
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=i) if i % 2 == 0 or i < 2 else SamplingParams(temperature=1.0, seed=i) for i in range(n)]
    st = SamplingTensors.from_params(params)
    pos = torch.arange(n)
    out = st.sample(logits, pos)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert torch.equal(out[greedy], logits[greedy].argmax(-1))
    assert out[0].item() == 5 and out[1].item() == 0
    # all-greedy fast path
    gp = [SamplingParams(temperature=0.0) for _ in range(n)]
    gst = SamplingTensors.from_params(gp)
    assert gst.all_greedy
    assert torch.equal(gst.sample(logits, pos), logits.argmax(-1))
    assert torch.equal(sample(logits, gst.temperature, gst.top_k, gst.top_p, gst.seeds, pos), logits.argmax(-1))
    # low-precision logits
    assert torch.equal(gst.sample(logits.bfloat16(), pos), logits.bfloat16().argmax(-1))


def test_different_seeds_give_different_sequences_same_seed_reproduces():
    gen = torch.Generator().manual_seed(6)
    q = 64
    logits = torch.randn(q, V, generator=gen) * 0.3  # flat-ish
    seqs = []
    for seed in range(8):
        st = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=seed)]).repeat_interleave(q)
        seqs.append(st.sample(logits, torch.arange(q)))
    for a in range(8):
        assert torch.unique(seqs[a]).numel() > 50  # varies along positions
        for b in range(a + 1, 8):
            assert (seqs[a] != seqs[b]).sum().item() >= 56
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=3)]).repeat_interleave(q)
    assert torch.equal(st.sample(logits, torch.arange(q)), seqs[3])


def test_sampling_tensors_from_params():
    ps = [
        SamplingParams(temperature=0.0, top_k=7),
        SamplingParams(temperature=0.5, top_k=-1, top_p=0.9, seed=2**64 + 3),
        SamplingParams(temperature=1.0, top_k=40, seed=2**63 + 1),
    ]
    st = SamplingTensors.from_params(ps, device="cpu")
    assert len(st) == 3
    assert st.temperature.dtype == torch.float32 and st.top_p.dtype == torch.float32
    assert st.top_k.dtype == torch.int64 and st.seeds.dtype == torch.int64
    assert st.top_k.tolist() == [7, 0, 40]
    assert st.seeds.tolist()[1:] == [3, 1 - 2**63]
    assert st.seeds[0].item() == ps[0].resolved_seed
    assert (st.all_greedy, st.any_top_k, st.any_top_p, st.max_top_k) == (False, True, True, None)
    st2 = SamplingTensors.from_params(ps[2:])
    assert (st2.all_greedy, st2.any_top_k, st2.any_top_p, st2.max_top_k) == (False, True, False, 40)
    st3 = SamplingTensors.from_params(ps[:1])
    assert st3.all_greedy and not st3.any_top_k
    sel = st.select(torch.tensor([2, 2, 0]))
    assert sel.top_k.tolist() == [40, 40, 7]
    empty = SamplingTensors.from_params([])
    assert len(empty) == 0 and empty.sample(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_compute_logprobs():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 50, generator=gen).to(torch.bfloat16)
    toks = torch.tensor([0, 3, 49, 7, 7])
    lp, ids, tlp = compute_logprobs(logits, toks, 4)
    ref = torch.log_softmax(logits.float(), -1)
    assert lp.shape == (5,) and ids.shape == (5, 4) and tlp.shape == (5, 4)
    assert ids.dtype == torch.int64 and lp.dtype == torch.float32
    assert torch.allclose(lp, ref[torch.arange(5), toks])
    assert torch.allclose(ref.gather(1, ids), tlp)
    assert bool((tlp[:, :-1] >= tlp[:, 1:]).all())
    assert torch.allclose(tlp[:, 0], ref.max(-1).values)
    lp0, ids0, tlp0 = compute_logprobs(logits, toks, 0)
    assert ids0.shape == (5, 0) and tlp0.shape == (5, 0) and torch.allclose(lp0, lp)


def test_tied_logprobs_are_listed_in_ascending_id_order_as_argmax_picks():
    """A trial saw the greedy token listed second at an exact bf16 tie: ties now list the lower id
    first (greedy's choice), whatever order torch.topk returned them in."""
    logits = torch.full((3, 300), -5.0)
    logits[0, [250, 7, 198, 220]] = torch.tensor([2.0, 1.0, 3.0, 3.0])  # 198 / 220 tie at the top
    logits[1, [5, 90, 40, 2]] = 1.0  # a four-way tie
    logits[2, [17, 9]] = torch.tensor([0.5, 0.25])  # no tie: the order by probability stays
    toks = logits.argmax(-1)
    _, ids, tlp = compute_logprobs(logits.to(torch.bfloat16), toks, 4)
    assert ids[0].tolist() == [198, 220, 250, 7] and ids[0, 0] == toks[0]
    assert ids[1].tolist() == [2, 5, 40, 90] and ids[1, 0] == toks[1]
    assert ids[2, :2].tolist() == [17, 9]
    assert bool((tlp[:, :-1] >= tlp[:, 1:]).all())


def test_eager_row_chunking_gives_the_same_tokens(monkeypatch):
    import blockdraft.sample.sampler as sampler_mod

    logits, params, positions = _setup(n=45)
    ref = _sample_rows(logits, params, positions, hints=True)
    monkeypatch.setattr(sampler_mod, "_CHUNK_ELEMS", 7 * V)  # 7 rows per chunk, ragged last chunk
    assert torch.equal(_sample_rows(logits, params, positions, hints=True), ref)
    assert torch.equal(_sample_rows(logits, params, positions, hints=False), ref)


def test_warm_up_compiled_sampler_builds_each_graph_once(monkeypatch):
    """The start-up warm-up runs the compiled sampler on 1 and 2 rows, with and without a top-p
    threshold, once per (device, vocabulary size); later calls do nothing."""
    import blockdraft.sample.sampler as sampler_mod

    calls = []

    def fake_compiled():
        def run(x, thr, seeds, positions):
            calls.append((x.shape[0], thr is None))
            return sampler_mod._perturbed_argmax(x, thr, seeds, positions)

        return run

    monkeypatch.setattr(sampler_mod, "_get_compiled", fake_compiled)
    monkeypatch.setattr(sampler_mod, "_warmed_up", set())
    sampler_mod.warm_up_compiled_sampler(97, "cpu")
    assert sorted(calls) == [(1, False), (1, True), (2, False), (2, True)]
    sampler_mod.warm_up_compiled_sampler(97, "cpu")
    assert len(calls) == 4
    sampler_mod.warm_up_compiled_sampler(128, "cpu")  # another vocabulary: its own warm-up
    assert len(calls) == 8


def test_after_the_warm_up_a_runner_step_compiles_nothing(monkeypatch):
    """The runner samples under torch.inference_mode; graphs the warm-up built with grad enabled
    failed torch.compile's grad-mode guard and were rebuilt inside the first sampled step (seconds
    of compiling and ~25 host syncs in a served step: the sync-count flake of sessions 13-16).
    After the warm-up, greedy / sampled / top-p rows in any mix and any row count >= 1 run the
    warmed graphs (dynamo raises on a recompile). Dynamo's guards do not depend on the backend, so
    the graphs are built with the eager backend here (seconds instead of a minute of inductor)."""
    import torch._dynamo

    import blockdraft.sample.sampler as sampler_mod

    warmed = sampler_mod._warmed_up  # the process's: reset below drops the graphs it vouches for
    torch._dynamo.reset()
    compiled = torch.compile(sampler_mod._perturbed_argmax, dynamic=True, fullgraph=True, backend="eager")
    monkeypatch.setattr(sampler_mod, "_compiled_perturbed_argmax", compiled)
    monkeypatch.setattr(sampler_mod, "_warmed_up", set())
    sampler_mod.warm_up_compiled_sampler(V, "cpu")
    g = torch.Generator().manual_seed(3)
    batches = [
        [SamplingParams(temperature=0.7, top_p=0.9, seed=1)],
        [SamplingParams(temperature=0.8, seed=2)],
        [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, seed=1), SamplingParams(temperature=0.0)],
        [SamplingParams(temperature=1.0, seed=i) for i in range(5)],
        [SamplingParams(temperature=0.9, min_p=0.1, seed=3), SamplingParams(temperature=0.0)],  # min-p: a threshold too
    ]
    try:
        with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
            for params in batches:
                logits = torch.randn(len(params), V, generator=g)
                positions = torch.arange(len(params)) + 4
                st = SamplingTensors.from_params(params, "cpu")
                assert torch.equal(st.sample(logits, positions, compiled=True), st.sample(logits, positions))
    finally:
        torch._dynamo.reset()
        warmed.clear()  # so a later engine warms the real sampler up again instead of compiling in a step
