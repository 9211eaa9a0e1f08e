"""A layout: how N GPUs are cut, and the knobs of the run; parsed, and refused when impossible.

    tp   tensor parallelism (chapter 13), with sequence parallelism (Korthikanti et al.) on
    pp   pipeline stages (chapter 14), each rank holding v of them (chapter 14b: interleaving)
    cp   context parallelism: the sequence split over a ring (chapter 15)
    dp   data-parallel replicas (chapters 02-05), their optimizer state sharded by ZeRO `zero`
         (chapter 11: 0 none, 1 states, 2 and gradients, 3 and parameters)
    ep   expert parallelism: 1 until MiniDDP has experts

tp·pp·cp·dp must be the number of GPUs. What `--layout` leaves out the plan chooses (search.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from miniddp.plan.shapes import Transformer

RECOMPUTE = ("none", "selective", "full")
FIELDS = ("tp", "pp", "cp", "dp", "ep", "v", "microbatch", "zero", "recompute")


class BadLayout(ValueError):
    """A layout that cannot run; its message names the problem and the fix."""


@dataclass(frozen=True)
class Layout:
    """One way to run: every knob set (Partial leaves some to the search)."""

    tp: int
    pp: int
    cp: int
    dp: int
    ep: int = 1
    v: int = 1
    microbatch: int = 1
    zero: int = 1
    recompute: str = "none"

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return ",".join(f"{name}={getattr(self, name)}" for name in FIELDS)


@dataclass(frozen=True)
class Partial:
    """A layout as given: None where the plan is to choose."""

    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    dp: int | None = None
    ep: int | None = None
    v: int | None = None
    microbatch: int | None = None
    zero: int | None = None
    recompute: str | None = None

    def given(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    def admits(self, layout: Layout) -> bool:
        return all(getattr(layout, name) == value for name, value in self.given().items())


def parse_layout(text: str) -> Partial:
    """'tp=8,pp=16,cp=1,dp=64[,ep=..,v=..,microbatch=..,zero=..,recompute=..]' -> Partial."""
    values: dict[str, int | str] = {}
    for part in text.split(","):
        name, sep, value = (piece.strip() for piece in part.partition("="))
        if not sep or name not in FIELDS:
            raise BadLayout(
                f"cannot read {part.strip()!r} in --layout {text!r}: give name=value pairs, the "
                f"names among {', '.join(FIELDS)}, e.g. tp=8,pp=16,cp=1,dp=64"
            )
        if name in values:
            raise BadLayout(f"--layout {text!r} gives {name} twice")
        if name == "recompute":
            if value not in RECOMPUTE:
                raise BadLayout(f"recompute={value}: choose one of {', '.join(RECOMPUTE)}")
            values[name] = value
            continue
        if not value.isdigit() or (int(value) < 1 and name != "zero") or int(value) > 1 << 20:
            raise BadLayout(f"{name}={value} in --layout: {name} is a whole number >= 1")
        values[name] = int(value)
    if values.get("zero", 1) not in (0, 1, 2, 3):
        raise BadLayout(f"zero={values['zero']}: ZeRO's stages are 0, 1, 2 and 3")
    return Partial(**values)


def layers_per_stage(model: Transformer, pp: int, v: int) -> float:
    """Layers a rank computes. Even splits only; or Llama 3's split, where the embedding and
    the loss each take a layer's place on the first and the last stage ((l + 2) / (pp·v))."""
    stages = pp * v
    if model.layers % stages == 0:
        return model.layers / pp
    return (model.layers + 2) / pp


def check_layout(layout: Layout, model: Transformer, gpus: int, seq: int, batch: int) -> None:
    """Refuse what cannot run, naming the fix (issue 46's list, in its order)."""
    if layout.gpus != gpus:
        raise BadLayout(
            f"tp·pp·cp·dp = {layout.tp}·{layout.pp}·{layout.cp}·{layout.dp} = {layout.gpus}, "
            f"not the {gpus} GPUs of --gpus: change a factor, or --gpus {layout.gpus}"
        )
    if layout.ep != 1:
        raise BadLayout("ep > 1: MiniDDP has no expert parallelism yet; leave ep=1")
    if model.heads % layout.tp or model.key_value_heads % layout.tp:
        raise BadLayout(
            f"tp={layout.tp} does not divide {model.heads} heads ({model.key_value_heads} "
            "key/value heads): each TP rank computes whole heads. Choose tp among "
            f"{[t for t in range(1, 65) if model.key_value_heads % t == 0]}"
        )
    stages = layout.pp * layout.v
    if model.layers % stages and (model.layers + 2) % stages:
        raise BadLayout(
            f"{model.layers} layers do not divide into pp·v = {layout.pp}·{layout.v} = {stages} "
            "stages (nor do layers + 2, Llama 3's split, the embedding and the loss each a "
            "layer's place): change pp or v so that pp·v divides the layers"
        )
    if layout.cp > 1 and seq % (2 * layout.cp):
        raise BadLayout(
            f"sequence {seq} is not divisible by 2·cp = {2 * layout.cp}: the load-balanced ring "
            "gives each rank two chunks of seq/(2·cp). Change --seq or cp"
        )
    if batch % (layout.dp * layout.microbatch):
        raise BadLayout(
            f"global batch {batch} is not divisible by dp·microbatch = {layout.dp}·"
            f"{layout.microbatch}: every replica runs whole microbatches. Change --global-batch, "
            "dp or microbatch"
        )
    if layout.v > 1 and layout.pp == 1:
        raise BadLayout(f"v={layout.v} without a pipeline: interleaving needs pp > 1; set v=1")
