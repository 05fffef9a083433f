"""Peak memory of ``loong-llm convert`` (~1B parameters) and ``loong-diffusion convert``, both ways, vs. the model's size.

A random-weight Llama of the Llama-3.2-1B shape (16 layers, hidden 2048, FFN 8192, 32 heads / 8 KV heads,
vocabulary 128256, tied embeddings: 1.24 B parameters) is written as a bf16 Hugging Face folder in
``--hf-shard-size`` shards with ``model.safetensors.index.json``, one tensor at a time (no model is instantiated:
random tensors go straight into :class:`loong.llm.hf_io.ShardWriter`). Then, each in its own process with the
peak resident set size read from ``getrusage(RUSAGE_CHILDREN)`` of a fresh parent per run:

- HF -> Loong: ``loong-llm convert HF LOONG --no-progress``;
- Loong -> HF: ``loong-llm convert LOONG HF2 --max-shard-size 1GB --no-progress``;
- optionally (``--verify``) each again with ``--verify``.

Figures: peak RSS in GiB, the model's bytes, the largest HF tensor and the largest native (layer-stacked) tensor,
and the baseline RSS of a process that only imports the converter (torch + megatron-core). Prints a table and
writes JSON (command, versions, hardware, figures) to ``benchmarks/results/convert_memory_cpu_<date>.json``.

    uv run python benchmarks/convert_memory.py                # ~1.24 B parameters, ~2.5 GB bf16 on disk
    uv run python benchmarks/convert_memory.py --converters diffusion   # the Wan rows alone (~0.4 GiB)

``--converters diffusion`` (also in the default run) measures ``loong-diffusion convert`` both ways on a random
bf16 Wan 2.1 1.3B-shaped transformer of ``--wan-layers`` blocks (4: ~0.19 B parameters), the Loong -> diffusers
run in 100MB shards; a run without llm writes ``convert_memory_<converters>_cpu_<date>.json``.

``--converters embodied`` measures ``loong-embodied convert`` both ways (``--verify``: also with ``--verify``) on a
random fp32 GR00T N1.7 run built in-process: the tiny preset with a ``--embodied-size`` Qwen3-VL text tower
(1024 wide, 4 layers, vocabulary 32000: ~0.11 B parameters, ~0.41 GiB), Loong -> lerobot (``model.safetensors`` and
the ``groot_base/`` it carries) and that folder back to Loong.

``--converters vlm`` measures ``loong-vlm convert`` both ways, and both again with ``--verify``, on a random bf16
Qwen2.5-VL HF folder written in-process one tensor at a time (``--vlm-layers`` 4,4: 4 ViT blocks of 1280, 4 text
layers of 1024, vocabulary 151936 tied: ~0.33 B parameters, ~0.61 GiB; a tiny processor beside it), the Loong -> HF
run in 100MB shards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _env import host, run_child, versions  # benchmarks/_env.py (run as scripts from the repo root)

RESULTS = Path(__file__).parent / "results"
GIB = 2**30

# runs one command as a child and prints its peak RSS (ru_maxrss is KiB on Linux); a fresh process per measurement
# so RUSAGE_CHILDREN holds that child alone
MEASURE = r"""
import json, resource, subprocess, sys, time
t = time.perf_counter()
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
wall = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"rc": proc.returncode, "peak_rss_bytes": peak, "wall_s": wall, "stderr_tail": proc.stderr[-1500:]}))
"""

BASELINE = "import loong.llm.convert, megatron.core.dist_checkpointing, torch.distributed.checkpoint"
DIFFUSION_BASELINE = "import loong.diffusion.convert, loong.diffusion.cli, torch.distributed.checkpoint"
EMBODIED_BASELINE = ("import loong.embodied.cli, loong.embodied.lerobot_io, loong.embodied.inference, lerobot.policies, "
                     "lerobot.policies.groot.modeling_groot, torch.distributed.checkpoint")


def llama_1b(layers: int) -> dict:
    """config.json of a Llama-3.2-1B-shaped model."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": layers, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
            "eos_token_id": 128001}


def write_random_hf(folder: Path, cfg: dict, shard_bytes: int) -> dict:
    """A bf16 HF folder of random weights for ``cfg``, one tensor in memory at a time; its sizes."""
    import torch

    from loong.llm.hf_io import ShardWriter, write_hf_metadata

    d, f, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd, q, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(n):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (q * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
                       p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, q * hd),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    shapes["model.norm.weight"] = (d,)
    gen = torch.Generator().manual_seed(0)
    writer = ShardWriter(folder, shard_bytes)
    for key, shape in shapes.items():
        t = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
        writer.add(key, t)
        del t
    files = writer.close()
    write_hf_metadata(folder, cfg)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    largest = max(shapes.items(), key=lambda kv: torch.Size(kv[1]).numel())
    # the largest native tensor: linear_fc1 stacks gate+up of every layer ([layers, 2*ffn, hidden])
    native_largest = max(n * 2 * f * d, v * d)
    return {"parameters": params, "bytes": params * 2, "shards": len(files),
            "largest_hf_tensor": {"name": largest[0], "bytes": torch.Size(largest[1]).numel() * 2},
            "largest_native_tensor_bytes": native_largest * 2}


def write_random_wan(folder: Path, layers: int) -> dict:
    """A bf16 diffusers folder of a Wan 2.1 1.3B-shaped transformer with ``layers`` blocks (random weights, one
    tensor in memory at a time: the model is built on the meta device only for its names and shapes); its sizes."""
    import dataclasses

    import torch

    from loong.core.checkpoint.safetensors_io import ShardWriter
    from loong.diffusion.models.wan import WanTransformer, config_to_diffusers, to_diffusers, wan_preset
    from loong.diffusion.models.wan.mapping import CONFIG_NAME, WEIGHTS_STEM

    wan = dataclasses.replace(wan_preset("wan2_1_t2v_1_3b"), num_layers=layers)
    with torch.device("meta"):
        native = WanTransformer(wan).state_dict()
    shapes = {k: tuple(v.shape) for k, v in to_diffusers(native).items()}
    gen = torch.Generator().manual_seed(0)
    writer = ShardWriter(folder, 10 * GIB, stem=WEIGHTS_STEM)
    for key, shape in shapes.items():
        writer.add(key, torch.randn(shape, generator=gen).mul_(0.02).to(torch.bfloat16))
    files = writer.close()
    (folder / CONFIG_NAME).write_text(json.dumps(config_to_diffusers(wan), indent=2, sort_keys=True) + "\n")
    params = sum(torch.Size(s).numel() for s in shapes.values())
    largest = max(shapes.items(), key=lambda kv: torch.Size(kv[1]).numel())
    native_largest = max(native.items(), key=lambda kv: kv[1].numel())
    return {"converter": "loong-diffusion", "shape": f"wan2_1_t2v_1_3b with num_layers={layers}",
            "parameters": params, "bytes": params * 2, "shards": len(files),
            "largest_diffusers_tensor": {"name": largest[0], "bytes": torch.Size(largest[1]).numel() * 2},
            "largest_native_tensor": {"name": native_largest[0], "bytes": native_largest[1].numel() * 2}}


VLM_BASELINE = "import loong.vlm.convert, loong.vlm.cli, megatron.core.dist_checkpointing, torch.distributed.checkpoint"


def qwen2_5_vl_small(vision_depth: int, text_layers: int) -> dict:
    """config.json (the published flat form) of a small Qwen2.5-VL: its ViT's width and Qwen2's vocabulary, fewer
    blocks / layers and a narrower text model (4 blocks, 4 layers: ~0.33 B parameters)."""
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_act": "silu",
            "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": text_layers,
            "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 151936, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
            "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 8, 8]},
            "vision_config": {"depth": vision_depth, "hidden_act": "silu", "hidden_size": 1280,
                              "intermediate_size": 3420, "num_heads": 16, "in_chans": 3, "out_hidden_size": 1024,
                              "patch_size": 14, "spatial_merge_size": 2, "window_size": 112,
                              "fullatt_block_indexes": [vision_depth - 1], "temporal_patch_size": 2}}


def write_random_vlm(folder: Path, vision_depth: int, text_layers: int) -> dict:
    """A bf16 HF Qwen2.5-VL folder (random weights, one tensor in memory at a time: names and shapes come from the
    mapping applied to meta tensors) with a tiny processor beside it; its sizes."""
    import torch

    from loong.core.checkpoint.safetensors_io import ShardWriter
    from loong.llm.hf_io import write_hf_metadata
    from loong.vlm.data.processors import build_tiny_processor
    from loong.vlm.hf import load_processor_folder, native_shapes, native_to_hf
    from loong.vlm.hf_config import generation_config_of, hf_config_of, parts_from_hf

    parts = parts_from_hf(qwen2_5_vl_small(vision_depth, text_layers), preset="qwen2_5_vl_small")
    processor = load_processor_folder(build_tiny_processor(folder, "qwen2_5_vl", patch_size=14))
    native = {k: torch.empty(s, device="meta") for k, s in native_shapes(parts).items()}
    shapes = {k: tuple(v.shape) for k, v in native_to_hf(native, parts).items()}
    gen = torch.Generator().manual_seed(0)
    writer = ShardWriter(folder, 10 * GIB)
    for key, shape in shapes.items():
        writer.add(key, torch.randn(shape, generator=gen).mul_(0.02).to(torch.bfloat16))
    files = writer.close()
    config = hf_config_of(parts, processor, "bfloat16")
    write_hf_metadata(folder, config, generation_config=generation_config_of(config))
    params = sum(torch.Size(s).numel() for s in shapes.values())
    largest = max(shapes.items(), key=lambda kv: torch.Size(kv[1]).numel())
    native_largest = max(native.items(), key=lambda kv: kv[1].numel())
    return {"converter": "loong-vlm", "shape": f"Qwen2.5-VL, {vision_depth} ViT blocks of 1280, {text_layers} "
            "text layers of 1024, vocabulary 151936 (tied)", "parameters": params, "bytes": params * 2,
            "shards": len(files), "largest_hf_tensor": {"name": largest[0], "bytes": torch.Size(largest[1]).numel() * 2},
            "largest_native_tensor": {"name": native_largest[0], "bytes": native_largest[1].numel() * 2}}


def vlm_rows(tmp: Path, vision_depth: int, text_layers: int, env: dict) -> tuple[dict, dict]:
    """(model sizes, runs) of ``loong-vlm convert`` both ways (and with ``--verify``) on a random Qwen2.5-VL."""
    exe = [sys.executable, "-m", "loong.vlm.cli"]
    t = time.perf_counter()
    model = write_random_vlm(tmp / "vlm", vision_depth, text_layers)
    model["write_s"] = round(time.perf_counter() - t, 1)
    hf, loong, back = str(tmp / "vlm"), str(tmp / "vlm_loong"), str(tmp / "vlm2")
    runs = {"vlm baseline (imports only)": measure([sys.executable, "-c", VLM_BASELINE], env),
            "VLM HF -> Loong": measure([*exe, "convert", hf, loong, "--no-progress"], env),
            "VLM Loong -> HF": measure([*exe, "convert", loong, back, "--no-progress", "--max-shard-size", "100MB"],
                                       env),
            "VLM HF -> Loong --verify": measure([*exe, "convert", hf, loong + "_v", "--no-progress", "--verify"], env),
            "VLM Loong -> HF --verify": measure([*exe, "convert", loong, back + "_v", "--no-progress", "--verify",
                                                 "--max-shard-size", "100MB"], env)}
    largest, native = model["largest_hf_tensor"], model["largest_native_tensor"]
    print(f"vlm model: {model['shape']}: {model['parameters'] / 1e9:.3f} B parameters, {model['bytes'] / GIB:.2f} "
          f"GiB bf16; largest HF tensor {largest['bytes'] / GIB:.3f} GiB, largest native tensor "
          f"{native['bytes'] / GIB:.3f} GiB ({native['name']})")
    _table(runs, "vlm baseline (imports only)", model["bytes"])
    return model, runs


def diffusion_rows(tmp: Path, layers: int, env: dict) -> tuple[dict, dict]:
    """(model sizes, runs) of ``loong-diffusion convert`` both ways on a random Wan."""
    exe = [sys.executable, "-m", "loong.diffusion.cli"]
    t = time.perf_counter()
    model = write_random_wan(tmp / "wan", layers)
    model["write_s"] = round(time.perf_counter() - t, 1)
    runs = {"diffusion baseline (imports only)": measure([sys.executable, "-c", DIFFUSION_BASELINE], env),
            "diffusers -> Loong": measure([*exe, "convert", str(tmp / "wan"), str(tmp / "wan_loong"),
                                           "--no-progress"], env),
            "Loong -> diffusers": measure([*exe, "convert", str(tmp / "wan_loong"), str(tmp / "wan2"),
                                           "--no-progress", "--max-shard-size", "100MB"], env)}
    return model, runs


def write_random_policy(run_dir: Path, hidden: int, layers: int, vocab: int) -> dict:
    """A loong-embodied run folder (``policy/`` + a weights-only ``checkpoints/step_00000000``) of a random-weight
    fp32 GR00T N1.7: the tiny preset with a Qwen3-VL text tower of ``layers`` layers, ``hidden`` wide, vocabulary
    ``vocab`` (the VL self-attention at the same width), built in this process; the processor from the synthetic
    reach dataset. Its sizes."""
    import torch
    import torch.distributed.checkpoint as dcp

    from loong.core.checkpoint import CheckpointManager
    from loong.core.config.schema import to_dict
    from loong.embodied.data.dataset import VLADataset
    from loong.embodied.data.synthetic import ensure_reach_dataset
    from loong.embodied.policies import POLICIES
    from loong.embodied.policies.groot_n1_7.config import tiny_backbone
    from loong.embodied.schema import EmbodiedRunConfig, PolicyModelConfig
    from loong.embodied.task import write_policy_dir

    spec = POLICIES.get("groot_n1_7")
    backbone = tiny_backbone(vocab)
    heads = hidden // 128
    backbone["text_config"].update(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=128)
    backbone["text_config"]["rope_parameters"]["mrope_section"] = [24, 20, 20]
    backbone["vision_config"]["out_hidden_size"] = hidden
    fields = {"backbone": backbone, "select_layer": layers, "backbone_embedding_dim": hidden,
              "vl_self_attention_heads": heads, "vl_self_attention_head_dim": 128}
    config = spec.presets["tiny"].replace(**fields)
    data = ensure_reach_dataset(run_dir.parent / ".cache", num_episodes=2, use_videos=False, progress=False)
    processor = spec.processor_class.from_datasets(config, [VLADataset(data, chunk_size=config.chunk_size)])
    torch.manual_seed(0)
    state = spec.policy_class(config).state_dict()
    write_policy_dir(run_dir / "policy", spec, config, processor)
    run = EmbodiedRunConfig(model=PolicyModelConfig(policy=spec.name, preset="tiny", config=fields),
                            run_name=run_dir.name, output_dir=str(run_dir.parent))

    class WeightsOnly:  # the slice of an engine the checkpoint manager needs
        def save(self, directory: Path) -> None:
            dcp.save({"model": state}, checkpoint_id=str(directory))

    CheckpointManager(run_dir / "checkpoints").save(0, WeightsOnly(), {"step": 0, "weights_only": True},
                                                    to_dict(run))
    params = sum(t.numel() for t in state.values())
    largest = max(state.items(), key=lambda kv: kv[1].numel())
    return {"converter": "loong-embodied", "shape": f"groot_n1_7 tiny preset, Qwen3-VL text tower {layers} layers x "
            f"{hidden} wide, vocabulary {vocab}", "parameters": params,
            "bytes": sum(t.numel() * t.element_size() for t in state.values()), "dtype": "float32",
            "largest_tensor": {"name": largest[0], "bytes": largest[1].numel() * largest[1].element_size()},
            "versions": versions(["loong-embodied", "lerobot"])}


def embodied_rows(tmp: Path, env: dict, hidden: int, layers: int, vocab: int, verify: bool) -> tuple[dict, dict]:
    """(model sizes, runs) of ``loong-embodied convert`` both ways on a random GR00T N1.7 run."""
    exe = [sys.executable, "-m", "loong.embodied.cli", "convert"]
    t = time.perf_counter()
    model = write_random_policy(tmp / "emb" / "run", hidden, layers, vocab)
    model["write_s"] = round(time.perf_counter() - t, 1)
    run, out, back = tmp / "emb" / "run", tmp / "emb" / "lerobot", tmp / "emb" / "back"
    runs = {"embodied baseline (imports only)": measure([sys.executable, "-c", EMBODIED_BASELINE], env),
            "Loong -> lerobot": measure([*exe, str(run), str(out), "--no-progress"], env),
            "lerobot -> Loong": measure([*exe, str(out), str(back), "--no-progress"], env)}
    if verify:
        runs["Loong -> lerobot --verify"] = measure([*exe, str(run), str(out) + "_v", "--no-progress", "--verify"],
                                                    env)
        runs["lerobot -> Loong --verify"] = measure([*exe, str(out), str(back) + "_v", "--no-progress", "--verify"],
                                                    env)
    model["lerobot_file_bytes"] = (out / "model.safetensors").stat().st_size
    return model, runs


def measure(cmd: list[str], env: dict) -> dict:
    """Peak RSS and wall time of ``cmd`` in a child of a fresh measuring process."""
    proc = run_child([sys.executable, "-c", MEASURE, *cmd], env=env)
    if proc.returncode != 0:
        raise SystemExit(f"measuring {cmd} failed: {proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if res["rc"] != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {res['rc']}: {res['stderr_tail']}")
    return {"command": " ".join(cmd), "peak_rss_bytes": res["peak_rss_bytes"], "wall_s": round(res["wall_s"], 1),
            "summary": [ln for ln in res["stderr_tail"].splitlines() if ln.startswith(("wrote", "verify"))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (16: ~1.24 B parameters)")
    parser.add_argument("--hf-shard-size", default="1GB", help="shard size of the generated HF folder (1GB)")
    parser.add_argument("--max-shard-size", default="1GB", help="--max-shard-size of the Loong -> HF run (1GB)")
    parser.add_argument("--verify", action="store_true", help="also measure both directions with --verify")
    parser.add_argument("--converters", default="llm,diffusion",
                        help="comma-separated converters to measure: llm, diffusion, embodied, vlm (default: "
                             "llm,diffusion)")
    parser.add_argument("--wan-layers", type=int, default=4,
                        help="Wan blocks of the diffusion model (4: ~0.19 B parameters, ~0.37 GiB bf16)")
    parser.add_argument("--embodied-size", default="1024,4,32000", metavar="HIDDEN,LAYERS,VOCAB",
                        help="the embodied policy's Qwen3-VL text tower (1024,4,32000: ~0.11 B parameters, ~0.41 GiB "
                             "fp32)")
    parser.add_argument("--vlm-layers", default="4,4", metavar="VISION,TEXT",
                        help="ViT blocks and text layers of the vlm converter's Qwen2.5-VL (4,4: ~0.33 B parameters)")
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed after)")
    args = parser.parse_args()

    from loong.llm.hf_io import parse_size

    which = {c.strip() for c in args.converters.split(",") if c.strip()}
    if not which or which - {"llm", "diffusion", "embodied", "vlm"}:
        raise SystemExit(f"--converters {args.converters}: a comma-separated subset of llm, diffusion, embodied, "
                         "vlm")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    exe = [sys.executable, "-m", "loong.llm.cli"]
    hardware = host()
    result: dict = {"benchmark": "convert_memory", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "command": "python benchmarks/convert_memory.py " + " ".join(sys.argv[1:]),
                    "versions": versions(["loong-llm", "loong-diffusion", "loong-vlm", "loong-core", "megatron-core",
                                          "torch", "safetensors", "transformers", "diffusers"]),
                    "notes": "peak RSS: ru_maxrss of the convert process (getrusage RUSAGE_CHILDREN in a fresh "
                             "parent); '- baseline' subtracts the peak RSS of a process that only imports that "
                             "converter; 'x model' is that difference over the model's bf16 bytes"}
    with tempfile.TemporaryDirectory(prefix="loong-convert-bench-", dir=args.dir) as tmp:
        tmp = Path(tmp)
        if "llm" in which:
            t = time.perf_counter()
            model = write_random_hf(tmp / "hf", llama_1b(args.layers), parse_size(args.hf_shard_size))
            model["write_s"] = round(time.perf_counter() - t, 1)
            runs = {"baseline (imports only)": measure([sys.executable, "-c", BASELINE], env),
                    "HF -> Loong": measure([*exe, "convert", str(tmp / "hf"), str(tmp / "loong"), "--no-progress"],
                                           env),
                    "Loong -> HF": measure([*exe, "convert", str(tmp / "loong"), str(tmp / "hf2"), "--no-progress",
                                            "--max-shard-size", args.max_shard_size], env)}
            ckpt_bytes = sum(p.stat().st_size for p in (tmp / "loong").rglob("*.distcp"))
            out_shards = len(list((tmp / "hf2").glob("*.safetensors")))
            if args.verify:
                runs["HF -> Loong --verify"] = measure([*exe, "convert", str(tmp / "hf"), str(tmp / "loong_v"),
                                                        "--no-progress", "--verify"], env)
                runs["Loong -> HF --verify"] = measure([*exe, "convert", str(tmp / "loong"), str(tmp / "hf_v"),
                                                        "--no-progress", "--verify", "--max-shard-size",
                                                        args.max_shard_size], env)
            print(f"llm model: {model['parameters'] / 1e9:.2f} B parameters, {model['bytes'] / GIB:.2f} GiB bf16 in "
                  f"{model['shards']} shards; largest HF tensor {model['largest_hf_tensor']['bytes'] / GIB:.2f} GiB "
                  f"({model['largest_hf_tensor']['name']}); largest native tensor "
                  f"{model['largest_native_tensor_bytes'] / GIB:.2f} GiB; Loong checkpoint {ckpt_bytes / GIB:.2f} "
                  f"GiB; HF output in {out_shards} shards")
            _table(runs, "baseline (imports only)", model["bytes"])
            result.update(model={**model, "config": llama_1b(args.layers), "loong_checkpoint_bytes": ckpt_bytes,
                                 "hf_output_shards": out_shards}, figures=runs)
        if "diffusion" in which:
            model, runs = diffusion_rows(tmp, args.wan_layers, env)
            print(f"diffusion model: {model['shape']}, {model['parameters'] / 1e9:.3f} B parameters, "
                  f"{model['bytes'] / GIB:.2f} GiB bf16; largest diffusers tensor "
                  f"{model['largest_diffusers_tensor']['bytes'] / GIB:.3f} GiB; largest native tensor "
                  f"{model['largest_native_tensor']['bytes'] / GIB:.3f} GiB ({model['largest_native_tensor']['name']})")
            _table(runs, "diffusion baseline (imports only)", model["bytes"])
            result.update(diffusion_model=model, diffusion_figures=runs)
        if "embodied" in which:
            hidden, layers, vocab = (int(x) for x in args.embodied_size.split(","))
            model, runs = embodied_rows(tmp, env, hidden, layers, vocab, args.verify)
            print(f"embodied model: {model['shape']}, {model['parameters'] / 1e9:.3f} B parameters, "
                  f"{model['bytes'] / GIB:.2f} GiB fp32; largest tensor {model['largest_tensor']['bytes'] / GIB:.3f} "
                  f"GiB ({model['largest_tensor']['name']})")
            _table(runs, "embodied baseline (imports only)", model["bytes"])
            result.update(embodied_model=model, embodied_figures=runs)
        if "vlm" in which:
            model, runs = vlm_rows(tmp, *(int(x) for x in args.vlm_layers.split(",")), env)
            result.update(vlm_model=model, vlm_figures=runs)
    result["hardware"] = {**hardware, "load_average_after": os.getloadavg()}
    RESULTS.mkdir(exist_ok=True)
    tag = "" if which == {"llm"} else "_" + "_".join(sorted(which))  # a partial run keeps the llm file intact
    path = RESULTS / f"convert_memory{tag}_cpu_{time.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def _table(runs: dict, baseline: str, model_bytes: int) -> None:
    """Print (and add to ``runs``) peak RSS, above the baseline and over the model's bytes, per run."""
    base = runs[baseline]["peak_rss_bytes"]
    print(f"{'run':<34} {'peak RSS GiB':>12} {'- baseline':>11} {'x model':>8} {'wall s':>7}")
    for name, r in runs.items():
        r["peak_rss_gib"] = round(r["peak_rss_bytes"] / GIB, 2)
        r["above_baseline_gib"] = round((r["peak_rss_bytes"] - base) / GIB, 3)
        r["x_model_bytes"] = round((r["peak_rss_bytes"] - base) / model_bytes, 2)
        print(f"{name:<34} {r['peak_rss_gib']:>12.2f} {r['above_baseline_gib']:>11.3f} {r['x_model_bytes']:>8.2f} "
              f"{r['wall_s']:>7.1f}")


if __name__ == "__main__":
    main()
