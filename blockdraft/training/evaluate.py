"""`blockdraft eval-drafter`: acceptance of a drafter measured by our engine on eval prompts.

Runs `LLM(model, draft).generate` on HumanEval or MT-bench prompts (first turns) and reports the
engine's own counters (DFLASH.md "Terms": acceptance length tau = accepted drafts + 1 per verify
step; per-position acceptance rate i = steps with >= i accepted / steps with >= i drafted, so a
block cut short by --max-tokens does not count its undrafted positions as rejected), pooled over
all steps of all prompts. Optionally also decodes without the drafter to check the outputs are
identical (speculation is lossless) and to time the speedup, and draws the per-position plot.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from blockdraft.errors import param_error


@dataclass
class EvalResult:
    """Pooled engine counters for one (dataset, temperature) run."""

    dataset: str
    temperature: float
    num_prompts: int
    max_tokens: int
    num_steps: int
    num_accepted: int
    num_output_tokens: int
    seconds: float
    accepted_per_position: list[int] = field(default_factory=list)  # steps accepting draft i+1, i < K
    plain_seconds: float | None = None
    identical_to_plain: bool | None = None
    draft_vocab_size: int = 0  # draft LM-head columns (0: the full vocabulary)
    num_speculative_tokens: int | None = None  # K drafts per step
    device: str = "cpu"  # where the engines ran: "cpu" or "cuda"
    dtype: str = "float32"  # the target's (and drafter's) weights as run, --dtype auto resolved
    drafted_per_position: list[int] = field(default_factory=list)  # steps that drafted position i+1, i < K

    @property
    def acceptance_length(self) -> float | None:
        """Tokens committed per verify step; None without any verify step (every answer ended
        at its first token: JSON null, as generate --json writes it, never NaN)."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else None

    @property
    def per_position(self) -> list[float | None]:
        """Acceptance rate of each draft position 1..K: steps that accepted draft i / steps that
        drafted position i (not all steps: near --max-tokens a step drafts fewer than K). None
        (JSON null) for a position no step drafted (every position without any verify step)."""
        from blockdraft.engine.request import per_position_rates  # here: that module imports torch

        return per_position_rates(self.accepted_per_position, self.drafted_per_position)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(acceptance_length=self.acceptance_length, per_position=self.per_position)
        if self.plain_seconds:
            d["speedup"] = self.plain_seconds / self.seconds
        return d


def evaluate_drafter(
    target: str, draft: str, dataset: str = "humaneval", num_prompts: int = 10, temperature: float = 0.0,
    max_tokens: int = 256, seed: int = 0, compare_plain: bool = False, dtype: str = "float32", cache_dir=None,
    max_num_seqs: int = 16, draft_vocab_size: int | None = None, num_speculative_tokens: int | None = None,
    device: str = "cpu", gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
    async_scheduling: bool | None = None,
) -> EvalResult:
    """Generate with the drafter on the first `num_prompts` prompts of `dataset`; pool the counters.

    draft_vocab_size: the drafter's draft vocabulary (0: full; None: the folder's recorded size, else 0).
    num_speculative_tokens: K; None = the drafter's whole block (block_size - 1), as the DFlash paper
        reports acceptance, not the speed-tuned K of the folder's speculative.json.

    device: "cpu" | "cuda" | "auto" (CUDA when torch sees one), as `LLM` / `generate --device`;
        gpu_memory_utilization / enforce_eager / async_scheduling: the CUDA pool budget, no CUDA
        graphs and async scheduling (None: on with CUDA graphs), as `LLM`.

    With `compare_plain`, the same prompts are decoded without the drafter (same seeds) to check
    token-for-token equality and to time the speedup.
    Raises:
        ValueError / FileNotFoundError: a bad setting (num_prompts outside [1, prompts in `dataset`],
            sampling values, device, drafter folder, K, draft vocabulary size), before any weights load.
    """
    from blockdraft.engine_setup import resolve_async_scheduling
    from blockdraft.llm import LLM
    from blockdraft.model_loader import load_target
    from blockdraft.preflight import preflight
    from blockdraft.sampling_params import SamplingParams
    from blockdraft.training.corpora import EVAL_DATASET_SIZES, eval_prompts

    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise param_error("num_prompts", f"num_prompts must be an integer >= 1, got {num_prompts!r}")
    if dataset in EVAL_DATASET_SIZES:  # before any download or load; an unknown name: eval_prompts says
        _check_num_prompts(num_prompts, dataset, EVAL_DATASET_SIZES[dataset])
    SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)  # checks the values
    # Drafter folder and config against the target's config, dtype, scheduler: before any weights.
    pre = preflight(target, draft, num_speculative_tokens, dtype=dtype, device=device,
                    gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                    cache_dir=cache_dir, draft_vocab_size=draft_vocab_size)
    k = num_speculative_tokens if num_speculative_tokens is not None else pre.drafter_config.block_size - 1
    texts = eval_prompts(dataset, cache_dir)
    _check_num_prompts(num_prompts, dataset, len(texts))
    convs = [[{"role": "user", "content": t}] for t in texts[:num_prompts]]
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i) for i in range(len(convs))]
    resolve_async_scheduling(async_scheduling, pre.device, enforce_eager, None, None)  # before the weights load
    loaded = load_target(str(pre.target_path), dtype, pre.device, cache_dir=cache_dir)
    engine_options = dict(dtype=dtype, device=pre.device, gpu_memory_utilization=gpu_memory_utilization,
                          enforce_eager=enforce_eager, async_scheduling=async_scheduling, max_num_seqs=max_num_seqs)
    spec = LLM(target=loaded, draft=pre.draft, num_speculative_tokens=k, draft_vocab_size=pre.draft_vocab_size,
               **engine_options)
    t0 = time.perf_counter()
    outs = spec.generate(convs, params)
    seconds = time.perf_counter() - t0
    stats = spec.engine.stats.spec
    # one entry per draft position 1..K, also where --max-tokens cut every block short of K drafts
    accepted = list(stats.accepted_per_position) + [0] * max(0, k - len(stats.accepted_per_position))
    drafted = list(stats.drafted_per_position) + [0] * max(0, k - len(stats.drafted_per_position))
    result = EvalResult(dataset, temperature, len(convs), max_tokens, stats.num_steps, stats.num_accepted_tokens,
                        sum(len(o.token_ids) for o in outs), seconds, accepted,
                        draft_vocab_size=pre.draft_vocab_size, num_speculative_tokens=k, device=pre.device,
                        dtype=str(loaded.dtype).removeprefix("torch."), drafted_per_position=drafted)
    if compare_plain:
        # On CUDA each engine sizes its KV pool from the free memory: free the speculative one first.
        del spec
        _release_device_memory(pre.device)
        plain = LLM(target=loaded, **engine_options)
        t0 = time.perf_counter()
        ref = plain.generate(convs, params)
        result.plain_seconds = time.perf_counter() - t0
        result.identical_to_plain = all(a.token_ids == b.token_ids for a, b in zip(outs, ref))
    return result


def _check_num_prompts(num_prompts: int, dataset: str, available: int) -> None:
    """Raise ValueError naming the range [1, available] when num_prompts > available (never capped)."""
    if num_prompts > available:
        raise param_error("num_prompts", f"num_prompts must be in [1, {available}] for dataset {dataset!r} "
                                         f"({available} prompts), got {num_prompts}")


def _release_device_memory(device: str) -> None:
    """Return the memory of engines dropped so far to the device (CUDA; a no-op on the CPU)."""
    if device == "cuda":
        import gc

        import torch

        gc.collect()  # engine objects in reference cycles hold their KV pools until collected
        torch.cuda.empty_cache()


def speed_hint(r: EvalResult, draft: str | Path, whole_block: bool = True) -> str | None:
    """A note when the timed K is not the K decoding uses on this device (the drafter's
    speculative.json) and the run came out slower than plain: eval-drafter's default K (the whole
    block) measures acceptance, and on a CPU verifying 16 rows costs more than it saves.
    whole_block: K was left at that default (False: the user chose K)."""
    from blockdraft.spec.dflash.checkpoint import recommended_num_speculative_tokens

    if r.identical_to_plain is None or not r.seconds or r.plain_seconds / r.seconds >= 1.0:
        return None
    k = recommended_num_speculative_tokens(draft, r.device)
    if k is None or k == r.num_speculative_tokens:
        return None
    what = (f"K={r.num_speculative_tokens} (the whole block) measures acceptance" if whole_block
            else f"this run timed K={r.num_speculative_tokens}")
    batch = (f"; this run decoded its {r.num_prompts} prompts together (a batch), generate one request at a time: "
             f"--num-prompts 1 times that") if r.num_prompts > 1 else ""
    return (f"note: {what}; generate / demo / serve decode with K={k} on {r.device} for this drafter (its "
            f"speculative.json): add --num-speculative-tokens {k} to time that{batch}")


def summary_line(r: EvalResult, drafter: str | None = None) -> str:
    """One human-readable line of an evaluation (the JSON on stdout has every figure); `drafter`:
    what was evaluated, named at the end of the parenthesis ("shipped", or the folder given)."""
    tau = "n/a" if r.acceptance_length is None else f"{r.acceptance_length:.2f}"
    which = f", drafter {drafter}" if drafter else ""
    line = (f"{r.dataset} T={r.temperature:g}: acceptance length {tau} (K={r.num_speculative_tokens}, "
            f"draft vocabulary {r.draft_vocab_size or 'full'}, {r.num_steps} verify steps, {r.num_prompts} "
            f"prompt{'s' if r.num_prompts != 1 else ''}{which})")
    if r.identical_to_plain is not None:
        line += f" | identical to plain: {'yes' if r.identical_to_plain else 'NO'}"
        line += f" | speedup {r.plain_seconds / r.seconds:.2f}x (K={r.num_speculative_tokens}, this machine)"
    return line


def plot_per_position(results: dict[str, list[float | None]], path: str, title: str = "") -> None:
    """Per-position acceptance rate curves (one per label) as a PNG at `path`; a position
    without a rate (None: never drafted) is left out of its curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, rates in results.items():
        ys = [float("nan") if r is None else r for r in rates]  # NaN: matplotlib leaves a gap
        ax.plot(range(1, len(rates) + 1), ys, marker="o", label=label)
    longest = max((len(r) for r in results.values()), default=0)
    ax.set_xlim(0.5, max(longest, 1) + 0.5)  # every position 1..K, drafted or not
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # positions are whole numbers
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(>= i accepted | >= i drafted)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(textwrap.fill(title, 70), fontsize=9)  # long drafter paths would run off the figure
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    """CLI body of `blockdraft eval-drafter` (arguments from cli.py).

    Raises:
        ValueError: --plot empty, a folder, in a missing or unwritable folder, or not an image name
            matplotlib writes; --json empty, a folder, in a missing or unwritable folder, or the
            --plot file (all before any decoding); no drafter ships for --target with --draft
            shipped / auto / left out; and evaluate_drafter's.
    """
    from blockdraft.errors import check_writable_file
    from blockdraft.drafters import SHIPPED, resolve_draft

    if args.plot is not None and not args.plot.strip():  # `if args.plot` below would skip it: no plot, unsaid
        raise ValueError(f"--plot {args.plot!r} is empty: give the PNG file to write, e.g. 'acceptance.png', or "
                         f"leave --plot out")
    if args.plot:  # fail before minutes of decoding, not after
        check_writable_file(args.plot, "--plot", example="acceptance.png")
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if os.path.splitext(args.plot)[1].lstrip(".").lower() not in formats:
            raise ValueError(f"--plot {args.plot!r}: the file name must end in an image format matplotlib "
                             f"writes ({', '.join('.' + f for f in sorted(formats))}), e.g. 'acceptance.png'")
    if args.json is not None and not args.json.strip():
        raise ValueError(f"--json {args.json!r} is empty: give the file to write, e.g. 'eval.json', or leave --json out")
    if args.json:
        check_writable_file(args.json, "--json", example="eval.json")
        if args.plot and os.path.realpath(args.json) == os.path.realpath(args.plot):
            raise ValueError(f"--json {args.json!r} and --plot {args.plot!r} are the same file: the plot would "
                             f"overwrite the JSON; give each its own file, e.g. --json eval.json --plot acceptance.png")
    from blockdraft.preflight import read_target_config

    read_target_config(args.target, args.cache_dir)  # an unknown model is named as such, not as "no drafter"
    draft = args.draft or "shipped"
    named = "shipped" if draft in ("shipped", "auto") else draft  # the summary line's name for it
    if draft in ("shipped", "auto"):  # the folder itself, so the JSON names what was evaluated
        # as generate's --draft shipped: a catalog name or the folder `fetch` made for one
        draft = resolve_draft(SHIPPED, args.target, cache_dir=args.cache_dir)
    result = evaluate_drafter(args.target, str(draft), args.dataset, args.num_prompts, args.temperature,
                              args.max_tokens, args.seed, args.compare_plain, args.dtype, args.cache_dir,
                              draft_vocab_size=args.draft_vocab_size, num_speculative_tokens=args.num_speculative_tokens,
                              device=args.device, gpu_memory_utilization=args.gpu_memory_utilization,
                              enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling)
    out = result.to_dict() | {"target": args.target, "draft": str(draft)}
    text = json.dumps(out, indent=1, allow_nan=False)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(summary_line(result, named), file=sys.stderr)
    hint = speed_hint(result, draft, whole_block=args.num_speculative_tokens is None)
    if hint:
        print(hint, file=sys.stderr)
    if args.plot:
        tau = "n/a" if result.acceptance_length is None else f"{result.acceptance_length:.2f}"
        label = f"{args.dataset} T={args.temperature:g} (tau {tau})"
        # the shipped one by that name (its folder is a cache path); a train-drafter run's folder is OUT/drafter: name OUT too
        shown = named if named == "shipped" else "/".join(Path(draft).parts[-2:])
        plot_per_position({label: result.per_position}, args.plot, f"{args.target} + drafter {shown}")
    return 0
