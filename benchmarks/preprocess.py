"""Tokenisation throughput of `loong-llm preprocess` against a plain `datasets.map`, side by side.

Both tokenise the same JSONL corpus (the corpus shipped with loong-llm repeated to ~20 MB) with the
same tokenizer (the packaged 512-token BPE, built once and saved to a folder both load, so neither
pays for training it) in two worker processes,
appending the end-of-document token to every document:

- loong: ``loong-llm preprocess corpus.jsonl --output-prefix P --tokenizer DIR --workers 2`` (megatron .bin/.idx);
- datasets: ``load_dataset("json")`` then ``Dataset.map(tokenize, batched=True, num_proc=2)`` (Arrow cache).

Each runs in its own process, alternately, ``--repeats`` times; the best run of each is reported.
Figures: tokens/s over the whole process (interpreter start included), over the call (library
imports, tokenizer loading, worker start, reading, tokenising, writing) and over the tokenising phase. Prints a table and
writes JSON (command, versions, hardware, figures) to ``benchmarks/results/preprocess_cpu_<date>.json``.

    uv run python benchmarks/preprocess.py            # ~20 MB, 2 workers, 2 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _env import host, versions  # benchmarks/_env.py (run as scripts from the repo root)

RESULTS = Path(__file__).parent / "results"

DATASETS_WORKER = r"""
import json, sys, time
t0 = time.perf_counter()
from datasets import disable_progress_bars, load_dataset
from transformers import AutoTokenizer
disable_progress_bars()
corpus, tok_dir, cache, nproc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
t1 = time.perf_counter()
tok = AutoTokenizer.from_pretrained(tok_dir)
eod = tok.eos_token_id
ds = load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
t2 = time.perf_counter()

def tokenize(batch):
    return {"input_ids": [ids + [eod] for ids in tok(batch["text"], add_special_tokens=False)["input_ids"]]}

out = ds.map(tokenize, batched=True, num_proc=nproc, remove_columns=ds.column_names, load_from_cache_file=False)
t3 = time.perf_counter()
tokens = sum(len(x) for x in out.with_format("numpy")["input_ids"])
t4 = time.perf_counter()
print(json.dumps({"documents": len(out), "tokens": int(tokens), "imports_s": t1 - t0,
                  "call_s": t3 - t0, "tokenize_s": t3 - t2, "count_s": t4 - t3}))
"""


def _corpus(directory: Path, mib: float) -> Path:
    from loong.llm.data.tokenizer import packaged_corpus_path

    src = packaged_corpus_path().read_bytes()
    path = directory / "corpus.jsonl"
    path.write_bytes(src * max(1, round(mib * 2**20 / len(src))))
    return path


def _run_loong(corpus: Path, tok_dir: Path, out: Path, workers: int) -> dict:
    cmd = [sys.executable, "-m", "loong.llm.cli", "preprocess", str(corpus), "--output-prefix", str(out),
           "--tokenizer", str(tok_dir), "--workers", str(workers), "--no-progress"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"loong-llm preprocess failed:\n{proc.stderr[-3000:]}")
    meta = json.loads(Path(f"{out}.json").read_text())
    summary = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    return {"documents": meta["documents"], "tokens": meta["tokens"], "wall_s": wall,
            "call_s": float(summary["seconds"].split()[0]),
            "tokenize_s": float(summary["seconds"].split("tokenising ")[1].rstrip(")")),
            "command": "loong-llm " + " ".join(cmd[3:])}


def _run_datasets(corpus: Path, tok_dir: Path, cache: Path, workers: int) -> dict:
    cmd = [sys.executable, "-c", DATASETS_WORKER, str(corpus), str(tok_dir), str(cache), str(workers)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"datasets.map failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    wall -= res["count_s"]  # not the token count that checks the result
    return {**res, "wall_s": wall,
            "command": f"datasets.load_dataset('json') + Dataset.map(batched=True, num_proc={workers})"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=20.0, help="corpus size in MiB (default 20)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from loong.llm.data.tokenizer import build_packaged_tokenizer

    with tempfile.TemporaryDirectory(prefix="loong-bench-") as tmp:
        tmp = Path(tmp)
        corpus = _corpus(tmp, args.mib)
        tok_dir = tmp / "tokenizer"
        build_packaged_tokenizer().save(tok_dir)
        hardware = host()
        runs: dict[str, list[dict]] = {"loong": [], "datasets": []}
        for i in range(args.repeats):
            runs["loong"].append(_run_loong(corpus, tok_dir, tmp / f"shard{i}", args.workers))
            runs["datasets"].append(_run_datasets(corpus, tok_dir, tmp / f"hf_cache{i}", args.workers))
        size = corpus.stat().st_size
    best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in runs.items()}
    assert best["loong"]["tokens"] == best["datasets"]["tokens"], "the two pipelines disagree on the token count"
    tokens = best["loong"]["tokens"]

    def rate(seconds: float | None) -> float | None:
        return round(tokens / seconds, 1) if seconds else None

    figures = {k: {"documents": r["documents"], "tokens": r["tokens"], "wall_s": round(r["wall_s"], 2),
                   "call_s": round(r["call_s"], 2),
                   "tokenize_s": round(r["tokenize_s"], 2) if r.get("tokenize_s") else None,
                   "tokens_per_s_wall": rate(r["wall_s"]), "tokens_per_s_call": rate(r["call_s"]),
                   "tokens_per_s_tokenize": rate(r.get("tokenize_s")), "command": r["command"]}
               for k, r in best.items()}
    print(f"corpus: {size / 2**20:.1f} MiB JSONL, {best['loong']['documents']:,} documents, {tokens:,} tokens; "
          f"{args.workers} workers; best of {args.repeats}")
    print(f"{'pipeline':<10} {'wall s':>7} {'call s':>7} {'phase s':>8} {'tok/s wall':>11} {'tok/s call':>11} "
          f"{'tok/s phase':>12}")
    for k, f in figures.items():
        print(f"{k:<10} {f['wall_s']:>7.2f} {f['call_s']:>7.2f} {f['tokenize_s']:>8.2f} {f['tokens_per_s_wall']:>11,.0f} "
              f"{f['tokens_per_s_call']:>11,.0f} {f['tokens_per_s_tokenize']:>12,.0f}")
    result = {
        "benchmark": "preprocess", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": "python benchmarks/preprocess.py " + " ".join(sys.argv[1:]),
        "corpus": {"source": "loong-llm packaged corpus repeated", "bytes": size, "format": "jsonl",
                   "documents": best["loong"]["documents"], "tokens": tokens},
        "tokenizer": "packaged byte-level BPE (512 tokens)", "workers": args.workers, "repeats": args.repeats,
        "versions": versions(["loong-llm", "megatron-core", "torch", "transformers", "tokenizers", "datasets", "pyarrow", "numpy"]), "hardware": {**hardware, "load_average_after": os.getloadavg()},
        "figures": figures, "all_runs": runs,
        "notes": "wall: the whole process (interpreter start included; for datasets without the token count "
                 "that checks its result); call: library imports (transformers, megatron-core / datasets), "
                 "tokenizer loading, reading, tokenising and writing (loong: preprocess(); datasets: the "
                 "script from its imports to the end of map); "
                 "phase: loong reading + JSON parsing + tokenising + writing (workers already starting), "
                 "datasets Dataset.map alone (the JSON was parsed by load_dataset before it)",
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"preprocess_cpu_{time.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
