"""Times the AMX prototype's three variants (amx_q4_prototype.cpp) against the product's Q4_1 record kernel over
SmolLM2-135M's decoder projections (30 layers of random 4-bit blocks), and checks the prototype's rows are
batch-invariant and its variants equal.
Needs a CPU with AMX-BF16 and Linux's permission for tile data. Run from the repository root:

    .venv/bin/python docs/experiments/amx_q4_prototype.py 9
"""

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from specserve.models.native_stack import extension

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # q k v o gate up down


def main(repeats: int) -> None:
    amx = load("amx_q4_prototype", [str(Path(__file__).with_suffix(".cpp"))], extra_cflags=["-O3", "-fopenmp"])
    ext = extension()
    torch.manual_seed(0)
    layers = []
    for _ in range(30):
        for n, k in SHAPES:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            d = (torch.rand(n, k // 32) * 0.01 + 0.001).half().float()
            m = (-(torch.rand(n, k // 32) * 0.08)).half().float()
            w = (q.float().view(n, k // 32, 32) * d[..., None] + m[..., None]).view(n, k)
            tiles = amx.pack(q, d, m)
            layers.append((n, k, tiles, ext.small_pack_q4(q, d, m), w, amx.pack_tiles(tiles, n, k)))
    for n, k, tiles, _, w, expanded in layers[: len(SHAPES)]:
        x = torch.randn(16, k)
        y = amx.linear(x, tiles, n)
        assert torch.equal(amx.linear_pipelined(x, tiles, n), y) and torch.equal(amx.linear_tiles(x, expanded, n), y)
        ref = x.bfloat16().float() @ w.bfloat16().float().T
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        prefixes = all(torch.equal(amx.linear(x[:r], tiles, n), y[:r]) for r in (1, 2, 5, 8, 13))
        alone = all(torch.equal(amx.linear(x[i : i + 1], tiles, n), y[i : i + 1]) for i in range(16))
        assert prefixes and alone, (n, k)  # every row the same bits alone or among others
        print(f"{n}x{k}: max error / max |ref| against bf16 inputs {err:.1e}; the same bits in any row set")
    xs = {576: torch.randn(16, 576), 1536: torch.randn(16, 1536)}
    fetches = {"none": ext.Prefetch.none, "l1": ext.Prefetch.l1, "l2": ext.Prefetch.l2}
    print("| rows | Q4_1 records, prefetch none | l1 | l2 | AMX | AMX pipelined | AMX bf16 tiles |")
    print("|---" * 7 + "|")
    for rows in (1, 2, 4, 8, 16):
        times: dict[str, list[float]] = {name: [] for name in (*fetches, "amx", "pipelined", "tiles")}
        for _ in range(repeats):
            for name, pf in fetches.items():
                t = time.perf_counter()
                for _, k, _, records, _, _ in layers:
                    ext.small_linear_packed(xs[k][:rows], records, prefetch=pf)
                times[name].append(time.perf_counter() - t)
            for name, f in (("amx", amx.linear), ("pipelined", amx.linear_pipelined)):
                t = time.perf_counter()
                for n, k, tiles, _, _, _ in layers:
                    f(xs[k][:rows], tiles, n)
                times[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            for n, k, _, _, _, expanded in layers:
                amx.linear_tiles(xs[k][:rows], expanded, n)
            times["tiles"].append(time.perf_counter() - t)
        print(f"| {rows} | " + " | ".join(f"{statistics.median(v) * 1e3:.2f}" for v in times.values()) + " |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
