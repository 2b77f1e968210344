"""Messages that name what the user has: a manifest entry that is a symlink loop is that entry's problem (one
line for a conversion, a ✗ line of verify's report), never `internal error`. Run through the real CLI in a
child process under a 6 GB address-space cap and a 60 s limit."""

from __future__ import annotations

import json
import os

from safety_common import assert_one_line_error, copy_of, rank_file, run_cli_capped


def _loop(path) -> None:
    """Replace `path` with a symlink loop (path -> loop -> path)."""
    path.unlink()
    os.symlink(path.name + ".loop", path)
    os.symlink(path.name, path.with_name(path.name + ".loop"))


def test_a_manifest_entry_through_a_symlink_loop_is_one_line_naming_it(tmp_path):
    ckpt = copy_of("ckpt", tmp_path / "ckpt", manifest=True)
    f = rank_file(ckpt, 0, 0)
    _loop(f)
    code, _, err = run_cli_capped(["megatron-to-hf", ckpt, tmp_path / "out"])
    assert_one_line_error(code, err, str(f), "unreadable", "symbolic links", "re-copy")
    assert not (tmp_path / "out").exists()


def test_verify_reports_a_listed_file_that_is_a_symlink_loop(tmp_path):
    """verify prints its report: the manifest check names the entry, the generation config check too."""
    ref = copy_of("ref", tmp_path / "ref", manifest=True)
    _loop(ref / "generation_config.json")
    code, _, err = run_cli_capped(["verify", ref])
    assert code == 1 and "Traceback" not in err and "internal error" not in err, err
    bad = [ln for ln in err.splitlines() if "✗" in ln]
    assert any("manifest" in ln and "generation_config.json" in ln and "symbolic links" in ln for ln in bad), err
    assert any("generation-config" in ln and "symbolic links" in ln for ln in bad), err


def test_an_intact_export_verifies_its_manifest(tmp_path):
    """The benign neighbour: the same export, unchanged, passes the manifest check."""
    ref = copy_of("ref", tmp_path / "ref", manifest=True)
    _, out, err = run_cli_capped(["verify", ref, "--json"])
    assert "Traceback" not in err, err
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["manifest"]["status"] == "ok"


def test_a_damaged_torch_dist_object_is_named_by_its_data_file_not_a_scratch_file(tmp_path):
    """A torch_dist object (the rng state) is loaded from a scratch copy of its bytes; an error names the
    `.distcp` file and byte range it came from, never the scratch file that is gone once the line is read."""
    from mconvert.convert.verbs import reshard
    from mconvert.convert.megatron.torch_dist import TorchDistSource
    from mconvert.trainer.train import TrainConfig, train

    train(TrainConfig(preset="tiny-llama", tp=1, pp=1, steps=1, save=str(tmp_path / "t"), quiet=True,
                      device="cpu", global_batch_size=4, seq_length=16))  # the trainer saves an rng state
    d = tmp_path / "dist"
    reshard(tmp_path / "t", d, tp=1, pp=1, format="torch_dist")
    (d / "mconvert-manifest.json").unlink()  # the manifests would refuse the damage first, by their digests
    (d / "iter_0000001" / "integrity.json").unlink()
    src = TorchDistSource(d)
    key = next(iter(src._rng.values()))
    info = next(v for k, v in src.metadata.storage_data.items() if getattr(k, "fqn", None) == key)
    data = src.iter_dir / info.relative_path
    src.close()
    with open(data, "r+b") as f:  # one bit inside the object's torch.save zip: its CRC-32 fails
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([b[0] ^ 1]))
    code, _, err = run_cli_capped(["reshard", d, tmp_path / "out", "--tp", "1", "--pp", "1"])
    line = assert_one_line_error(code, err, str(data), repr(key), "CRC-32")
    assert "mconvert-objects-" not in line
