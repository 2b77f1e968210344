"""Shared helpers of the safety tests: a correct tiny checkpoint (made by transformers + our hf-to-megatron),
its reference conversion, damaged copies of it, and running the real CLI in-process.

Everything built here is cached per test process (the base checkpoint is built once and copied per case).
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import torch
from scratch import scratch_dir

ROOT = Path(__file__).resolve().parents[2]
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
_WORK = scratch_dir("mconvert-safety-", __name__)


def make_hf_llama(out: Path, layers: int = 2, hidden: int = 64, ffn: int = 128, heads: int = 4, groups: int = 2,
                  vocab: int = 100, seed: int = 0) -> Path:
    """A random tiny LlamaForCausalLM saved by transformers itself (truth we did not write)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=groups, vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=False,
        head_dim=hidden // heads,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def big_llama_hf() -> Path:
    """A ~7M-parameter (29 MB) Llama HF dir, long enough to convert to be signalled mid-run: config by
    transformers, shapes from its meta-device model, random data. Built once per session, read-only."""
    import transformers
    from safetensors.torch import save_file

    out = _WORK / "big-hf"
    if out.exists():
        return out
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=2000, max_position_embeddings=128,
                                   tie_word_embeddings=False, head_dim=64)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    out.mkdir()
    save_file({k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    cfg.save_pretrained(out)
    return out


@lru_cache(maxsize=None)
def base() -> dict[str, Path]:
    """{'hf': tiny HF llama, 'ckpt': its Megatron TP=2 PP=2 checkpoint, 'ref': ckpt converted back to HF}."""
    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf

    hf = make_hf_llama(_WORK / "hf")
    ckpt = _WORK / "ckpt"
    hf_to_megatron(hf, ckpt, tp=2, pp=2)
    ref = _WORK / "ref"
    megatron_to_hf(ckpt, ref)
    return {"hf": hf, "ckpt": ckpt, "ref": ref}


def copy_of(which: str, dst: Path, manifest: bool = False) -> Path:
    """A private copy of base()[which] to damage; without mconvert's manifest unless asked (like a checkpoint
    Megatron-LM or transformers wrote: with the manifest, any changed byte is refused before reading)."""
    shutil.copytree(base()[which], dst)
    if not manifest:
        (dst / "mconvert-manifest.json").unlink(missing_ok=True)
    return dst


def rank_file(ckpt: Path, tp: int, pp: int) -> Path:
    return ckpt / "release" / f"mp_rank_{tp:02d}_{pp:03d}" / "model_optim_rng.pt"


def load_rank(path: Path) -> dict:
    from mconvert.io.safeload import safe_load

    state = safe_load(path)
    # materialize: the file is memory-mapped and about to be rewritten
    return {k: ({n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in v.items()} if k == "model" else v)
            for k, v in state.items()}


def save_rank(path: Path, state: dict) -> None:
    torch.save(state, path)


def hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run `mconvert ARGV` in-process through the console-script entry; (exit code, stdout, stderr)."""
    from mconvert.cli import main

    capsys.readouterr()
    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *must_contain: str, details: int | None = 0) -> str:
    """Non-zero exit, no traceback, and the error as the CLI prints it: the first non-empty stderr line starts with
    `error:` (the whole message, or the summary of a refusal naming several items), followed by exactly `details`
    lines indented by two spaces (one per item; the summary counts them; None: as many as the summary counts, for
    an input that may break several fields at once). Each of `must_contain` is somewhere in those lines; returns
    them joined by newlines (one line when `details` is 0)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0, f"exit code 0; stderr: {err!r}"
    if details is None:
        details = len(lines) - 1
    assert len(lines) == 1 + details, f"expected {1 + details} stderr lines, got {len(lines)}:\n{err}"
    line = lines[0]
    assert line.startswith("error: "), line
    assert "Traceback" not in err, err
    assert "set MCONVERT_DEBUG=1 for the traceback" not in line, f"a bug, not a refusal: {line}"
    if details:
        assert all(ln.startswith("  ") and not ln.startswith("   ") for ln in lines[1:]), err
        assert f": {details} " in line and " are refused (" in line, f"the summary does not count {details}: {line}"
    text = "\n".join(lines)
    for s in must_contain:
        assert s.lower() in text.lower(), f"{s!r} not in {text!r}"
    return text


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def mount_tmpfs(d: Path, opts: str) -> bool:
    """Mount a tmpfs with `opts` (`size=64k`, `ro,size=64k`) on `d` (created); False when not root or no mount."""
    d.mkdir(parents=True, exist_ok=True)
    if not is_root() or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True).returncode == 0


def umount(d: Path) -> None:
    """Unmount `d` (lazily when still busy)."""
    gc.collect()  # a failed writer's file object may still hold the mount busy
    if subprocess.run(["umount", str(d)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def add_adam_states(root: Path) -> None:
    """An Adam state in every rank file of checkpoint `root` whose moments are functions of the parameter
    itself (exp_avg = p / 2, exp_avg_sq = p²): wherever a re-shard puts a parameter, its moments must come
    along unchanged. The manifest goes: the files are ours to change."""
    from mconvert.io.atomic import MANIFEST
    from mconvert.io.safeload import safe_load
    from mconvert.layouts.megatron import save_rank_file

    for f in sorted((root / "release").glob("mp_rank_*/model_optim_rng.pt")):
        state = safe_load(f)
        names = [k for k, v in state["model"].items() if isinstance(v, torch.Tensor)]
        state["optimizer"] = {
            "state": {i: {"step": torch.tensor(7.0), "exp_avg": state["model"][n] / 2,
                          "exp_avg_sq": state["model"][n] ** 2} for i, n in enumerate(names)},
            "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0,
                              "params": list(range(len(names))), "param_names": names}],
        }
        save_rank_file(f, state)
        del state
    (root / MANIFEST).unlink(missing_ok=True)


def flip_record_padding(path: Path) -> None:
    """Flip the last byte of the largest zip record's local-header extra field in rank file `path`: the
    alignment padding torch.save writes, which neither torch.load nor the record's CRC-32 look at (only the
    manifest sees the change)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        assert extra_len > 4  # torch.save pads each record's data to 64 bytes with an extra field
        at = info.header_offset + 30 + name_len + extra_len - 1
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


CAP_BYTES = 6 << 30  # the address space a refusal must fit in
CAP_SECONDS = 60  # and the time


def run_cli_capped(argv: list[str], cap: int = CAP_BYTES, timeout: float = CAP_SECONDS,
                   env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run `mconvert ARGV` in a child process under an address-space cap (RLIMIT_AS) and a wall-clock limit:
    (exit code, stdout, stderr). A run past `timeout` fails the test (a hang is never a refusal)."""
    import resource

    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    code = "from mconvert.cli import run; run()"
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    r = subprocess.run([sys.executable, "-c", code, *[str(a) for a in argv]], capture_output=True, text=True,
                       timeout=timeout, preexec_fn=cap_memory, env=full_env, cwd=str(ROOT))
    return r.returncode, r.stdout, r.stderr


def sha_tree(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under `root`, mconvert's manifest left out."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "mconvert-manifest.json"}
