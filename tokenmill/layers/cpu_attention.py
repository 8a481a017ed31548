"""Decode attention on x86 CPUs through our C++ kernel (csrc/paged_decode.cpp).

The pure-PyTorch decode gathers every sequence's keys into a contiguous copy before its batched
matmul: on the default model at batch 64 that copy and the value bags cost ~45 ms of a ~120 ms
step on 2 cores. The kernel reads keys and values in place through the block table, once each,
with no horizontal sums (keys are stored by column): ~20 ms. Prefill chunks keep PyTorch's SDPA.

The kernel is compiled on first use with the machine's compiler (~10 s, cached by
torch.utils.cpp_extension under ~/.cache/torch_extensions). It needs AVX-512; where it cannot
be built, or with TOKENMILL_CPU_KERNELS=0, decode falls back to the PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

from tokenmill.layers.attention import AttentionBackend, AttentionBucket, TorchPagedAttention

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
MAX_QUERY_GROUPS = 8
MAX_HEAD_DIM = 256
_PAIR_DTYPES = {2: torch.int32, 4: torch.int64}  # element size -> the integer type of a pair


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (or load the cached build of) the kernel; False where it is unavailable."""
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        return False
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=f"tokenmill_cpu_kernels_{_cpu_fingerprint()}",
            sources=[str(SOURCE)],
            # -fopenmp: at::parallel_for is inline OpenMP; it resolves to the libgomp torch loaded
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, an unexpected toolchain: run without it
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        logger.warning("CPU attention kernel unavailable, using the PyTorch path: %s", first_line)
        return False
    return True


def _cpu_fingerprint() -> str:
    """A short hash of this CPU's feature flags: builds use -march=native, so a cache shared by
    machines (an NFS home) must not hand one CPU's build to another."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def kernel_supports(head_dim: int, num_query_groups: int, dtype: torch.dtype) -> bool:
    return (
        head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and num_query_groups <= MAX_QUERY_GROUPS
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


class CpuPagedAttention(TorchPagedAttention):
    """TorchPagedAttention with decode buckets computed by the C++ kernel.

    Keys live in the cache by column, [kv_heads, blocks, head_dim / 2, block_size, 2] (see the
    kernel's header), so this backend also writes them and, for prefill chunks, gathers them.
    Values keep PyTorch's row layout.
    """

    def __init__(self) -> None:
        super().__init__()
        self._pair_index: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def _write_keys(self, k_cache: torch.Tensor, write_index: torch.Tensor, keys: torch.Tensor) -> None:
        # Each (dimension pair) of a key is one element of a twice-as-wide integer view of the cache.
        pair_dtype = _PAIR_DTYPES[k_cache.element_size()]
        index = self._pair_index_for(write_index, k_cache)
        k_cache.view(-1).view(pair_dtype).index_copy_(0, index, keys.view(pair_dtype).flatten())

    def _pair_index_for(self, write_index: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
        """Where each dimension pair of each written key goes; the same for every layer of a step."""
        cached_for, index = self._pair_index
        if cached_for is not write_index:
            _, _, block_size, head_dim = k_cache.shape
            block_rows, offsets = write_index // block_size, write_index % block_size
            pairs = torch.arange(head_dim // 2, device=write_index.device) * block_size
            index = ((block_rows * (head_dim // 2 * block_size) + offsets)[:, None] + pairs[None, :]).flatten()
            self._pair_index = (write_index, index)
        return index

    def _gather_keys(self, k_cache: torch.Tensor, bucket: AttentionBucket) -> torch.Tensor:
        num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        blocks = self._gather(k_cache.view(num_kv_heads * num_blocks, -1), bucket.gather_index)
        rows = blocks.view(-1, head_dim // 2, block_size, 2).transpose(1, 2)  # [.., block_size, head_dim / 2, 2]
        return rows.reshape(num_kv_heads, -1, bucket.context_len, head_dim)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: AttentionBucket,
                scale: float) -> torch.Tensor:
        """q: [B, num_heads, head_dim] -> [B, num_heads * head_dim]."""
        scores = torch.ops.tokenmill.paged_decode_qk(
            q.contiguous(), k_cache, bucket.block_table, bucket.seq_lens, scale, bucket.context_len
        )  # float32 [B, num_heads, context], -inf past each sequence
        probs = torch.softmax(scores, dim=-1)
        out = torch.ops.tokenmill.paged_decode_pv(probs, v_cache, bucket.block_table, bucket.seq_lens)
        return out.view(q.shape[0], -1)


def default_attention_backend(device: torch.device, dtype: torch.dtype, head_dim: int,
                              num_query_groups: int) -> AttentionBackend:
    """The fastest backend that supports this model on this device."""
    use_kernel = (
        os.environ.get("TOKENMILL_CPU_KERNELS", "1") != "0"
        and device.type == "cpu"
        and kernel_supports(head_dim, num_query_groups, dtype)
        and load_cpu_kernels()
    )
    return CpuPagedAttention() if use_kernel else TorchPagedAttention()
