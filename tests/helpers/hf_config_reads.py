"""The config attributes each reference implementation reads, per model_type, found by an AST walk of its
installed sources; writes `mconvert/data/hf_config_reads.json`, the set `families.hf_reads` ships.

    python tests/helpers/hf_config_reads.py            # print what would change
    python tests/helpers/hf_config_reads.py --write    # rewrite the shipped file

A read is `config.X` (any receiver whose last name is a config's: `config`, `self.config`, `hf_config`,
`text_config`, `hf_text_config`), `getattr(config, "X", ...)`, `hasattr(config, "X")`, `config.get("X")`,
`config["X"]` (and the same on the raw `config_dict`); in a config class, every `__init__` parameter, every
`kwargs.pop/get("X")`, every `self.X` its methods and properties load, and both sides of its `attribute_map`.

What counts, per model_type (the modules that build the network or compute its forward):
- transformers: `models/<type>/modeling_<type>.py` and `configuration_<type>.py` (of the vLLM venv's transformers
  for a model_type the pinned one lacks: glm4_moe_lite); `configuration_utils`
  (PretrainedConfig, with the generation defaults its __init__ consumes), `modeling_utils` (PreTrainedModel:
  weight tying, pruning, quantization, attention implementation), `modeling_rope_utils`, `masking_utils`,
  `cache_utils`, `modeling_layers`, `modeling_flash_attention_utils` and the attention integrations
  (`sdpa_attention`, `flash_attention`, `flex_attention`).
- vLLM (when its venv exists): `model_executor/models/<type>.py` and the model modules it imports, `config/`
  (ModelConfig derives the context length, window and dtype from the HF config) and `transformers_utils/`
  `config.py` / `model_arch_config_convertor.py` (they patch and read the HF config before the model is built).
Not counted: `generation/` (it picks tokens from the logits; the model-config fields it takes defaults from
are the generation defaults PretrainedConfig consumes, counted above and classified by name in
`fields.HF_COMMON`), tokenizers, pipelines, the trainer, and the quantization / PEFT / DeepSpeed integrations
(`quantization_config` is read only for block-scaled FP8, `convert/hf/fp8.py`, and refused by name otherwise).
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "mconvert" / "data" / "hf_config_reads.json"
CONFIG_NAMES = frozenset({"config", "hf_config", "text_config", "hf_text_config", "config_dict"})
TRANSFORMERS_SHARED = ("configuration_utils.py", "modeling_utils.py", "modeling_rope_utils.py", "masking_utils.py",
                       "cache_utils.py", "modeling_layers.py", "modeling_flash_attention_utils.py",
                       "integrations/sdpa_attention.py", "integrations/flash_attention.py",
                       "integrations/flex_attention.py")
VLLM_SHARED = ("config/*.py", "transformers_utils/config.py", "transformers_utils/model_arch_config_convertor.py")
# vLLM serves a model_type from a file of another name: DeepSeek-V3 from DeepSeek-V2's, its MTP layers from
# deepseek_mtp.py (GLM-4.5's from glm4_moe_mtp.py)
VLLM_MODEL_FILES = {"deepseek_v3": ("deepseek_v2", "deepseek_mtp"), "glm4_moe": ("glm4_moe", "glm4_moe_mtp"),
                    "glm4_moe_lite": ("glm4_moe_lite", "glm4_moe_lite_mtp"),
                    "gemma3_text": ("gemma3",)}
# transformers keeps a model_type's code under another model's directory: Gemma 3's text model under gemma3
TRANSFORMERS_MODEL_DIRS = {"gemma3_text": "gemma3"}


def _is_config(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in CONFIG_NAMES
    return isinstance(node, ast.Attribute) and node.attr in CONFIG_NAMES


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _called(tree: ast.AST) -> set[int]:
    """ids of the Attribute nodes that are the function of a call (`config.get_text_config()`: a method)."""
    return {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}


def config_reads(tree: ast.AST) -> set[str]:
    """Names a module reads from a config object (see the module docstring for the forms)."""
    out: set[str] = set()
    methods = _called(tree)
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and _is_config(n.value):
            if id(n) not in methods:
                out.add(n.attr)
        elif isinstance(n, ast.Call):
            f, args = n.func, n.args
            if isinstance(f, ast.Name) and f.id in ("getattr", "hasattr") and len(args) >= 2 and _is_config(args[0]):
                out.add(_text(args[1]) or "")
            elif (isinstance(f, ast.Attribute) and f.attr in ("get", "pop") and _is_config(f.value) and args):
                out.add(_text(args[0]) or "")
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and _is_config(n.value):
            out.add(_text(n.slice) or "")
    return {n for n in out if n and not n.startswith("__")}


def _is_config_class(c: ast.ClassDef) -> bool:
    return c.name.endswith("Config") or any(isinstance(b, ast.Name) and b.id.endswith("Config") for b in c.bases)


def config_class_reads(tree: ast.AST) -> set[str]:
    """What the config classes of a module consume or derive: __init__ parameters, kwargs.pop/get("X"),
    `self.X` loads in any method or property, both sides of `attribute_map`."""
    out: set[str] = set()
    for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and _is_config_class(n)):
        for n in ast.walk(c):
            if isinstance(n, ast.FunctionDef) and n.name == "__init__":
                a = n.args
                out |= {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)} - {"self"}
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and isinstance(n.value, ast.Name) \
                    and n.value.id == "self":
                out.add(n.attr)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("pop", "get") \
                    and isinstance(n.func.value, ast.Name) and n.func.value.id == "kwargs" and n.args:
                out.add(_text(n.args[0]) or "")
            elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "attribute_map"
                                                   for t in n.targets) and isinstance(n.value, ast.Dict):
                out |= {_text(x) or "" for x in (*n.value.keys, *n.value.values) if x is not None}
    return {n for n in out if n and not n.startswith("__")} - _methods_of_classes(tree)


def _methods_of_classes(tree: ast.AST) -> set[str]:
    """Method names of the module's config classes (a `self.method` load is a call, not a field)."""
    return {f.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and _is_config_class(c)
            for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)}


def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _local_imports(path: Path, package: str, seen: set[Path]) -> list[Path]:
    """`path` and, transitively, the modules of its own package it imports (`.qwen2`, `pkg.llama`)."""
    if path in seen or not path.is_file():
        return []
    seen.add(path)
    found = [path]
    for n in ast.walk(_parse(path)):
        if isinstance(n, ast.ImportFrom):
            mod = n.module or ""
            if n.level == 1:
                name = mod
            elif n.level == 0 and mod.startswith(package + "."):
                name = mod[len(package) + 1:]
            else:
                continue
            if name and "." not in name:
                found += _local_imports(path.parent / f"{name}.py", package, seen)
    return found


def transformers_sources(model_type: str) -> list[Path]:
    import transformers

    root = Path(transformers.__file__).parent
    name = TRANSFORMERS_MODEL_DIRS.get(model_type, model_type)
    model = root / "models" / name
    vllm = vllm_root()
    if not model.is_dir() and vllm is not None:  # newer than the pinned transformers: the vLLM venv's has it
        model = vllm.parent / "transformers" / "models" / name
    return [model / f"modeling_{name}.py", model / f"configuration_{name}.py",
            *(root / s for s in TRANSFORMERS_SHARED)]


def vllm_root() -> Path | None:
    """The vllm package of the venv `make vllm-env` builds, None when it is not built."""
    from mconvert.validators.vllm_check import default_vllm_venv

    venv = default_vllm_venv()
    if not (venv / ".mconvert-vllm-ok").is_file():
        return None
    return next(iter(sorted(venv.glob("lib/python3*/site-packages/vllm"))), None)


def vllm_sources(model_type: str, root: Path) -> list[Path]:
    models = root / "model_executor" / "models"
    shared = [p for s in VLLM_SHARED for p in sorted(root.glob(s))]
    seen: set[Path] = set()
    own = [p for name in VLLM_MODEL_FILES.get(model_type, (model_type,))
           for p in _local_imports(models / f"{name}.py", "vllm.model_executor.models", seen)]
    return [*own, *shared]


def _generation_defaults() -> set[str]:
    import transformers

    return set(transformers.PretrainedConfig._get_global_generation_defaults())


def reads(model_type: str, vllm: Path | None) -> dict[str, set[str]]:
    """{engine: the names its sources for `model_type` read}."""
    out: dict[str, set[str]] = {}
    names: set[str] = _generation_defaults()
    for p in transformers_sources(model_type):
        if not p.is_file():
            raise FileNotFoundError(f"transformers has no {p}: is {model_type!r} a transformers model_type?")
        tree = _parse(p)
        names |= config_reads(tree) | config_class_reads(tree)
    out["transformers"] = names
    if vllm is not None:
        files = vllm_sources(model_type, vllm)
        if not files or files[0].name != f"{VLLM_MODEL_FILES.get(model_type, (model_type,))[0]}.py":
            raise FileNotFoundError(f"vLLM has no model file for {model_type!r} under {vllm}")
        out["vllm"] = set().union(*(config_reads(_parse(p)) for p in files))
    return out


def derive(vllm: Path | None) -> dict[str, object]:
    """The shipped file's content for the installed engines."""
    import transformers

    from mconvert.mappings.families import all_families

    per_type = {f.model_type: reads(f.model_type, vllm) for f in all_families()}
    engines = {"transformers": transformers.__version__}
    if vllm is not None:
        engines["vllm"] = _vllm_version(vllm)
    return {"engines": engines,
            "model_types": {t: sorted(set().union(*r.values())) for t, r in sorted(per_type.items())}}


def _vllm_version(root: Path) -> str:
    v = root / "_version.py"
    found = re.search(r"^__version__\b.*?['\"]([^'\"]+)['\"]", v.read_text(), re.MULTILINE) if v.is_file() else None
    return found.group(1) if found else "unknown"


def main(argv: list[str]) -> int:
    got = derive(vllm_root())
    old = json.loads(SHIPPED.read_text()) if SHIPPED.is_file() else {"model_types": {}}
    for t, names in got["model_types"].items():  # type: ignore[union-attr]
        before = set(old["model_types"].get(t, ()))
        print(f"{t}: {len(names)} names; +{sorted(set(names) - before)} -{sorted(before - set(names))}")
    if "--write" in argv:
        SHIPPED.write_text(json.dumps(got, indent=1) + "\n")
        print(f"wrote {SHIPPED}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main(sys.argv[1:]))
