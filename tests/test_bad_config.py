"""The bad-config corpus: every CLI's ``train`` refuses a bad value with exit code 2, one ``error:`` line naming the
dotted key, the value and what is allowed, no traceback, and nothing written (no output directory, nothing in the
working directory). It drives every modality's CLI, hence the repository root (no package's own tests may need a
sibling it does not depend on: each package's tests run against its wheel alone, scripts/release.py).

The checks are the schemas' (``loong.core.config.schema``: the annotations' ``Check``/``Literal`` and the
``validate`` methods) and, for what needs the model, the tasks'. Each case runs the real CLI in-process
(``main([...])``), so the corpus costs a config composition per case, not a process start.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loong.diffusion.cli import main as diffusion_main
from loong.embodied.cli import main as embodied_main
from loong.llm.cli import main as llm_main
from loong.vlm.cli import main as vlm_main

CLIS = {"loong-llm": llm_main, "loong-diffusion": diffusion_main, "loong-vlm": vlm_main,
        "loong-embodied": embodied_main}
MISSING = "/nonexistent/loong-test-path"

#: (cli, overrides, the error line's text after "error: ")
CASES = [
    # loong-llm: the core's train / data / parallel / precision keys
    ("loong-llm", ["train.steps=-5"], "train.steps=-5: must be >= 1"),
    ("loong-llm", ["train.steps=0"], "train.steps=0: must be >= 1"),
    ("loong-llm", ["train.micro_batch_size=0"], "train.micro_batch_size=0: must be >= 1"),
    ("loong-llm", ["train.global_batch_size=6", "train.micro_batch_size=4"],
     "train.global_batch_size=6 is not divisible by train.micro_batch_size=4"),
    ("loong-llm", ["train.lr=nan"], "train.lr=nan: must be a finite number"),
    ("loong-llm", ["train.clip_grad=inf"], "train.clip_grad=inf: must be a finite number"),
    ("loong-llm", ["train.weight_decay=-0.1"], "train.weight_decay=-0.1: must be >= 0"),
    ("loong-llm", ["train.adam_beta2=1.5"], "train.adam_beta2=1.5: must be in [0, 1)"),
    ("loong-llm", ["train.adam_eps=0"], "train.adam_eps=0.0: must be > 0"),
    ("loong-llm", ["train.warmup_steps=-1"], "train.warmup_steps=-1: must be >= 0"),
    ("loong-llm", ["train.log_interval=0"], "train.log_interval=0: must be >= 1"),
    ("loong-llm", ["train.eval_interval=-1"], "train.eval_interval=-1: must be >= 0 (0: never)"),
    ("loong-llm", ["train.keep_last=-2"], "train.keep_last=-2: must be >= 0 (0: keep all)"),
    ("loong-llm", ["train.time_limit_s=-1"], "train.time_limit_s=-1.0: must be >= 0 (0: none)"),
    ("loong-llm", ["train.optimizer_offload_fraction=1.5"], "train.optimizer_offload_fraction=1.5: must be in [0, 1]"),
    ("loong-llm", ["train.seed=-1"], "train.seed=-1: must be in [0, 4294967295]"),
    ("loong-llm", ["train.lr_decay_style=cosin"], "train.lr_decay_style: 'cosin' is not one of ['cosine', 'linear', "
                                                 "'constant']; did you mean 'cosine'?"),
    ("loong-llm", ["train.profile_steps=[5,2]"], "train.profile_steps=[5, 2]: give [start, end] with 1 <= start <= end"),
    ("loong-llm", ["train.profile_steps=[0,2]"], "train.profile_steps[0]=0: must be >= 1"),
    ("loong-llm", ["data.valid_fraction=1.0"], "data.valid_fraction=1.0: must be in [0, 1)"),
    ("loong-llm", ["data.split=abc"], "data.split: expected up to three non-negative train,valid,test weights"),
    ("loong-llm", ["data.balance.fit_steps=0"], "data.balance.fit_steps=0: must be >= 1"),
    ("loong-llm", ["data.balance.cost=[1,-2,3]"], "data.balance.cost[1]=-2.0: must be >= 0"),
    ("loong-llm", [f"data.tokenizer={MISSING}"],
     f"data.tokenizer={MISSING}: must be an existing folder ({MISSING} does not exist)"),
    ("loong-llm", [f"precision.fp8_table={MISSING}"],
     f"precision.fp8_table={MISSING}: must be an existing file ({MISSING} does not exist)"),
    ("loong-llm", ["parallel.tp=0"], "parallel.tp=0: must be >= 1"),
    ("loong-llm", ["parallel.vpp=2"], "parallel.vpp=2: virtual pipeline stages need pipeline parallelism"),
    ("loong-llm", ["run_name="], "run_name=: must be non-empty"),
    # loong-llm: the model's keys and the layout against the model (the tiny preset: 4 layers)
    ("loong-llm", ["model.num_layers=0"], "model.num_layers=0: must be >= 1"),
    ("loong-llm", ["model.norm_eps=0"], "model.norm_eps=0.0: must be > 0"),
    ("loong-llm", ["model.rope_theta=nan"], "model.rope_theta=nan: must be a finite number"),
    ("loong-llm", ["model.lora.dropout=1.0"], "model.lora.dropout=1.0: must be in [0, 1)"),
    ("loong-llm", [f"model.init_from_hf={MISSING}"], f"model.init_from_hf={MISSING}: must be an existing folder"),
    ("loong-llm", ["parallel.pp=8"], "parallel.pp=8: more pipeline chunks (parallel.pp x parallel.vpp) than the "
                                     "model's 4 layers"),
    ("loong-llm", ["model.num_experts=4", "parallel.ep=8"], "parallel.ep=8 is more than the model's 4 experts"),
    # rows the layout cannot split into equal parts (megatron stopped in the first forward on a bare assertion,
    # after the run directory was written): sequence parallelism, asked for or implied by a MoE model at tp > 1, CP,
    # and both (12 divides by 2 * cp and by tp, but a CP rank's 6 tokens do not split over tp=4)
    ("loong-llm", ["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_length=33"],
     "train.seq_length=33 must divide by parallel.tp=2 under sequence parallelism (parallel.sequence_parallel=true): "
     "each tensor-parallel rank holds an equal slice of every row; allowed: multiples of 2, e.g. 32 or 34"),
    ("loong-llm", ["task=sft", "parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_length=33"],
     "train.seq_length=33 must divide by parallel.tp=2 under sequence parallelism"),
    ("loong-llm", ["model=qwen3_30b_a3b_4l", "parallel.tp=2", "train.seq_length=33"],
     "train.seq_length=33 must divide by parallel.tp=2 under sequence parallelism (a MoE / MLA model runs "
     "sequence-parallel at tp > 1)"),
    ("loong-llm", ["parallel.cp=2", "train.seq_length=30"],
     "parallel.cp=2: train.seq_length=30 must divide by 2 * cp = 4 (each CP rank holds two of 2 * cp equal chunks of "
     "every row); allowed: multiples of 4, e.g. 28 or 32"),
    ("loong-llm", ["parallel.tp=4", "parallel.cp=2", "parallel.sequence_parallel=true", "model.num_query_groups=4",
                   "train.seq_length=12"],
     "train.seq_length=12 must divide by parallel.cp x parallel.tp = 8 under sequence parallelism with context "
     "parallelism (parallel.sequence_parallel=true): each tensor-parallel rank holds an equal slice of its CP rank's "
     "share of every row; allowed: multiples of 8, e.g. 8 or 16"),
    # loong-diffusion: its data / train / model keys and the core's keys under its schema
    ("loong-diffusion", ["train.steps=-5"], "train.steps=-5: must be >= 1"),
    ("loong-diffusion", ["data.frames=0"], "data.frames=0: must be >= 1"),
    ("loong-diffusion", ["data.text_drop_prob=1.5"], "data.text_drop_prob=1.5: must be in [0, 1]"),
    ("loong-diffusion", ["data.image_cond_prob=nan"], "data.image_cond_prob=nan: must be a finite number"),
    ("loong-diffusion", ["data.pack_tokens=-1"], "data.pack_tokens=-1: must be >= 0 (0: no packing)"),
    ("loong-diffusion", ["data.sizes=[]"], "data.sizes=[]: must be non-empty"),
    ("loong-diffusion", ["data.sizes=[[4,8]]"], "data.sizes[0]=[4, 8]: a latent size [frames, height, width]"),
    ("loong-diffusion", ["train.timestep_shift=0"], "train.timestep_shift=0.0: must be > 0 (1: no shift)"),
    ("loong-diffusion", ["train.timestep_sampling=gauss"], "train.timestep_sampling: 'gauss' is not one of "
                                                           "['uniform', 'logit_normal']"),
    ("loong-diffusion", ["train.preview_steps=0"], "train.preview_steps=0: must be >= 1"),
    ("loong-diffusion", ["train.ema_decay=1.0"], "train.ema_decay=1.0: must be in [0, 1) (0: off; e.g. 0.999)"),
    ("loong-diffusion", ["model.num_layers=0"], "model.num_layers=0: must be >= 1"),
    ("loong-diffusion", ["model.experts=3"], "model.experts=3: must be in [1, 2]"),
    ("loong-diffusion", ["model.boundary_ratio=1.5"], "model.boundary_ratio=1.5: must be in (0, 1)"),
    ("loong-diffusion", [f"model.init_from_diffusers={MISSING}"],
     f"model.init_from_diffusers={MISSING}: must be an existing folder"),
    ("loong-diffusion", ["parallel.dp_shard=0"], "parallel.dp_shard=0: must be >= 1 or -1 (-1: what the world leaves)"),
    # loong-vlm: its three components, the assembly and its data keys
    ("loong-vlm", ["encoder.depth=0"], "encoder.depth=0: must be >= 1"),
    ("loong-vlm", ["encoder.norm_eps=0"], "encoder.norm_eps=0.0: must be > 0"),
    ("loong-vlm", ["encoder.norm_type=batch_norm"], "encoder.norm_type: 'batch_norm' is not one of"),
    ("loong-vlm", ["encoder.parallel.tp=0"], "encoder.parallel.tp=0: must be >= 1"),
    ("loong-vlm", ["encoder.parallel.tp=2"], "encoder.parallel.tp=2 must divide parallel.tp=1"),
    ("loong-vlm", ["parallel.tp=2", "encoder.parallel.tp=2", "encoder.num_heads=1"],
     "encoder.parallel.tp=2 must divide encoder.num_heads=1"),
    ("loong-vlm", ["parallel.tp=2", "encoder.parallel.tp=2", "encoder.intermediate_size=127"],
     "encoder.parallel.tp=2 must divide encoder.intermediate_size=127"),
    ("loong-vlm", ["model=tiny_internvl", "encoder.use_qk_norm=true", "parallel.tp=2", "encoder.parallel.tp=2"],
     "encoder.parallel.tp=2 with encoder.use_qk_norm=true is not supported"),
    ("loong-vlm", ["encoder.hidden_size=33"], "encoder.hidden_size=33 is not divisible by num_heads=4"),
    ("loong-vlm", ["projector.downsample_ratio=1.5"], "projector.downsample_ratio=1.5: must be in (0, 1]"),
    ("loong-vlm", ["projector.hidden_size=-1"], "projector.hidden_size=-1: must be >= 0"),
    ("loong-vlm", ["model.lr_mult.encoder=0"], "model.lr_mult.encoder=0.0: must be > 0"),
    ("loong-vlm", ["model.freeze=[decoder]"], "model.freeze: ['decoder'] are not components"),
    ("loong-vlm", [f"model.init_from_hf={MISSING}"], f"model.init_from_hf={MISSING}: must be an existing folder"),
    ("loong-vlm", ["data.max_frames=0"], "data.max_frames=0: must be >= 1"),
    ("loong-vlm", ["data.fps=-2"], "data.fps=-2.0: must be > 0"),
    ("loong-vlm", ["data.min_pixels=0"], "data.min_pixels=0: must be >= 1"),
    ("loong-vlm", ["data.min_pixels=4096", "data.max_pixels=1024"],
     "data.min_pixels=4096 is larger than data.max_pixels=1024"),
    ("loong-vlm", ["data.synthetic_size=1"], "data.synthetic_size=1: must be >= 2"),
    ("loong-vlm", ["data.num_workers=-1"], "data.num_workers=-1: must be >= 0"),
    ("loong-vlm", [f"data.processor={MISSING}"], f"data.processor={MISSING}: must be an existing folder"),
    ("loong-vlm", ["data.overlong=cut"], "data.overlong: 'cut' is not one of"),
    # loong-embodied: the run's keys and the chosen policy's own config (model.config.*)
    ("loong-embodied", ["train.steps=0"], "train.steps=0: must be >= 1"),
    ("loong-embodied", ["model.recompute=half"], "model.recompute: 'half' is not one of"),
    ("loong-embodied", ["model.config.chunk_sise=4"], "unknown config key 'model.config.chunk_sise'"),
    ("loong-embodied", ["data.num_workers=-1"], "data.num_workers=-1: must be >= 0"),
    ("loong-embodied", ["data.synthetic_episodes=0"], "data.synthetic_episodes=0: must be >= 1"),
    ("loong-embodied", ["data.on_error=ignore"], "data.on_error: 'ignore' is not one of"),
    ("loong-embodied", ["data.video_backend=ffmpeg"], "data.video_backend: 'ffmpeg' is not one of"),
    ("loong-embodied", ["data.weights=[-1.0]"], "data.weights[0]=-1.0: must be > 0"),
]  # fmt: skip


@pytest.mark.parametrize("cli,overrides,message", CASES, ids=[f"{c}:{' '.join(o)}" for c, o, _ in CASES])
def test_bad_value_fails_cleanly(cli: str, overrides: list[str], message: str, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    rc = CLIS[cli](["train", "train.progress=false", f"output_dir={out}", *overrides])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2, (rc, captured.err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err[-3000:]
    assert lines[0][len("error: "):].startswith(message), lines[0]
    assert "Traceback" not in captured.err and captured.out == ""
    assert not out.exists(), "a refused config must not create its output directory"
    assert list(cwd.iterdir()) == [], "a refused config must not write into the working directory"


def test_the_corpus_covers_every_cli_and_many_keys() -> None:
    keys = {o.split("=")[0] for _, overrides, _ in CASES for o in overrides}
    assert {c for c, _, _ in CASES} == set(CLIS) and len(CASES) >= 40 and len(keys) >= 40
