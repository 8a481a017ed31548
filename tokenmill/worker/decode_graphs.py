"""Pure decode steps replayed from CUDA graphs, one per padded batch size x padded block count.

On a GPU a small model's decode step is launch-bound: ~10 kernels a layer, each with its few
microseconds of Python and launch, for a few microseconds of work. A CUDA graph captures the
step's kernels once and replays them with one launch. A graph replays on the buffers and shapes
it was captured with, so a step is padded (layers/padded_decode_attention.py): its batch up to
the next of GRAPH_BATCH_SIZES, its block tables up to the next power of two of blocks. Each
(batch, blocks) shape is captured the first time a step needs it, into one memory pool that all
graphs share (they never run at once); steps with a prefill, or more sequences than the largest
size, run eagerly.

Without CUDA there is nothing to capture: EagerReplay runs the same step function on the same
buffers each time, which lets the CPU tests check everything around the capture (padding, the
scratch block, the buckets) against the eager path.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.layers.attention import AttentionContext, CacheGeometry
from tokenmill.layers.padded_decode_attention import (
    PaddedDecodeAttention,
    padded_decode_inputs,
    padded_decode_metadata,
)
from tokenmill.models.llama import DecoderForCausalLM
from tokenmill.worker.forward_input import ForwardInput

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def uses_decode_graphs(device: torch.device, enforce_eager: bool) -> bool:
    """Whether decode steps on this device replay CUDA graphs (the default on CUDA)."""
    return device.type == "cuda" and not enforce_eager


def padded_batch_size(num_sequences: int) -> int:
    return GRAPH_BATCH_SIZES[bisect.bisect_left(GRAPH_BATCH_SIZES, num_sequences)]


def padded_block_count(num_blocks: int) -> int:
    return 1 << (num_blocks - 1).bit_length()


class EagerReplay:
    """A step function run again at every replay (where no graph can be captured)."""

    def __init__(self, step: Callable[[], torch.Tensor]) -> None:
        self.step = step

    def __call__(self) -> torch.Tensor:
        return self.step()


class CudaGraphReplay:
    """A step function captured once into a CUDA graph; a replay reruns its kernels and returns
    the same output tensor, overwritten."""

    def __init__(self, step: Callable[[], torch.Tensor], pool: object) -> None:
        # one eager run first, on a side stream as capture wants: lazy set-up (cuBLAS handles and
        # workspaces, kernel selection) must not happen inside the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = step()

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


@dataclass
class CapturedStep:
    inputs: torch.Tensor  # [batch, 2 + blocks] on the device: what each replay reads
    replay: Callable[[], torch.Tensor]  # -> hidden states [batch, hidden]


class DecodeGraphs:
    """The model's forward for pure decode steps of at most GRAPH_BATCH_SIZES[-1] sequences, from
    captured graphs (EagerReplay off CUDA). `scratch_block` is a block of the KV cache that the
    block pool does not manage."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 geometry: CacheGeometry, scratch_block: int) -> None:
        self.model, self.kv_caches, self.geometry, self.scratch_block = model, kv_caches, geometry, scratch_block
        self.attention = PaddedDecodeAttention()
        self.pool = torch.cuda.graph_pool_handle() if geometry.device.type == "cuda" else None
        self.steps: dict[tuple[int, int], CapturedStep] = {}
        self.num_replays = 0

    @staticmethod
    def covers(batch: ForwardInput) -> bool:
        return batch.num_sequences <= GRAPH_BATCH_SIZES[-1] and all(len(ids) == 1 for ids in batch.token_ids)

    def forward(self, batch: ForwardInput) -> torch.Tensor:
        """Hidden states [num_sequences, hidden] of a step that covers() accepts (a view of the
        graph's output: read it before the next step)."""
        block_size = self.geometry.block_size
        positions = batch.num_computed_tokens
        size = padded_batch_size(batch.num_sequences)
        num_blocks = padded_block_count(max(positions) // block_size + 1)
        step = self.steps.get((size, num_blocks)) or self._capture(size, num_blocks)
        step.inputs.copy_(padded_decode_inputs([ids[0] for ids in batch.token_ids], positions, batch.block_tables,
                                               size, num_blocks, block_size, self.scratch_block))
        self.num_replays += 1
        return step.replay()[: batch.num_sequences]

    def _capture(self, size: int, num_blocks: int) -> CapturedStep:
        # all padding while capturing: the warm-up and capture runs write only the scratch block
        inputs = padded_decode_inputs([], [], [], size, num_blocks, self.geometry.block_size,
                                      self.scratch_block).to(self.geometry.device)

        def run() -> torch.Tensor:
            metadata = padded_decode_metadata(inputs, self.geometry)
            ctx = AttentionContext(backend=self.attention, metadata=metadata, kv_caches=self.kv_caches)
            return self.model(metadata.input_ids, metadata.positions, ctx)

        replay = EagerReplay(run) if self.pool is None else CudaGraphReplay(run, self.pool)
        step = self.steps[(size, num_blocks)] = CapturedStep(inputs, replay)
        return step
