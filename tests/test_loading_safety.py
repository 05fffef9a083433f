"""Safety of loading (issue 25): no package source unpickles a checkpoint or data file except through
``torch.load(..., weights_only=True)``, and nothing turns ``trust_remote_code`` on.

The scan reads every ``packages/*/src/**/*.py`` file; a new unguarded call fails this test until it is guarded or
added to ``ALLOWED`` with the reason it is safe.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (path relative to the repo, the exact stripped source line) -> why it is safe.
ALLOWED: dict[tuple[str, str], str] = {
    (
        "packages/loong-core/src/loong/core/checkpoint/inspect.py",
        'state = torch.load(f"{tmp}/all.pt", weights_only=False)  # written just now by DCP from our own shards',
    ): "reads a file that dcp_to_torch_save wrote a line earlier into a private temporary directory",
}

UNSAFE_PATTERNS = {
    "torch.load without weights_only=True": re.compile(r"torch\.load\((?![^)]*weights_only=True)"),
    "pickle.load / pickle.loads": re.compile(r"\bpickle\.loads?\("),
    "trust_remote_code=True": re.compile(r"trust_remote_code\s*=\s*True"),
}


def _source_files() -> list[Path]:
    return sorted(REPO.glob("packages/*/src/**/*.py"))


def test_scan_covers_every_package() -> None:
    packages = {p.relative_to(REPO).parts[1] for p in _source_files()}
    assert {"loong-core", "loong-llm"} <= packages, packages


def test_no_unguarded_unpickling_or_remote_code() -> None:
    found: list[str] = []
    used_allowances: set[tuple[str, str]] = set()
    for path in _source_files():
        rel = str(path.relative_to(REPO))
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith("#"):
                continue
            for what, pattern in UNSAFE_PATTERNS.items():
                if pattern.search(stripped):
                    if (rel, stripped) in ALLOWED:
                        used_allowances.add((rel, stripped))
                    else:
                        found.append(f"{rel}:{lineno}: {what}: {stripped}")
    assert not found, "unguarded loading (guard it or add it to ALLOWED with a reason):\n" + "\n".join(found)
    stale = set(ALLOWED) - used_allowances
    assert not stale, f"ALLOWED entries that no longer match any source line: {sorted(stale)}"


def test_patterns_catch_what_they_name() -> None:
    """The scanner itself is an oracle: each pattern fires on the unsafe form and not on the guarded one."""
    torch_load = UNSAFE_PATTERNS["torch.load without weights_only=True"]
    assert torch_load.search('torch.load(path, map_location="cpu")')
    assert torch_load.search("torch.load(path, weights_only=False)")
    assert not torch_load.search('torch.load(path, map_location="cpu", weights_only=True)')
    assert UNSAFE_PATTERNS["pickle.load / pickle.loads"].search("obj = pickle.loads(blob)")
    assert UNSAFE_PATTERNS["trust_remote_code=True"].search("AutoModel.from_pretrained(p, trust_remote_code = True)")
    assert not UNSAFE_PATTERNS["trust_remote_code=True"].search("trust_remote_code=False")
