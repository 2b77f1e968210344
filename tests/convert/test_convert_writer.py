"""One Writer protocol, one driver loop, one report: every writing verb returns the same keys (real runs and dry
runs, table and --json), the driver aborts its writer and leaves no output on an error, `--tp`/`--infer-tp`
are one option, one `--dtype` option refuses what a verb does not write by name, and sources release their
descriptors."""

from __future__ import annotations

import ast
import gc
import json
import os
from pathlib import Path

import pytest
import torch

from deploy_common import make_hf
from mconvert.convert.driver import drive, write_output
from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard
from mconvert.convert.verbs import megatron_to_ft
from mconvert.convert.verbs import to_onnx
from mconvert.convert.sources import open_source
from mconvert.convert.verbs import megatron_to_trtllm
from mconvert.convert.writer import REPORT_KEYS, Writer
from mconvert.errors import MConvertError
from mconvert.mappings.families import preset
from safety_common import run_cli


def _no_check(onnx_dir: Path, hf_dir: Path) -> tuple[float, float | None]:
    raise AssertionError("a dry run exports nothing to check")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("writer")
    hf = make_hf(preset("tiny-gpt2"), d / "hf")
    mg = d / "mg"
    hf_to_megatron(hf, mg, tp=2)
    return {"dir": d, "hf": hf, "mg": mg}


def _verbs(m: dict[str, Path], out: Path, dry_run: bool) -> dict[str, dict]:
    return {
        "megatron-to-hf": megatron_to_hf(m["mg"], out / "hf", dry_run=dry_run),
        "hf-to-megatron": hf_to_megatron(m["hf"], out / "mg", tp=2, pp=2, dry_run=dry_run),
        "reshard": reshard(m["mg"], out / "rs", tp=1, pp=2, dry_run=dry_run),
        "megatron-to-ft": megatron_to_ft(m["mg"], out / "ft", 2, dry_run=dry_run),
        "megatron-to-trtllm": megatron_to_trtllm(m["mg"], out / "trt", tp=2, dry_run=dry_run),
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dry_run", [False, True])
def test_every_writing_verb_returns_the_same_report_keys(models, tmp_path, dry_run):
    reports = _verbs(models, tmp_path, dry_run)
    if dry_run:
        reports["to-onnx"] = to_onnx(models["hf"], tmp_path / "onnx", check=_no_check, dry_run=True)
    for verb, rep in reports.items():
        assert tuple(rep)[:len(REPORT_KEYS)] == REPORT_KEYS, verb
        assert rep["verb"] == verb and rep["output"].startswith(str(tmp_path)) and rep["family"] == "gpt2"
        assert all({"path", "bytes"} <= set(f) for f in rep["files"]) and rep["files"], verb
        assert json.loads(json.dumps(rep)) == rep  # JSON as is
        assert bool(rep.get("dry_run")) == dry_run
        assert dry_run == (not any((tmp_path / n).exists() for n in ("hf", "mg", "rs", "ft", "trt", "onnx")))
    if not dry_run:  # what the report lists is what is on disk (the manifest is written at the commit, after it)
        for rep in reports.values():
            out = Path(rep["output"])
            on_disk = {str(p.relative_to(out)): p.stat().st_size for p in out.rglob("*")
                       if p.is_file() and p.name != "mconvert-manifest.json"}
            assert {f["path"]: f["bytes"] for f in rep["files"]} == on_disk
    assert reports["megatron-to-ft"].section == "gpt"  # the report's keys read as attributes too


@pytest.mark.timeout(300)
def test_deployment_dry_runs_list_the_files_a_real_run_writes(models, tmp_path):
    """FT: names and bytes exactly (FT's own file list); TensorRT-LLM: the same names, rank bytes without the
    safetensors header (so a little below the file size)."""
    manifest = "mconvert-manifest.json"
    for fn, name in ((lambda o, d: megatron_to_ft(models["mg"], o, 2, dry_run=d), "ft"),
                     (lambda o, d: megatron_to_trtllm(models["mg"], o, tp=2, dry_run=d), "trt")):
        plan = {f["path"]: f["bytes"] for f in fn(tmp_path / name, True)["files"]}
        real = {f["path"]: f["bytes"] for f in fn(tmp_path / name, False)["files"] if f["path"] != manifest}
        assert set(plan) == set(real)
        for path, planned in plan.items():
            if name == "trt" and path.endswith(".safetensors"):
                assert 0 < real[path] - planned < 16 << 10, path
            else:
                assert planned == real[path], path


class _Failing(Writer):
    """A writer that fails on the second unit and records what the driver called."""

    reads = "mcore"

    def __init__(self, tmp: Path) -> None:
        self.calls: list[str] = []
        (tmp / "partial.bin").write_bytes(b"x")

    def add(self, unit, tensors):
        self.calls.append(f"add {unit}")
        if len(self.calls) == 2:
            raise MConvertError("disk said no")

    def close(self):
        self.calls.append("close")
        return []

    def abort(self):
        self.calls.append("abort")


@pytest.mark.timeout(120)
def test_the_driver_aborts_its_writer_and_leaves_no_output(models, tmp_path):
    made: list[_Failing] = []

    def make(tmp: Path) -> _Failing:
        made.append(_Failing(tmp))
        return made[0]

    src = open_source(models["mg"])
    with pytest.raises(MConvertError, match="disk said no"):
        write_output("test", src, tmp_path / "out", make, force=False, inputs=(models["mg"],), layout="x",
                     dtype="float32", t0=0.0)
    assert made[0].calls == ["add embedding", "add 0", "abort"]  # aborted, never closed
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []  # no output, no temporary dir


def test_drive_feeds_each_unit_the_read_the_writer_names(models):
    seen: dict[str, list] = {"hf": [], "mcore": []}

    class Rec(Writer):
        def __init__(self, reads):
            self.reads = reads

        def add(self, unit, tensors):
            seen[self.reads].append(sorted(tensors)[0])

        def close(self):
            return []

        def abort(self):
            raise AssertionError("no error, no abort")

    with open_source(models["mg"]) as src:
        drive(src, Rec("hf"))
        drive(src, Rec("mcore"))
    assert seen["hf"][0] == "transformer.wpe.weight" and seen["mcore"][0] == "embedding.position_embeddings.weight"


@pytest.mark.timeout(300)
def test_tp_and_infer_tp_are_one_option_of_megatron_to_ft(models, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli(["megatron-to-ft", models["mg"], a, "--tp", "2", "--json"], capsys)[0] == 0
    code, out, _ = run_cli(["megatron-to-ft", models["mg"], b, "--infer-tp", "2", "--json"], capsys)
    assert code == 0 and json.loads(out)["infer_tp"] == 2 and json.loads(out)["layout"] == "[gpt] TP=2"
    files = sorted(p.relative_to(a) for p in a.rglob("*.bin"))
    assert files and files == sorted(p.relative_to(b) for p in b.rglob("*.bin"))
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, words", [
    (("megatron-to-ft", "--dtype", "bf16"), "--dtype 'bf16': choose fp32 or fp16 (FasterTransformer weights"),
    (("megatron-to-trtllm", "--dtype", "int8"), "--dtype 'int8': choose auto, fp32, bf16 or fp16"),
    (("megatron-to-hf", "--dtype", "fp8"), "--dtype 'fp8': choose auto, fp32, bf16 or fp16"),
    (("reshard", "--dtype", "bf16"), "No such option: --dtype"),  # reshard keeps the stored dtype
])
def test_one_dtype_option_refuses_what_a_verb_does_not_write_by_name(models, tmp_path, capsys, argv, words):
    code, out, err = run_cli([argv[0], models["mg"], tmp_path / "o", *argv[1:]], capsys)
    assert code != 0 and words in err and "Traceback" not in err and out == ""
    assert not (tmp_path / "o").exists()


def _fds(root: Path) -> list[str]:
    """The files under `root` this process holds open: other threads' descriptors (earlier tests' pools,
    pytest's own) come and go on their own, so only the source directory's are counted."""
    inside = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed between the listing and the read (the listing's own descriptor, say)
            continue
        if Path(target).is_relative_to(root):
            inside.append(target)
    return sorted(inside)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["mg", "hf"])
def test_sources_release_their_descriptors_on_close_and_when_dropped(models, which):
    root = Path(models[which]).resolve()
    gc.collect()
    before = _fds(root)
    src = open_source(models[which])
    for unit in src.units():
        src.read_mcore(unit)
    assert len(_fds(root)) > len(before)  # rank / safetensors files stay open while reading
    src.close()
    assert _fds(root) == before
    src = open_source(models[which])
    src.read_mcore(0)
    assert len(_fds(root)) > len(before)
    del src
    gc.collect()
    assert _fds(root) == before  # an unclosed source's descriptors go with it
    torch.zeros(1)  # keep torch imported for the fixture's tensors


def _writer_classes() -> list[ast.ClassDef]:
    """Every class in the package that is a writer by what it does: it names the read it takes (`reads`) and
    defines `add`."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                assigned = {t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                            and n.value is not None  # the contract itself declares `reads` with no value
                            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                            if isinstance(t, ast.Name)}
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                if "reads" in assigned and "add" in methods:
                    found.append(node)
    return found


PACKAGE = Path(__file__).resolve().parents[2] / "mconvert"


def test_every_writer_declares_the_writer_contract():
    """Each writer subclasses `Writer` (so every capability the driver reads has its declared default), names a
    Source read the driver knows, and its add / close / abort take what the driver passes for what it feeds on."""
    import importlib
    import inspect
    import typing

    for mod in ("hf.writer", "megatron.writer", "megatron.torch_dist_writer", "deploy.fastertransformer",
                "deploy.trtllm", "deploy.gguf"):
        importlib.import_module(f"mconvert.convert.{mod}")
    classes = _writer_classes()
    assert len(classes) >= 7, [c.name for c in classes]
    subclasses, todo = {}, [Writer]
    while todo:
        for c in todo.pop().__subclasses__():
            subclasses[c.__name__] = c
            todo.append(c)
    for node in classes:
        assert any(isinstance(b, ast.Name) and b.id == "Writer" for b in node.bases), f"{node.name} is no Writer"
        cls = subclasses[node.name]
        assert cls.reads in typing.get_args(typing.get_type_hints(Writer)["reads"])
        params = list(inspect.signature(cls.add).parameters)
        assert params[1:3] == ["unit", "tensors"], node.name
        if cls.takes_parts is True and cls.reads == "mcore" or isinstance(cls.takes_parts, property):
            assert "complete" in params, f"{node.name} takes parts but not their end"
        if cls.shares_work:
            assert "needs" in vars(cls) and "skip" in vars(cls), f"{node.name} shares work without saying which"
        for name in ("close", "abort"):
            required = [p for p in list(inspect.signature(getattr(cls, name)).parameters.values())[1:]
                        if p.default is inspect.Parameter.empty]
            assert not required, f"{node.name}.{name} needs {required}"
    for name in ("MegatronWriter", "TorchDistWriter"):  # the writers a reshard with the optimizer feeds states
        assert "states" in inspect.signature(subclasses[name].add).parameters


def probes(source: str, word: str, cls: str) -> list[str]:
    """Every getattr / hasattr in `source` asked of a writer or a source: of a variable whose name holds `word`
    or of a parameter annotated with a class whose name holds `cls`; `line: call`."""
    tree = ast.parse(source)
    annotated = {a.arg for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                 for a in f.args.args + f.args.kwonlyargs + f.args.posonlyargs
                 if a.annotation is not None and cls in ast.unparse(a.annotation)}
    return [f"{c.lineno}: {ast.unparse(c)}" for c in ast.walk(tree)
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in ("getattr", "hasattr")
            and c.args and (word in ast.unparse(c.args[0]).lower()
                            or isinstance(c.args[0], ast.Name) and c.args[0].id in annotated)]


def writer_probes(source: str) -> list[str]:
    """The getattr / hasattr calls in `source` asked of a writer (`Writer`, or a name holding `writer`)."""
    return probes(source, "writer", "Writer")


def source_probes(source: str) -> list[str]:
    """The getattr / hasattr calls in `source` asked of a source (`SourceBase`, or a name holding `src` or
    `source`)."""
    return sorted(set(probes(source, "src", "Source") + probes(source, "source", "Source")),
                  key=lambda line: int(line.split(":")[0]))


def test_the_driver_reads_only_what_writers_and_sources_declare():
    """`drive` picks its read plan from the writer's and the source's declared fields (`Writer`, `SourceBase`):
    no getattr / hasattr probes a writer in the driver, nor a source in the driver, the verbs, plan or inspect."""
    from mconvert.convert import driver, verbs
    from mconvert.convert import inspect as inspect_verb
    from mconvert.layouts import plan

    assert writer_probes(Path(driver.__file__).read_text()) == []
    for module in (driver, verbs, plan, inspect_verb):
        assert source_probes(Path(module.__file__).read_text()) == [], module.__name__


def test_the_probe_check_finds_a_probe():
    """The checks above fail on a driver that probes a writer or a source, whatever its variable is called."""
    made_up = """
def drive(src, w: "Writer"):
    if hasattr(w, "needs"):
        pass
    return getattr(src, "vocab_known", True)

def feed(writer, unit, s: SourceBase):
    if hasattr(s, "hf_part_tasks"):
        return writer.wants(unit) if getattr(writer, "takes_parts", False) else None
    return hasattr(self.source, "read_mcore_parts")
"""
    assert writer_probes(made_up) == ["3: hasattr(w, 'needs')", "9: getattr(writer, 'takes_parts', False)"]
    assert source_probes(made_up) == ["5: getattr(src, 'vocab_known', True)", "8: hasattr(s, 'hf_part_tasks')",
                                      "10: hasattr(self.source, 'read_mcore_parts')"]


@pytest.mark.timeout(300)
def test_a_verb_checks_its_parallel_layout_once(models, tmp_path, monkeypatch):
    """The verb checks the target layout once (`ModelSpec.check_parallel`); the writers it builds rely on it."""
    from mconvert.spec import ModelSpec

    calls: list[tuple] = []
    check = ModelSpec.check_parallel

    def counted(self, tp, pp=1, vpp=None, ep=1, **split):  # noqa: ANN001, ANN003, ANN202
        calls.append((tp, pp))
        return check(self, tp, pp, vpp, ep, **split)

    monkeypatch.setattr(ModelSpec, "check_parallel", counted)
    for name, verb, target in [
        ("torch", lambda out: hf_to_megatron(models["hf"], out, tp=2, pp=2), (2, 2)),
        ("dist", lambda out: hf_to_megatron(models["hf"], out, tp=2, pp=1, format="torch_dist"), (2, 1)),
        ("reshard", lambda out: reshard(models["mg"], out, tp=1, pp=2), (1, 2)),  # the source's own: (1, 1)
    ]:
        calls.clear()
        verb(tmp_path / name)
        assert calls.count(target) == 1, (name, calls)
