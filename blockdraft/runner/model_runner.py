"""Owns the tensors: KV caches, the target model, the speculator. One step = prepare -> target
forward -> sample + verify -> propose -> one read-back (DFLASH.md, "One decode step").
`launch` enqueues a step and `finish` reads it back; between the two, `launch_continuation` can
enqueue the next uniform step from the first one's device output, and `launch_join` the uniform
step that a prefill's requests join (async scheduling).

GPU path (a backend without host metadata): nothing in a step reads device values back to the
host except the final `fetch_step_output` (and log-probabilities, when asked for). Uniform decode /
verify steps replay two CUDA graphs (runner.step_graphs: the target, then the tail that verifies,
drafts and packs), with the sampler between them only when a row samples; so do prefill steps of
up to 8 requests and 1,024 rows (runner.prefill_graphs); everything else runs eagerly, including
every step that scores prompt rows for SamplingParams.prompt_logprobs (runner.prompt_logprobs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from blockdraft.attention.backends import AttentionBackendSpec, select_attention_backend
from blockdraft.engine.outputs import PLACEHOLDER_TOKEN, ModelRunnerOutput, SchedulerOutput
from blockdraft.host_tensor import host_tensor
from blockdraft.layers.fused_ops import argmax as fused_argmax
from blockdraft.layers.fused_ops import set_batch_invariant
from blockdraft.runner.continuation import advanced_rows
from blockdraft.runner.input_batch import BatchPadding, InputBatch, build_input_batch, stage_block_table
from blockdraft.runner.prompt_logprobs import PromptLogprobs, plan_prompt_logprobs
from blockdraft.runner.staging import PendingFetch, stage_to_device, start_fetch
from blockdraft.runner.step_graphs import StepGraphs
from blockdraft.runner.step_output import add_logprobs, fetch_step_output, pack_step
from blockdraft.runner.step_timer import StepTimer
from blockdraft.spec.dflash.prepare_inputs import draft_input_preparer
from blockdraft.spec.verify import verify_drafts


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued; `ModelRunner.finish` reads it back.

    packed: [S, kmax + 2 + K] int64 on the device (runner.step_output.pack_step); graphed steps:
    the tail graph's static output [R_b, Q + 1 + K] of the whole bucket (rows past S are padding).
    fetch: the copy of its first S rows to the host, started at launch (runner.staging.start_fetch).
    logits: its [L, V] logits rows. graphed: the step replayed the uniform-step graphs (a
    continuation can follow it). prefill_graphed: it replayed the prefill graphs instead.

    Steps that replayed graphs (uniform steps, and prefills of a few requests although graphed is
    False) hold static graph outputs in `packed` and `logits`, and a continuation's `batch` holds
    views of the static inputs: all shared with every other graph of the engine (one memory pool),
    so valid until the next replay of any graph. The engine reads them before that (a
    continuation's advance reads its predecessor's `packed` in stream order). A prefill step
    launched ahead of reading a uniform step back (async scheduling, no mixed prefill) replays
    other graphs first: `finish` then reads only the host copy, whose fetch was queued before
    them, and no logits (`can_continue` excludes log-probabilities).
    prompt_logprobs: the prompt rows an eager step scored (runner.prompt_logprobs), or None.
    """

    so: SchedulerOutput
    batch: InputBatch
    packed: torch.Tensor
    fetch: PendingFetch
    logits: torch.Tensor
    timer: StepTimer
    graphed: bool
    prefill_graphed: bool = False
    prompt_logprobs: PromptLogprobs | None = None


class ModelRunner:
    """Runs one engine step on `device`.

    Args:
        model: a blockdraft CausalLM (forward / compute_logits / embed).
        kv_caches: per target layer (k_cache, v_cache), [num_kv_blocks, kv_block_size, kv_heads, head_dim].
        kv_block_size: tokens per KV page.
        speculator: None for plain decoding, else a Speculator (blockdraft.spec.base):
            `num_speculative_tokens`, `aux_layer_ids` and `propose(features, positions,
            slot_mapping, bonus_tokens, bonus_positions, block_table)`; `mask_token_id` if it has one.
        attention_backend: the backend the models run with (decides whether the metadata carries
            host lists); default: the device's (blockdraft.attention.backends).
        graphs: uniform-step and prefill graphs (runner.step_graphs.build_step_graphs), or None (all eager).
        compiled_sampling: sample non-greedy rows with the torch.compile'd fused noise + argmax
            (blockdraft.sample.sample, compiled=True: same tokens, ~12x faster at 1024 rows x 152K
            vocabulary on an H200); built at start-up by build_runner (warm_up_compiled_sampler).
        disable_by_batch_size: N (requests) or None; an eager step that samples N or more requests
            proposes no drafts (vLLM's disable_by_batch_size): the speculator only writes the
            step's context (`write_context`), and the next step decodes them plainly. Graphed
            steps always draft (their tail graph does): set it only without graphs.
        fp32_head: eager steps take float32 logits from the LM head (CausalLM.compute_logits
            fp32_head; the graphs were built with the same setting).
        batch_invariant: the target runs its batch-invariant kernels (set on the model by
            build_runner before the graphs were captured); each step re-applies the setting, since
            another engine on the same loaded target may have changed it.
    Raises:
        ValueError: disable_by_batch_size with graphs, or with a speculator that has no write_context;
            graphs built with another fp32_head (graphed and eager steps would round logits differently).
    """

    def __init__(
        self,
        model,
        kv_caches,
        kv_block_size: int,
        device="cpu",
        speculator=None,
        attention_backend: AttentionBackendSpec | None = None,
        graphs: StepGraphs | None = None,
        compiled_sampling: bool = False,
        disable_by_batch_size: int | None = None,
        fp32_head: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        if disable_by_batch_size is not None and (graphs is not None or not hasattr(speculator, "write_context")):
            raise ValueError(f"disable_by_batch_size={disable_by_batch_size!r} needs eager steps (no graphs) and a "
                             f"speculator with write_context (DFlashSpeculator)")
        if graphs is not None and any(g is not None and g.fp32_head != fp32_head for g in (graphs.target, graphs.prefill)):
            raise ValueError(f"the step graphs were built with another fp32_head than this runner's ({fp32_head}): build "
                             f"them with the same setting (build_step_graphs fp32_head)")
        self.disable_by_batch_size = disable_by_batch_size
        self.fp32_head = fp32_head
        self.batch_invariant = batch_invariant
        self.model = model
        self.compiled_sampling = compiled_sampling
        self.kv_caches = kv_caches
        self.kv_block_size = kv_block_size
        self.device = torch.device(device)
        self.speculator = speculator
        self.aux_layer_ids = tuple(speculator.aux_layer_ids) if speculator is not None else ()
        self.attention_backend = attention_backend or select_attention_backend(self.device)
        self.graphs = graphs
        self._prepare_draft_inputs = draft_input_preparer(self.attention_backend.name)

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        """Compute the scheduled rows, sample, verify drafts and propose the next drafts: enqueue
        the device work (on CUDA nothing waits for the GPU); `finish` reads it back.

        A step that scores prompt rows (SamplingParams.prompt_logprobs) runs eagerly, unpadded: the
        graphs compute the LM head of the sampled rows only. Such a step is never `graphed`, so
        no continuation follows it; a join may (its prompt log-probabilities are tensors of its own)."""
        timer = StepTimer(self.device)
        prompt = plan_prompt_logprobs(so, self.device)
        if prompt is not None:
            batch = build_input_batch(so, self.kv_block_size, self.device, self.attention_backend.host_metadata)
            return self._enqueue(so, batch, timer, graphed=False, prompt=prompt)
        padding = self.graphs.target.padding_for(so) if self.graphs is not None else None
        host_metadata = self.attention_backend.host_metadata
        prefill = self.graphs.prefill if self.graphs is not None and padding is None else None
        prefill_padding = prefill.padding_for(so) if prefill is not None else None
        if prefill_padding is not None:
            batch = build_input_batch(so, self.kv_block_size, self.device, host_metadata, prefill_padding)
            return self._enqueue_prefill(so, batch, timer)
        batch = build_input_batch(so, self.kv_block_size, self.device, host_metadata, padding)
        return self._enqueue(so, batch, timer, graphed=padding is not None)

    @property
    def graphs_captured(self) -> bool:
        """Whether uniform steps replay captured CUDA graphs (False: no graphs, or their padded code
        runs eagerly, graph_mode="eager")."""
        return self.graphs is not None and self.graphs.target.capture

    def can_continue(self, step: LaunchedStep) -> bool:
        """Whether `launch_continuation` can follow `step`: a graphed uniform step without
        log-probabilities (their logits live in the graph's output buffer, which the next replay
        overwrites before `finish` reads them), penalties, a logit bias, a grammar, bad words of
        several tokens or min_tokens not yet reached (`_continuable`). False without continuation graphs (async scheduling off)."""
        if not step.graphed or self.graphs.continuation is None:
            return False
        return all(_continuable(sr) for sr in step.so.requests)

    @torch.inference_mode()
    def launch_continuation(self, prev: LaunchedStep, so: SchedulerOutput) -> LaunchedStep | None:
        """Enqueue the step after `prev` before `prev` has been read back (async scheduling).

        Args:
            prev: a launched step with `can_continue(prev)`, the last one enqueued.
            so: `prev`'s requests, or the ones still running in the same order (the others
                stopped), each with Q placeholder tokens and K drafts
                (Scheduler.schedule_continuation); its block_ids cover 2Q tokens past prev's start.
        The same requests advance the graphs' static inputs in place (runner.continuation, one
        replay); a subset is laid out on the host as any step and its rows gathered from `prev`'s
        device output (`advanced_rows`, a few eager launches).
        Returns:
            The launched step, or None when `so` does not continue `prev` (a request not in `prev`,
            or a step that no graph bucket fits); nothing is enqueued then.
        """
        prev_index = {sr.request_id: i for i, sr in enumerate(prev.so.requests)}
        src = [prev_index.get(sr.request_id, -1) for sr in so.requests]
        if not self.can_continue(prev) or not so.requests or -1 in src:
            return None
        padding = self.graphs.target.padding_for(so)
        if padding is None:
            return None
        timer = StepTimer(self.device)
        inputs, q = self.graphs.target.inputs, self.graphs.target.rows_per_req
        if src != list(range(len(prev.so.requests))):
            # the host lays out this batch with placeholder positions: only device metadata is fixed up
            if self.attention_backend.host_metadata:
                return None
            return self._launch_subset(prev, so, src, padding, timer)
        if padding.num_reqs != prev.batch.meta.num_reqs:
            return None
        # pages are only ever appended to a running request: equal counts mean equal tables
        if any(len(a.block_ids) != len(b.block_ids) for a, b in zip(so.requests, prev.so.requests)):
            inputs.write_block_table(stage_block_table(so, padding, self.device))
        self.graphs.continuation.run(padding.num_reqs, prev.packed)
        rows = padding.num_reqs * q
        batch = dataclasses.replace(
            prev.batch, input_ids=inputs.input_ids[:rows], positions=inputs.positions[:rows],
            slot_mapping=inputs.slot_mapping[:rows], meta=inputs.metadata(padding.num_reqs, q, self.kv_block_size),
        )  # fmt: skip
        return self._enqueue(so, batch, timer, graphed=True, loaded=True)

    def _launch_subset(self, prev: LaunchedStep, so: SchedulerOutput, src: list[int], padding: BatchPadding,
                       timer: StepTimer) -> LaunchedStep:
        """The continuation of the requests of `prev` at indices `src` (the others stopped): the
        layout, block table and sampling tensors built on the host (placeholder tokens), then the
        rows' tokens, positions, slots and lengths gathered from `prev`'s output on the device
        before the graphs' static inputs are loaded from the batch."""
        q = self.graphs.target.rows_per_req
        batch = build_input_batch(so, self.kv_block_size, self.device, self.attention_backend.host_metadata, padding)
        src_req = stage_to_device({"src": host_tensor(src, torch.long)}, self.device)["src"]
        ids, pos, slots, seq_lens = advanced_rows(
            self.graphs.target.inputs, prev.packed, src_req, q, batch.meta.block_table, self.kv_block_size)
        rows = len(src) * q
        batch.input_ids[:rows].copy_(ids)
        batch.positions[:rows].copy_(pos)
        batch.slot_mapping[:rows].copy_(slots)
        batch.meta.seq_lens[: len(src)].copy_(seq_lens)
        return self._enqueue(so, batch, timer, graphed=True)

    @property
    def num_speculative_tokens(self) -> int:
        """K: drafts a uniform step verifies per request (0 for plain decoding)."""
        return self.speculator.num_speculative_tokens if self.speculator is not None else 0

    def can_join(self, step: LaunchedStep) -> bool:
        """Whether `launch_join` can follow `step`: uniform-step graphs with async scheduling
        (continuation graphs built), every request of `step` samples one token without drafts to
        verify, and none asks for log-probabilities (the join's replay would overwrite the logits
        before `finish` reads them), has penalties, a logit bias, a grammar, bad words of several
        tokens or min_tokens not yet reached (`_continuable`)."""
        if self.graphs is None or self.graphs.continuation is None or step.batch.kmax:
            return False
        if len(step.batch.sample_req) != len(step.so.requests):
            return False
        return all(_continuable(sr) for sr in step.so.requests)

    @torch.inference_mode()
    def launch_join(self, prev: LaunchedStep, so: SchedulerOutput) -> LaunchedStep | None:
        """Enqueue a uniform step in which `prev`'s requests join the others, before `prev` has
        been read back (async scheduling; e.g. the newcomers of a prefill step launched ahead).

        Args:
            prev: a launched step with `can_join(prev)`, the last one enqueued (its packed output is
                read in stream order before this step's graphs replay).
            so: Scheduler.schedule_join(prev.so, ...): Q rows per request; the rows of `prev`'s
                requests hold PLACEHOLDER_TOKEN, replaced on the device by the token `prev` samples
                and the K drafts it proposes (packed columns 0 and 2..K+1); everything else is built
                on the host as for any step.
        Returns:
            The launched step (graphed, so a continuation can follow it), or None when `so` fits no
            graph bucket or does not match `prev`; nothing is enqueued then.
        """
        padding = self.graphs.target.padding_for(so) if self.can_join(prev) else None
        k = self.num_speculative_tokens
        if padding is None or prev.packed.shape[1] != 2 + k:
            return None
        sample_index = {prev.so.requests[i].request_id: s for s, i in enumerate(prev.batch.sample_req)}
        q, width = k + 1, prev.packed.shape[1]
        dst, src = [], []
        for i, sr in enumerate(so.requests):
            if sr.token_ids[0] != PLACEHOLDER_TOKEN:
                continue
            s = sample_index.get(sr.request_id)
            if s is None:
                return None
            dst += range(i * q, (i + 1) * q)
            src += [s * width] + [s * width + 2 + j for j in range(k)]  # the sampled token, then the drafts
        timer = StepTimer(self.device)
        batch = build_input_batch(so, self.kv_block_size, self.device, self.attention_backend.host_metadata, padding)
        index = stage_to_device({"dst": host_tensor(dst, torch.long), "src": host_tensor(src, torch.long)}, self.device)
        batch.input_ids.index_copy_(0, index["dst"], prev.packed.reshape(-1).index_select(0, index["src"]))
        return self._enqueue(so, batch, timer, graphed=True)

    @torch.inference_mode()
    def finish(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step (its one host synchronisation) and split its output per request."""
        out = fetch_step_output(step.so, step.batch, step.fetch)
        add_logprobs(step.so, step.batch, step.logits, out)
        if step.prompt_logprobs is not None:
            out.prompt_logprobs = step.prompt_logprobs.read()
        out.forward_time_s, out.draft_time_s = step.timer.seconds()
        return out

    def _bind_attention(self) -> None:
        """Point the target's and the drafter's attention at this runner's backend, and the
        target's kernels at this runner's batch-invariant setting. Engines may share one loaded
        target (LLM(target=...)), and each sets the layers up for itself when it is built: an
        earlier engine would otherwise run the later one's backend (and read metadata it does not
        build) or kernels. Attribute checks only when nothing changed."""
        if getattr(self.model, "batch_invariant", False) != self.batch_invariant:
            set_batch_invariant(self.model, self.batch_invariant)
        spec = self.attention_backend
        if getattr(self.model, "attention_backend", spec.attention) is not spec.attention:
            self.model.set_attention_backend(spec.attention)
        drafter = getattr(self.speculator, "drafter", None)
        if drafter is not None and getattr(drafter, "attention_backend", spec) is not spec:
            drafter.set_attention_backend(spec)

    def _enqueue(
        self, so: SchedulerOutput, batch: InputBatch, timer: StepTimer, graphed: bool, loaded: bool = False,
        prompt: PromptLogprobs | None = None,
    ) -> LaunchedStep:
        """Enqueue a laid-out step (`prompt`: prompt rows to score, eager steps only)."""
        self._bind_attention()
        if graphed:
            logits, packed = self._replay(batch, timer, loaded)
            fetch = start_fetch(packed[: len(batch.sample_req)])
            return LaunchedStep(so, batch, packed, fetch, logits, timer, graphed)
        logits, aux = self._forward(batch, prompt)
        tokens = _sample(batch, logits, self.compiled_sampling)
        target, drafts = _per_request(batch, tokens)
        num_accepted = verify_drafts(target, drafts, batch.sample_num_drafts)
        timer.mark()
        next_drafts = None
        if self.speculator is not None:
            next_drafts = self._propose(batch, aux, target, num_accepted)
        timer.mark()
        packed = pack_step(target, num_accepted, next_drafts)
        return LaunchedStep(so, batch, packed, start_fetch(packed), logits, timer, graphed, prompt_logprobs=prompt)

    def _replay(self, batch: InputBatch, timer: StepTimer, loaded: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A padded uniform step: the target graph, the sampler only when a row samples, the tail
        graph (verify + draft + pack) -> (logits [L, V], packed [R_b, Q + 1 + K]), both static outputs.

        loaded: the static inputs already hold `batch` (a continuation). Timer phases: target
        forward + sampling, then the tail (see `_timed_tail`).
        """
        logits, aux = self.graphs.target.run(batch, load=not loaded)
        logits = logits[: batch.num_rows]  # uniform: logits_indices = every real row, in order
        sampled = None if batch.sampling.argmax_only else _sample(batch, logits, self.compiled_sampling)
        packed = self._timed_tail(timer, lambda: self.graphs.tail.run(batch.meta.num_reqs, aux, sampled))
        return logits, packed

    def _enqueue_prefill(self, so: SchedulerOutput, batch: InputBatch, timer: StepTimer) -> LaunchedStep:
        """A padded prefill step of a few requests: its target graph, the sampler only when a row
        samples, its tail graph (runner.prefill_graphs). Not continuable (graphed=False)."""
        self._bind_attention()  # graph mode "eager" runs the models here
        prefill = self.graphs.prefill
        logits, aux = prefill.run(batch)
        logits = logits[: len(batch.sample_req)]  # the real requests' rows (every request samples)
        sampled = None if batch.sampling.argmax_only else _sample(batch, logits, self.compiled_sampling)
        tail = lambda: prefill.run_tail(batch.meta.num_reqs, batch.input_ids.shape[0], aux, sampled)  # noqa: E731
        packed = self._timed_tail(timer, tail)
        return LaunchedStep(so, batch, packed, start_fetch(packed[: len(batch.sample_req)]), logits, timer,
                            graphed=False, prefill_graphed=True)

    def _timed_tail(self, timer: StepTimer, run_tail):
        """Run a tail graph as the step's second timer phase (drafting; its verification is fused
        in) with a drafter; without one the tail (argmax + pack) ends the forward phase and the
        draft phase is empty, as on eager steps."""
        if self.speculator is not None:
            timer.mark()
        packed = run_tail()
        timer.mark()
        if self.speculator is None:
            timer.mark()
        return packed

    def _forward(self, batch: InputBatch, prompt: PromptLogprobs | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Eager target forward + LM head -> (logits [L, V] in logits_indices order, in the head's
        dtype (float32 with fp32_head), aux features [T, n*H] | None). No float32 copy of bf16
        logits, as on the graphed path: sampling and logprobs upcast what they read, and greedy
        argmax of bf16 logits equals that of their exact float32 cast (the copy of a verify step's
        [L, 152K] logits is pure overhead).
        `prompt`: also score these prompt rows (PromptLogprobs.compute, from the same hidden states)."""
        hidden, aux = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.aux_layer_ids)
        if prompt is not None:
            prompt.compute(self.model, hidden, self.fp32_head)
        return self.model.compute_logits(hidden[batch.logits_indices], upcast=False, fp32_head=self.fp32_head), aux

    def _propose(self, batch: InputBatch, aux, target, num_accepted) -> torch.Tensor | None:
        """Eager drafter step: write the drafter's context for committed rows, then draft for every
        sampling request -> [S, K]; None (no drafts) when the step samples `disable_by_batch_size`
        requests or more: the context is still written, so drafting can resume at any later step."""
        spec = self.speculator
        prepared = self._prepare_draft_inputs(
            batch.logits_rows, batch.logits_indices, num_accepted, target, batch.positions, batch.slot_mapping,
            getattr(spec, "mask_token_id", 0),
        )  # fmt: skip
        slots, bonus, bonus_positions = prepared.context_slot_mapping, prepared.bonus_tokens, prepared.bonus_positions
        if self.disable_by_batch_size is not None and target.shape[0] >= self.disable_by_batch_size:
            spec.write_context(aux, batch.positions, slots)
            return None
        block_table = batch.meta.block_table.index_select(0, batch.sample_req_index)
        return spec.propose(aux, batch.positions, slots, bonus, bonus_positions, block_table)


def _continuable(sr) -> bool:
    """Whether a request (its ScheduledRequest `sr` in the step launched last) may take part in a
    step launched before that one is read back: not when it asks for log-probabilities (its logits
    must be read first) or has penalties or a logit bias (their entries are laid out per step from
    its output tokens, which the host does not have yet) or a structured-output grammar or bad
    words of several tokens (their masks follow the committed tokens; allowed_token_ids and
    one-token bad words give the same mask every step, so they do not stop it); with min_tokens
    only once its output has that many tokens (min_tokens masks nothing after that)."""
    params = sr.sampling_params
    if params.logprobs is not None or params.has_penalties or params.logit_bias or sr.grammar is not None:
        return False
    if sr.token_mask is not None and sr.token_mask.reads_output:
        return False
    output = sr.logits_context[1] if sr.logits_context is not None else None
    return not params.min_tokens or (output is not None and len(output) >= params.min_tokens)


def _sample(batch: InputBatch, logits: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """[L] int64 token per logits row. Called right after the target forward is enqueued: the
    grammar masks are computed here (InputBatch.grammar_masks), overlapping that forward on CUDA."""
    if batch.grammar_masks is not None:
        batch.grammar_masks.fill()
    if batch.sampling.argmax_only:  # what sample() returns for all-greedy rows, without the key positions
        return fused_argmax(logits, fused=False)  # torch.argmax (on the CPU over float32: faster, same ids)
    # the token sampled from row r sits at position r + 1: that position keys its noise
    return batch.sampling.sample(logits, batch.positions[batch.logits_indices] + 1, compiled=compiled)


def _per_request(batch: InputBatch, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target tokens [S, kmax+1] and drafts [S, kmax] (the input tokens of draft rows)."""
    rows = batch.logits_rows
    target = torch.where(rows >= 0, tokens[rows.clamp(min=0)], -1)
    row_ids = batch.logits_indices[rows.clamp(min=0)]
    drafts = torch.where(rows >= 0, batch.input_ids[row_ids], -2)[:, 1:]
    return target, drafts
