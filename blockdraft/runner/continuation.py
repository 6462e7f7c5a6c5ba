"""The inputs of the next uniform step, written on the device from this step's output.

Async scheduling (vLLM's `--async-scheduling`) launches step N+1 before step N's tokens reach the
host. For a uniform decode / verify step (every request verifies Q = K + 1 rows; runner.cuda_graphs)
whose requests all continue, everything step N+1 needs is on the device already:

  bonus[s]   = target[s, accepted[s]]            (the token the target emitted after the last accepted draft)
  start[s]   = positions[s*Q] + accepted[s] + 1  (the bonus token's position)
  input_ids  = [bonus[s], drafts[s, 0..K-1]]      at positions start[s] + 0..K
  slots      = block_table[s, p // page] * page + p % page
  seq_lens   = start[s] + Q

Step N's inputs are still in the target graphs' static buffers and its packed output in the tail
graph's (runner.step_tail), so the advance rewrites the static buffers in place: the rows of real
requests (row_req >= 0) get the values above, padding rows and requests keep their inert values.
The host only supplies the block table when it allocated pages. It runs as one CUDA graph per
bucket (it would otherwise be ~15 eager launches per step on the host's critical path).

When some requests of step N have stopped (seen when step N-1 was read back), step N+1 carries
only the others: the host lays out that smaller batch as any step, with placeholder tokens, and
`advanced_rows` gathers the same values for the remaining requests from step N's output (a few
eager launches, once per stop, instead of waiting for step N to read it back and restart).
"""

from __future__ import annotations

import torch

from blockdraft.runner.cuda_graphs import StaticInputs
from blockdraft.runner.static_graph import StaticGraph


def advance_static_inputs(inputs: StaticInputs, packed: torch.Tensor, num_reqs: int, q: int, kv_block_size: int) -> None:
    """Step N+1's inputs from step N's, in place in `inputs` (no host sync, fixed shapes).

    Args:
        inputs: the static buffers holding step N's padded uniform batch of `num_reqs` requests
            (bucket R_b) x Q rows, with step N+1's block table already in block_table[:R_b].
        packed: [R_b, 2Q] int64, step N's output (runner.step_output.pack_step): target tokens
            [R_b, Q], accepted counts [R_b], next drafts [R_b, K] with K = Q - 1 (K = 0 for plain
            decoding); rows of padding requests are ignored.
        num_reqs: the bucket R_b. q: Q. kv_block_size: tokens per page.
    Writes input_ids / positions / slot_mapping [:R_b*Q] and seq_lens [:R_b]; row_req,
    query_start_loc and block_table are unchanged (same requests, same layout).
    Raises:
        ValueError: `packed` has another shape.
    """
    if packed.shape != (num_reqs, 2 * q):
        raise ValueError(f"packed output has shape {tuple(packed.shape)}, expected {(num_reqs, 2 * q)}")
    rows = num_reqs * q
    ids_now = inputs.input_ids[:rows].view(num_reqs, q)
    pos_now = inputs.positions[:rows].view(num_reqs, q)
    slots_now = inputs.slot_mapping[:rows].view(num_reqs, q)
    real = inputs.row_req[:rows].view(num_reqs, q) >= 0
    accepted = packed[:, q : q + 1]
    ids = torch.cat([packed[:, :q].gather(1, accepted), packed[:, q + 1 :]], dim=1)
    start = pos_now[:, :1] + accepted + 1
    pos = start + torch.arange(q, device=packed.device)
    table = inputs.block_table[:num_reqs]
    # padding requests hold junk counts: index page 0 for them (their result is discarded); real
    # requests index their own pages, which the host allocated for the longest outcome
    page_index = torch.where(real, torch.div(pos, kv_block_size, rounding_mode="floor"), 0)
    slots = table.gather(1, page_index).to(torch.long) * kv_block_size + pos % kv_block_size
    seq_lens = inputs.seq_lens[:num_reqs]
    new_seq_lens = torch.where(real[:, 0], (start[:, 0] + q).to(seq_lens.dtype), seq_lens)
    ids_now.copy_(torch.where(real, ids, ids_now))
    slots_now.copy_(torch.where(real, slots, slots_now))
    pos_now.copy_(torch.where(real, pos, pos_now))
    seq_lens.copy_(new_seq_lens)


def advanced_rows(inputs: StaticInputs, packed: torch.Tensor, src_req: torch.Tensor, q: int,
                  block_table: torch.Tensor, kv_block_size: int) -> tuple[torch.Tensor, ...]:
    """The rows of step N+1 for a subset of step N's requests (the ones still running), on the
    device: the same arithmetic as `advance_static_inputs` (module docstring), gathered by request.

    Args:
        inputs: the static buffers holding step N's padded uniform batch (read, not written).
        packed: [R_b, 2Q] int64, step N's output (runner.step_output.pack_step).
        src_req: [R'] int64, step N's request index of each request of step N+1, in order.
        q: Q rows per request. block_table: [>= R', M] int32, step N+1's page table (its first R'
            rows belong to these requests, the pages allocated for the longest outcome).
        kv_block_size: tokens per page.
    Returns:
        (input_ids, positions, slot_mapping) [R' * Q] int64 and seq_lens [R'] int32 of the R'
        requests' rows, in step N+1's order.
    """
    num_reqs = src_req.shape[0]
    pos_now = inputs.positions[: packed.shape[0] * q].view(-1, q).index_select(0, src_req)
    rows = packed.index_select(0, src_req)
    accepted = rows[:, q : q + 1]
    ids = torch.cat([rows[:, :q].gather(1, accepted), rows[:, q + 1 :]], dim=1)
    start = pos_now[:, :1] + accepted + 1
    pos = start + torch.arange(q, device=packed.device)
    pages = block_table[:num_reqs].gather(1, torch.div(pos, kv_block_size, rounding_mode="floor"))
    slots = pages.to(torch.long) * kv_block_size + pos % kv_block_size
    return ids.reshape(-1), pos.reshape(-1), slots.reshape(-1), (start[:, 0] + q).to(torch.int32)


class ContinuationGraphs:
    """`advance_static_inputs` per bucket, captured after the bucket's tail graph (whose static
    output it reads) or run eagerly on the same buffers.

    Args:
        inputs: the target graphs' static inputs. q: rows per request. kv_block_size: tokens per page.
        capture / pool: as TargetGraphs.
    """

    def __init__(self, inputs: StaticInputs, q: int, kv_block_size: int, capture: bool, pool=None) -> None:
        self.inputs, self.q, self.kv_block_size = inputs, q, kv_block_size
        self.capture, self.pool = capture, pool
        self.graphs: dict[int, StaticGraph] = {}

    def capture_bucket(self, num_reqs: int, packed: torch.Tensor | None) -> None:
        """Build the advance of one bucket; `packed` is the bucket's captured tail output (capture mode)."""
        inputs = (packed,) if self.capture else ()
        self.graphs[num_reqs] = StaticGraph(
            lambda p: advance_static_inputs(self.inputs, p, num_reqs, self.q, self.kv_block_size),
            inputs=inputs, capture=self.capture, pool=self.pool,
        )  # fmt: skip

    def run(self, num_reqs: int, packed: torch.Tensor) -> None:
        """Advance the static inputs of bucket `num_reqs` past the step whose packed output
        ([R_b, 2Q], the tail's output for this bucket) is `packed`.

        Raises:
            ValueError: a captured graph given another tensor than the tail output it was captured with.
        """
        self.graphs[num_reqs](packed)
