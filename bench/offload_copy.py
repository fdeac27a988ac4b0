"""CPU KV offload: host -> device page copies (a decode step's hot-buffer misses) against plain DMA.

One MSA layer's pinned host pool at M3 dims (``[K/V, pages, Hkv 4, 128 tokens, D 128]`` bf16: 128 KiB
per page and plane), and a device pool.  Per miss count (a decode step's misses at batch 1, 8, 32:
4 KV heads x 15 ranked blocks per request), random distinct host pages are copied to random distinct
device pages:

* ``copy_pages`` (``engine.offload.page_copy``, the Triton kernel the engine runs, reading pinned host
  memory through unified addressing) in each launch configuration of ``CONFIGS``;
* the peers, same bytes: one contiguous ``copy_`` (DMA, the ceiling) and one ``copy_`` per page
  (a DMA per page and plane, what ``cudaMemcpyAsync`` per miss would do).

Every configuration's copy is checked against the host pages once.  Times are CUDA-event medians
(``triton.testing.do_bench``); GB/s are 1e9 bytes per second.  The target (design: misses copied at
>= 40 GB/s) is met by the row the engine's default config gives.

    python -m bench.offload_copy [--out DIR]
"""

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from bench.common import cuda_time_us, markdown_table, write_results
from m3stack.engine.offload.page_copy import CopyConfig, copy_pages

logger = logging.getLogger("bench.offload_copy")

KV_HEADS, BLOCK, HEAD_DIM = 4, 128, 128
HOST_PAGES, DEVICE_PAGES = 4096, 2048
MISSES_PER_REQUEST = KV_HEADS * 15
BATCHES = [1, 8, 32]
CONFIGS = [
    CopyConfig(),
    CopyConfig(chunk_elements=8192),
    CopyConfig(chunk_elements=16384),
    CopyConfig(chunk_elements=2048, programs_per_sm=8),
    CopyConfig(programs_per_sm=8),
    CopyConfig(chunk_elements=8192, programs_per_sm=8, num_warps=8),
    CopyConfig(chunk_elements=16384, programs_per_sm=2, num_warps=8),
]
COLUMNS = ["batch", "misses", "mib", "method", "us", "gbps", "of_dma"]


def describe(config: CopyConfig) -> str:
    return f"copy_pages chunk={config.chunk_elements} programs/SM={config.programs_per_sm} warps={config.num_warps}"


def measure(batch: int, host: torch.Tensor, device_pool: torch.Tensor, generator: torch.Generator) -> list[dict]:
    misses = batch * MISSES_PER_REQUEST
    src = torch.randperm(HOST_PAGES, generator=generator)[:misses].to(torch.int32)
    dst = torch.randperm(DEVICE_PAGES, generator=generator)[:misses].to(torch.int32)
    src_cuda, dst_cuda = src.cuda(), dst.cuda()
    count = torch.tensor([misses], dtype=torch.int32, device="cuda")
    nbytes = misses * host[:, 0].numel() * host.element_size()
    base = {"batch": batch, "misses": misses, "mib": nbytes / 2**20}
    rows: list[dict[str, Any]] = []

    # The same bytes as one contiguous run of pinned memory (a slice across planes would be strided, which
    # torch copies through a pageable staging buffer).
    contiguous_src = host.view(-1)[: misses * host[:, 0].numel()]
    contiguous_dst = torch.empty_like(contiguous_src, device="cuda")
    dma_us = cuda_time_us(lambda: contiguous_dst.copy_(contiguous_src, non_blocking=True))
    rows.append({**base, "method": "contiguous copy_ (DMA ceiling)", "us": dma_us})

    pairs = list(zip(src.tolist(), dst.tolist(), strict=True))

    def per_page() -> None:  # each plane of a page is contiguous: one DMA each
        for s, d in pairs:
            for plane in range(host.shape[0]):
                device_pool[plane, d].copy_(host[plane, s], non_blocking=True)

    rows.append({**base, "method": "copy_ per page", "us": cuda_time_us(per_page)})
    for config in CONFIGS:
        device_pool.zero_()
        copy_pages(host, device_pool, src_cuda, dst_cuda, count, config=config)
        torch.cuda.synchronize()
        equal = torch.equal(device_pool[:, dst.long()].cpu(), host[:, src.long()])
        us = cuda_time_us(lambda c=config: copy_pages(host, device_pool, src_cuda, dst_cuda, count, config=c))
        rows.append({**base, "method": describe(config), "us": us, "equal": equal})
    for row in rows:
        row["gbps"] = nbytes / (row["us"] * 1e-6) / 1e9
        row["of_dma"] = dma_us / row["us"]
        logger.info("%s", row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench.offload_copy needs a CUDA GPU")
    generator = torch.Generator().manual_seed(0)
    shape = (2, HOST_PAGES, KV_HEADS, BLOCK, HEAD_DIM)
    host = torch.randn(shape, dtype=torch.bfloat16, device="cuda").cpu().pin_memory()
    device_pool = torch.zeros((2, DEVICE_PAGES, KV_HEADS, BLOCK, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
    rows = [row for batch in BATCHES for row in measure(batch, host, device_pool, generator)]
    failed = [row for row in rows if row.get("equal") is False]
    default = [row for row in rows if row["method"] == describe(CopyConfig())]
    extra = {
        "shape": dict(kv_heads=KV_HEADS, block=BLOCK, head_dim=HEAD_DIM, host_pages=HOST_PAGES),
        "default_config": describe(CopyConfig()),
        "target_ge_40_gbps": all(row["gbps"] >= 40.0 for row in default) if default else None,
    }
    write_results("offload_copy", rows, extra, out_dir=args.out)
    sys.stdout.write(markdown_table(rows, COLUMNS) + "\n")
    if failed:
        logger.error("copies differ from the host pages: %s", [row["method"] for row in failed])
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
