"""The printed report of bench/gpu_decode.py: one line per timed variant, then the summary table."""

from __future__ import annotations


def describe(name: str, r: dict, wbytes: int, kv_per_token: int, copy_bw: float) -> list[str]:
    lines, batch = [], r["batch"]
    step_bytes = wbytes + batch * r["context"] * kv_per_token
    for key, label in (("eager_s", "eager"), ("graph_s", "graph"), ("replay_s", "replay")):
        if key in r:
            s = r[key]
            bw = step_bytes / s
            lines.append(
                f"{name:5s} {label:6s} batch {batch:3d}: {s * 1e3:8.3f} ms/step {batch / s:9.1f} tok/s "
                f"{bw / 1e9:7.1f} GB/s ({100 * bw / copy_bw:5.1f}% of copy bw)"
            )
    return lines


def summarize(results: dict, wbytes: int, kv_token: int, copy_bw: float) -> None:
    print("\n=== summary ===")
    print(f"device {results['device']}, torch {results['torch']}, copy bw {copy_bw / 1e9:.0f} GB/s")
    print(
        f"Kettle vs transformers logits (bf16, last prompt token) rel err {results['kettle_vs_hf_logits_rel_err']:.2e}"
    )
    by_batch = {r["batch"]: r for r in results["kettle"]}
    print("batch | eager ms | graph ms | replay ms | graph tok/s | graph %bw | replay %bw | hf ms | x hf")
    for batch, r in by_batch.items():
        step_bytes = wbytes + batch * r["context"] * kv_token
        hf = results["hf"].get(batch)
        print(
            f"{batch:5d} | {r['eager_s'] * 1e3:8.2f} | {r['graph_s'] * 1e3:8.2f} | {r['replay_s'] * 1e3:9.2f} | "
            f"{batch / r['graph_s']:11.1f} | {100 * step_bytes / r['graph_s'] / copy_bw:9.1f} | "
            f"{100 * step_bytes / r['replay_s'] / copy_bw:10.1f} | "
            + (f"{hf * 1e3:5.1f} | {hf / r['graph_s']:5.2f}" if hf else "    - |     -")
        )
    if 8 in by_batch:
        print(f"graph greedy tokens == eager (batch 8, 16 steps): {by_batch[8].get('graph_tokens_match_eager')}")
    if "fp8" in results:
        print(
            f"fp8 vs bf16 rel err: one layer (qkv) {results['fp8_qkv_rel_err']:.4f}, "
            f"logits after 32 random layers {results['fp8_logits_rel_err']:.3f}"
        )
        for r in results["fp8"]:
            base = by_batch.get(r["batch"])
            ratio = f"  bf16/fp8 graph {base['graph_s'] / r['graph_s']:.2f}x" if base else ""
            print(
                f"fp8 batch {r['batch']:3d}: eager {r['eager_s'] * 1e3:.2f} ms, graph {r['graph_s'] * 1e3:.2f} ms, "
                f"replay {r['replay_s'] * 1e3:.2f} ms{ratio}"
            )
    for batch, (seconds, bandwidth) in results["attention"].items():
        share = 100 * bandwidth / copy_bw
        print(f"attention kernel alone, batch {batch:3d}: {seconds * 1e6:.1f} us/layer, {share:.1f}% of copy bw")
