"""Which names a deployment format's table gives each unit's tensors, from the ModelSpec alone: what a writer
that lays its files out up front, and `plan`, need to know without touching a tensor (so no torch here);
`deploy.py` cuts the tensors themselves."""

from __future__ import annotations

from mconvert.mappings.record import DeployRule
from mconvert.mappings.wildcards import Registry, fill
from mconvert.spec import ModelSpec, ParamDecl

HEAD = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


def unit_params(spec: ModelSpec, unit: str | int) -> list[ParamDecl]:
    """The parameters ModelSpec declares for one unit (a tied model declares no head)."""
    if unit == "embedding":
        return spec.embedding_params()
    if unit == "final":
        return spec.final_params()
    return spec.layer_params(int(unit))


_REGS: dict[int, Registry] = {}


def registry(table: dict[str, DeployRule | None]) -> Registry:
    """The compiled `*` templates of a deployment table, once per table."""
    key = id(table)
    if key not in _REGS:
        _REGS[key] = Registry(table)
    return _REGS[key]


def unit_names(spec: ModelSpec, table: dict[str, DeployRule | None], unit: str | int, tied_head: bool = False,
               rank: int = 0) -> list[str]:
    """The names `rank_tensors` gives rank `rank`'s tensors of `unit` (`tied_head`: the final unit also writes
    the tied head), without cutting any tensor: what a writer that lays out its files up front needs to know
    where a unit's bytes land."""
    reg = registry(table)
    names = [d.name for d in unit_params(spec, unit)]
    if unit == "final" and tied_head and HEAD in table and table[HEAD] is not None:
        names.append(HEAD)
    out: list[str] = []
    for name in names:
        m = reg.match(name)
        if m is None or m[1] is None:
            continue
        _, rule, layer = m
        out += [fill(tpl, layer).replace("{r}", str(rank)) for tpl in rule.names]
    return out
