"""The pieces of ``vla_throughput.py``: its dataset, the offline stand-ins lerobot needs, and how each row runs.

Everything here runs in the benchmark's child processes (``--prepare`` and ``--worker``), never in the parent,
so the parent imports neither torch nor lerobot.

Offline stand-ins (nothing can be downloaded on the device, and lerobot hard-codes hub ids):

- ``google/paligemma-3b-pt-224`` (Pi0.5's tokenizer): a word-level ``tokenizers`` tokenizer with PaliGemma's
  vocabulary *size* (257,152) and its special ids (pad 0, eos 1, bos 2, unk 3), knowing the words of this
  dataset's prompts; Pi0.5 pads every prompt to ``tokenizer_max_length`` (200), so the model sees the same
  sequence length as with the real SentencePiece tokenizer (other token ids, same cost).
- ``nvidia/Cosmos-Reason2-2B`` (GR00T N1.7's processor): the same kind of tokenizer with Qwen3-VL's vocabulary
  size and the published ids of its special tokens (``<|im_start|>`` 151644, ``<|im_end|>`` 151645,
  ``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653, ``<|image_pad|>`` 151655, ``<|video_pad|>`` 151656,
  which lerobot's hard-coded backbone config expects), a chat template that writes the same image markers as
  Qwen3-VL's, and ``Qwen2VLImageProcessor`` / ``Qwen3VLVideoProcessor`` configs written from Qwen3-VL's
  published values (patch 16, merge 2, temporal patch 2, mean = std = 0.5, min 65,536 / max 16,777,216 pixels).
- The GR00T N1.7 base model folder that ``GrootPolicy`` always loads (``GR00TN17.from_pretrained``): lerobot's own
  ``GR00TN17(GR00TN17Config(), load_backbone_weights=False)`` (the published N1.7 shape, random weights) saved
  with ``save_pretrained`` in bf16, as nvidia/GR00T-N1.7-3B is stored (no ``processor_config.json`` /
  ``statistics.json`` sidecars: lerobot then takes the action horizon 40 and the dataset's own stats).
- GR00T N1.6's Eagle-Block2A-2B-v2 tokenizer, for Loong's row only: the same kind of tokenizer with Qwen3-1.7B's
  151,680 ids, ``<IMG_CONTEXT>`` at 151669 (``<img>`` / ``</img>`` at free ids).

These are stand-ins of the right shape, not the real files: figures measured with them are throughput and memory,
never accuracy.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _env import run_child  # benchmarks/_env.py (vla_throughput.py runs from the repo root)

ROOT = Path(__file__).resolve().parent.parent
REVISION = "0" * 40  # the snapshot revision of every seeded hub cache entry
PALIGEMMA = "google/paligemma-3b-pt-224"
COSMOS = "nvidia/Cosmos-Reason2-2B"
PALIGEMMA_VOCAB = 257_152
QWEN3_VL_VOCAB = 151_936
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
                 "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656}
PALIGEMMA_SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
# Qwen3-VL's chat template as far as an image+text user turn goes (the markers are what the processor expands)
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_IMAGE_PROCESSOR = dict(patch_size=16, temporal_patch_size=2, merge_size=2,
                            size={"shortest_edge": 65_536, "longest_edge": 16_777_216},
                            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
PROMPT_WORDS = ["Task", "State", "Action", "reach", "the", "target", "red", "green", "blue", "yellow", "user",
                "assistant", "system", "You", "are", "a", "helpful", "image", ":", ",", ";", ".", "-", "<", ">",
                *map(str, range(256))]


# ------------------------------------------------------------------------------------------------ stand-ins


def wordlevel_tokenizer(vocab_size: int, specials: dict[str, int], *, unk: str, pad: str, bos: str | None,
                        eos: str, chat_template: str | None = None, prepend_bos: bool = False) -> Any:
    """A ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` ids: ``specials`` at their ids, the prompt words
    at the first free ids, filler tokens for the rest (so every id the model's embedding has is a token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = dict(specials)
    taken = set(specials.values())
    free = (i for i in range(vocab_size) if i not in taken)
    for word in PROMPT_WORDS:
        vocab.setdefault(word, next(free))
    for i in free:
        vocab[f"<filler_{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if prepend_bos:  # PaliGemma's tokenizer starts every prompt with <bos>
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, pad_token=pad, bos_token=bos, eos_token=eos,
                                   additional_special_tokens=[s for s in specials if s not in (unk, pad, bos, eos)])
    if chat_template:
        fast.chat_template = chat_template
    return fast


def _seed(cache: Path, repo_id: str) -> Path:
    """The snapshot folder of ``repo_id`` in the hub cache ``cache`` (``$HF_HOME/hub``), with ``refs/main``."""
    base = cache / f"models--{repo_id.replace('/', '--')}"
    snap = base / "snapshots" / REVISION
    snap.mkdir(parents=True, exist_ok=True)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(REVISION)
    return snap


def seed_hub_cache(hf_home: Path) -> dict[str, str]:
    """Seed ``$HF_HOME/hub`` with the PaliGemma tokenizer and Cosmos-Reason2 processor stand-ins."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    cache = hf_home / "hub"
    pali = _seed(cache, PALIGEMMA)
    wordlevel_tokenizer(PALIGEMMA_VOCAB, PALIGEMMA_SPECIALS, unk="<unk>", pad="<pad>", bos="<bos>",
                        eos="<eos>", prepend_bos=True).save_pretrained(pali)
    (pali / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    cosmos = _seed(cache, COSMOS)
    specials = {"<|unk|>": 151657, **QWEN_SPECIALS}  # an unk for unknown words; Qwen's byte BPE has none
    qwen_tok = wordlevel_tokenizer(151_669, specials, unk="<|unk|>", pad="<|endoftext|>", bos=None, eos="<|im_end|>",
                                   chat_template=QWEN_CHAT_TEMPLATE)
    # the whole processor too, so that AutoProcessor.from_pretrained(folder) loads it (Loong's GR00T N1.7 may)
    Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**QWEN_IMAGE_PROCESSOR), tokenizer=qwen_tok,
                     video_processor=Qwen3VLVideoProcessor(**QWEN_IMAGE_PROCESSOR),
                     chat_template=QWEN_CHAT_TEMPLATE).save_pretrained(cosmos)
    qwen_tok.save_pretrained(cosmos)
    (cosmos / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    # GR00T N1.6's Eagle-Block2A-2B-v2 tokenizer (Qwen3-1.7B's, 151,680 ids, <IMG_CONTEXT> 151669): a local folder,
    # which Loong's config names (no baseline loads it)
    eagle = hf_home.parent / "standins" / "eagle_block2a_2b_v2_tokenizer"
    eagle_specials = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<img>": 151670,
                      "</img>": 151671, "<IMG_CONTEXT>": 151669, "<unk>": 151672}
    wordlevel_tokenizer(151_680, eagle_specials, unk="<unk>", pad="<|endoftext|>", bos=None,
                        eos="<|im_end|>").save_pretrained(eagle)
    return {PALIGEMMA: str(pali), COSMOS: str(cosmos), "eagle_tokenizer": str(eagle)}


def tiny_qwen3_vl_dir(folder: Path) -> Path:
    """A two-layer Qwen3-VL config folder (GR00T's backbone in ``--smoke``) with Qwen's special ids."""
    from transformers import Qwen3VLConfig

    Qwen3VLConfig(
        text_config=dict(vocab_size=QWEN3_VL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                                          "rope_theta": 1e4}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1]),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        tie_word_embeddings=True,
    ).save_pretrained(folder)
    return folder


#: GR00T N1.7 in ``--smoke``: lerobot's config with the tiny backbone and a two-layer DiT (the research recipe)
TINY_GROOT = dict(backbone_embedding_dim=64, select_layer=2, hidden_size=32, input_embedding_dim=32, max_state_dim=16,
                  max_action_dim=16, action_horizon=8, max_seq_len=64, model_dtype="float32", dtype="float32",
                  diffusion_model_cfg=dict(positional_embeddings=None, num_layers=2, num_attention_heads=2,
                                           attention_head_dim=16, norm_type="ada_norm", dropout=0.0, final_dropout=True,
                                           output_dim=32, interleave_self_attention=True),
                  vl_self_attention_cfg=dict(positional_embeddings=None, num_layers=1, num_attention_heads=2,
                                             attention_head_dim=32, dropout=0.0, final_dropout=True))


def write_groot_base(folder: Path, smoke: bool) -> dict[str, Any]:
    """lerobot's GR00T N1.7 at the published shape (``GR00TN17Config()``; tiny in ``--smoke``), random weights, saved
    where ``--policy.base_model_path`` points. Built on the GPU when there is one (3B weights drawn on the host
    take minutes)."""
    import torch
    from lerobot.policies.groot.groot_n1_7 import GR00TN17, GR00TN17Config

    kwargs = dict(TINY_GROOT, model_name=str(tiny_qwen3_vl_dir(folder.parent / "tiny_qwen3_vl"))) if smoke else {}
    config = GR00TN17Config(**kwargs)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    with torch.device(device):
        model = GR00TN17(config, load_backbone_weights=False)
    params = sum(p.numel() for p in model.parameters())
    if not smoke:  # saved in bf16 as the published checkpoint is (GrootPolicy casts to fp32: model_params_fp32)
        model.to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"path": str(folder), "parameters": params, "built_on": device, "seconds": round(time.time() - t0, 1)}


def prepare(work: Path, *, smoke: bool, image_size: int, episodes: int, noise: float, max_steps: int,
            groot: bool) -> dict[str, Any]:
    """The dataset (once per settings), the seeded hub cache and, if a GR00T lerobot row runs, its base folder."""
    from loong.embodied.data.synthetic import write_reach_dataset

    work.mkdir(parents=True, exist_ok=True)
    name = f"reach_{image_size}px_n{episodes}_noise{noise:g}_max{max_steps}"
    dataset = work / "datasets" / name
    t0 = time.time()
    if not (dataset / "meta" / "info.json").is_file():
        shutil.rmtree(dataset, ignore_errors=True)
        write_reach_dataset(dataset, num_episodes=episodes, image_size=image_size, use_videos=True, noise=noise,
                            max_steps=max_steps, progress=False)
    info = json.loads((dataset / "meta" / "info.json").read_text())
    out: dict[str, Any] = {
        "dataset": {"root": str(dataset), "frames": info["total_frames"], "episodes": info["total_episodes"],
                    "features": {k: v["shape"] for k, v in info["features"].items()},
                    "codec": {k: (v.get("info") or {}).get("video.codec") for k, v in info["features"].items()
                              if v.get("dtype") == "video"},
                    "seconds": round(time.time() - t0, 1)},
        "hf_home": str(work / "hf"),
        "stand_ins": seed_hub_cache(work / "hf"),
    }
    if groot:
        base = work / ("groot_n1_7_base_tiny" if smoke else "groot_n1_7_base")
        if not (base / "config.json").is_file():
            shutil.rmtree(base, ignore_errors=True)
            out["groot_base"] = write_groot_base(base, smoke)
        else:
            out["groot_base"] = {"path": str(base), "reused": True}
    return out


# ------------------------------------------------------------------------------------------------ measuring


class SmiPeak:
    """The most GPU memory ``nvidia-smi`` reports in use on GPU 0 while the block runs, less what was in use when
    it began (so the child's CUDA context, caching-allocator reserve and workers' CUDA use are in it: more than
    the frameworks' own ``max_memory_allocated``). ``peak_gib`` is None without ``nvidia-smi``."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.peak_gib: float | None = None
        self._stop = threading.Event()

    @staticmethod
    def _used_mib() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=10)
            return float(out.stdout.strip().splitlines()[0]) if out.returncode == 0 else None
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _poll(self, base: float) -> None:
        top = base
        while not self._stop.wait(self.interval_s):
            used = self._used_mib()
            if used is not None and used > top:
                top = used
                self.peak_gib = round((top - base) / 1024, 2)

    def __enter__(self) -> SmiPeak:
        base = self._used_mib()
        if base is not None:
            self.peak_gib = 0.0
            self._thread = threading.Thread(target=self._poll, args=(base,), daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if hasattr(self, "_thread"):
            self._thread.join()


def figures(step_s: list[float], data_s: list[float | None], losses: list[float], *, warmup: int, batch: int,
            peak_gib: float | None, peak_source: str, smi_gib: float | None) -> dict[str, Any]:
    """Medians over the steps after ``warmup`` (a step's time includes its data wait)."""
    if len(step_s) <= warmup:
        raise RuntimeError(f"only {len(step_s)} steps were logged; nothing after --warmup {warmup} to time")
    steady = step_s[warmup:]
    waits = [d for d in data_s[warmup:] if d is not None]
    s = statistics.median(steady)
    return {"s_per_step": round(s, 4), "samples_per_s": round(batch / s, 2),
            "data_wait_s": round(statistics.median(waits), 4) if waits else None,
            "peak_memory_gib": peak_gib, "peak_memory_source": peak_source, "nvidia_smi_peak_gib": smi_gib,
            "loss_last": losses[-1] if losses else None, "steps_logged": len(step_s),
            "step_s": [round(x, 4) for x in step_s], "data_s": data_s, "losses": losses}


def workspace_metadata(folder: Path) -> list[str]:
    """Where ``importlib.metadata`` finds the workspace packages when they are not installed (on the device the
    repo is a plain copy on ``PYTHONPATH``): a ``<name>-<version>.dist-info`` per package under ``folder``, holding
    its ``METADATA`` and the ``entry_points.txt`` of its pyproject (the core finds tasks and accelerators through
    entry points). Empty when loong-core is installed."""
    import importlib.metadata
    import tomllib

    try:
        importlib.metadata.distribution("loong-core")
        return []
    except importlib.metadata.PackageNotFoundError:
        pass
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        info = folder / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                                       f"Version: {project['version']}\n")
        groups = project.get("entry-points", {})
        (info / "entry_points.txt").write_text("".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in groups.items()))
    return [str(folder)]


def child_env(prep: dict[str, Any]) -> dict[str, str]:
    """The environment of every training child: offline, the seeded hub cache, the workspace's packages."""
    env = dict(os.environ)
    src = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    dists = workspace_metadata(Path(prep["hf_home"]).parent / "workspace_dists")
    env["PYTHONPATH"] = os.pathsep.join([*src, *dists, *filter(None, [env.get("PYTHONPATH")])])
    env.update(HF_HOME=prep["hf_home"], HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", SVT_LOG="1", PYTHONUNBUFFERED="1")
    return env


def _shell(cmd: list[str], env_keys: tuple[str, ...] = ("HF_HOME", "HF_HUB_OFFLINE")) -> str:
    return " ".join([*(f"{k}=${k}" for k in env_keys), *cmd])


# ------------------------------------------------------------------------------------------------ lerobot-train

_KV = re.compile(r"([A-Za-z_/]+):(\S+)")


def parse_lerobot_log(text: str) -> list[dict[str, float]]:
    """lerobot-train's per-log-step lines (``step:.. loss:.. updt_s:.. data_s:.. mem_gb:..``), one per step with
    ``--log_freq=1`` (its averages then cover one step each)."""
    recs = []
    for line in text.splitlines():
        if "updt_s:" not in line or "data_s:" not in line:
            continue
        kv = dict(_KV.findall(line[line.index("step:"):] if "step:" in line else line))
        rec = {}
        for key in ("loss", "grdn", "updt_s", "data_s", "mem_gb", "smp/s"):
            try:
                rec[key] = float(kv[key])
            except (KeyError, ValueError):
                pass
        recs.append(rec)
    return recs


def lerobot_command(policy: str, args: Any, prep: dict[str, Any], out: Path, extra: list[str]) -> list[str]:
    """``lerobot-train`` (as ``python -m lerobot.scripts.lerobot_train``: the console script of a ``--target``
    install is not on PATH) with the policy's defaults, the benchmark's dataset, batch, steps and workers."""
    import torch

    gpu = torch.cuda.is_available()
    cmd = [sys.executable, "-m", "lerobot.scripts.lerobot_train", "--dataset.repo_id=loong/reach_synthetic",
           f"--dataset.root={prep['dataset']['root']}", "--dataset.video_backend=pyav", f"--policy.type={policy}",
           f"--policy.device={'cuda' if gpu else 'cpu'}", "--policy.push_to_hub=false", f"--batch_size={args.batch}",
           f"--steps={args.steps}", f"--num_workers={args.workers}", "--log_freq=1", "--save_checkpoint=false",
           "--wandb.enable=false", f"--output_dir={out}", f"--seed={args.seed}"]
    if policy == "pi05":
        cmd.append("--policy.dtype=bfloat16" if gpu else "--policy.dtype=float32")
    if policy == "groot":
        cmd.append(f"--policy.base_model_path={prep['groot_base']['path']}")
        if args.smoke:  # the tiny base's widths and horizon (GrootConfig's defaults are the published 132 / 40)
            cmd += ["--policy.max_state_dim=16", "--policy.max_action_dim=16", "--policy.chunk_size=8",
                    "--policy.n_action_steps=8"]
    return cmd + extra


def run_lerobot(policy: str, args: Any, prep: dict[str, Any], tmp: Path, extra: list[str]) -> dict[str, Any]:
    cmd = lerobot_command(policy, args, prep, tmp / "lerobot_out", extra)
    with SmiPeak() as smi:
        proc = run_child(cmd, env=child_env(prep))
    log = proc.stdout + "\n" + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"lerobot-train exited {proc.returncode}:\n{log[-4000:]}")
    recs = parse_lerobot_log(log)
    if not recs:
        raise RuntimeError(f"no step lines in lerobot-train's log:\n{log[-3000:]}")
    step_s = [r["updt_s"] + r["data_s"] for r in recs]
    mem = [r["mem_gb"] for r in recs if "mem_gb" in r]
    out = figures(step_s, [r["data_s"] for r in recs], [r["loss"] for r in recs if "loss" in r], warmup=args.warmup,
                  batch=args.batch, peak_gib=round(max(mem) * 1e9 / 2**30, 2) if mem else None,
                  peak_source="lerobot's mem_gb (torch.cuda.max_memory_allocated within each step; GiB here)",
                  smi_gib=smi.peak_gib)
    out["lerobot_mem_gb_max"] = max(mem) if mem else None
    out["command"] = _shell([c.replace(sys.executable, "python") for c in cmd])
    out["parameters_log"] = [line.strip() for line in log.splitlines()
                             if "learnable params" in line or "num_total_params" in line or "Total params" in line][:4]
    return out


# ------------------------------------------------------------------------------------------------ loong-embodied

#: how many lines of the profiler's operator table a row keeps
PROFILE_LINES = 60
#: keys of a metrics record that may hold the data wait of a step (whichever the task logs; None when none does)
LOONG_DATA_KEYS = ("data_wait_s", "data_s", "data_time_s", "data_wait")


def loong_command(policy: str, preset: str, args: Any, prep: dict[str, Any], out: Path,
                  extra: list[str]) -> list[str]:
    import torch

    gpu = torch.cuda.is_available()
    # the policy option (policy=pi05, policy=groot_n1_7_tiny, ...) as a user picks it: the published ones carry the
    # published schedule (only the lr differs from `model.policy=... model.preset=...`; step time does not)
    option = f"{policy}_tiny" if preset == "tiny" else preset
    return [sys.executable, "-m", "loong.embodied.cli", "train", f"policy={option}",
            f"data.repo_root={prep['dataset']['root']}", f"train.global_batch_size={args.batch}",
            f"train.micro_batch_size={args.batch}", f"train.steps={args.steps}",
            f"train.precision={'bf16' if gpu else 'fp32'}", f"data.num_workers={args.workers}",
            f"train.seed={args.seed}", "train.log_interval=1", "train.progress=false", "train.save_final=false",
            "train.resume=none", "train.eval_interval=0", "train.eval_iters=0", f"output_dir={out}", "run_name=bench",
            *extra]


def standin_overrides(policy: str, prep: dict[str, Any], smoke: bool) -> list[str]:
    """Where each published Loong preset finds its tokenizer / processor: the stand-ins (the tiny presets build
    theirs in-process)."""
    if smoke:
        return []
    s = prep["stand_ins"]
    return {"pi05": [f"model.config.tokenizer={s[PALIGEMMA]}"],
            "groot_n1_7": [f"model.config.processor={s[COSMOS]}"],
            "groot_n1_6": [f"model.config.tokenizer={s['eagle_tokenizer']}"]}.get(policy, [])


def run_loong(policy: str, preset: str, args: Any, prep: dict[str, Any], tmp: Path,
              extra: list[str]) -> dict[str, Any]:
    extra = [*standin_overrides(policy, prep, args.smoke), *extra]
    cmd = loong_command(policy, preset, args, prep, tmp / "loong_out", extra)
    with SmiPeak() as smi:
        proc = run_child(cmd, env=child_env(prep))
    if proc.returncode:
        raise RuntimeError(f"loong-embodied train exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    paths = sorted(glob.glob(str(tmp / "loong_out" / "**" / "metrics.jsonl"), recursive=True))
    if not paths:
        raise RuntimeError(f"no metrics.jsonl under {tmp / 'loong_out'}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    recs = [json.loads(x) for x in Path(paths[-1]).read_text().splitlines() if x.strip()]
    recs = [r for r in recs if "train_loss" in r]
    # step i's wall time: from the record of step i-1 to that of step i (log_interval=1); step 1 has none
    step_s = [b["time"] - a["time"] for a, b in zip(recs, recs[1:], strict=False)]
    key = next((k for k in LOONG_DATA_KEYS if any(k in r for r in recs)), None)
    data_s = [r.get(key) for r in recs[1:]] if key else [None] * len(step_s)
    peaks = [r["peak_memory_gib"] for r in recs if r.get("peak_memory_gib") is not None]
    out = figures(step_s, data_s, [r["train_loss"] for r in recs[1:]], warmup=max(args.warmup - 1, 0),
                  batch=args.batch, peak_gib=max(peaks) if peaks else None,
                  peak_source="Loong's peak_memory_gib (torch.cuda.max_memory_allocated since the loop began)",
                  smi_gib=smi.peak_gib)
    out["data_wait_key"] = key
    # train.profile_steps (e.g. --loong-extra 'train.profile_steps=[14,15]'): the profiler's operator table (by
    # device time) into the JSON, since the run folder is a temporary one
    ops = sorted(glob.glob(str(tmp / "loong_out" / "**" / "profile" / "ops.txt"), recursive=True))
    if ops:
        out["profile_ops"] = Path(ops[-1]).read_text().splitlines()[:PROFILE_LINES]
    out["command"] = _shell([c.replace(sys.executable, "python") for c in cmd])
    out["first_record"] = recs[0] if recs else None
    return out
